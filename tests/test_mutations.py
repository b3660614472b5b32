"""tests/mutations.py stays in step with the code it mutates."""

from pathlib import Path

import mutations


def test_every_mutation_still_anchors_in_the_source():
    """tests/mutations.py plants each bug by replacing text that must be in its file exactly once, and
    names a test that exists: a refactor that moves the text makes the mutation stale, found here in the
    fast suite rather than in the next mutation run."""
    root = Path(mutations.ROOT)
    for mutation in mutations.MUTATIONS:
        source = (root / mutation.file).read_text()
        for old, _ in mutation.edits:
            assert source.count(old) == 1, (mutation.name, old[:60])
        node = mutation.test.partition(" -k ")[0]
        path, _, name = node.partition("::")
        assert (root / path).is_file(), (mutation.name, path)
        assert not name or f"def {name.split('[')[0]}(" in (root / path).read_text(), (mutation.name, name)
