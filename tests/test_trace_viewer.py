"""trace_viewer.py: the page a run directory becomes, as headless Chromium shows it after its scripts ran.

A hand-written run directory (the trainer's file layout, and model text that tries to be HTML) is
rendered and loaded in Chromium; what the page shows is read back from the DOM and checked against
the records. The page of a real run is checked in tests/test_train_ppo.py (the multi-turn run).
"""

import json
from pathlib import Path

from conftest import DomNodes

import trace_viewer

HOSTILE = '<script>document.body.dataset.pwned = "1"</script><img src=x onerror="document.body.dataset.pwned=1">'


def token_record(step: int, pieces: list[str], advantages: list[float], gaps: list[float | None],
                 mask: list[int]) -> dict:
    return {"input": "3+5=", "output": "".join(pieces), "gts": "8", "score": 1.0, "step": step, "acc": 1.0,
            "data_source": "arithmetic", "prompt_index": 0, "advantage": advantages[0],
            "tokens": list(range(len(pieces))), "pieces": pieces, "mask": mask, "token_advantages": advantages,
            "logprob_gap": gaps}


def write_run(run_dir: Path) -> tuple[Path, list[dict]]:
    """A run directory as the trainer leaves it, with rollout dumps outside it (config.yaml names them)."""
    rollout_dir = run_dir.parent / "dumps"
    rollout_dir.mkdir(parents=True)
    (run_dir / "val_generations").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "val/score": 0.25}, {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": 0.1},
        {"step": 2, "critic/score/mean": 0.75, "actor/pg_loss": -0.2, "val/score": 0.5}]))
    (run_dir / "config.yaml").write_text(f"data:\n  train_batch_size: 2\ntrainer:\n  default_local_dir: {run_dir}\n"
                                         f"  rollout_data_dir: '{rollout_dir}'\n  validation_data_dir: null\n")
    step2 = [token_record(2, ["#### ", HOSTILE, "8"], [1.5, 1.5, 0.0], [2e-6, None, 0.05], [1, 0, 1]),
             token_record(2, ["</script>", "7"], [-0.5, -1.5], [0.3, 0.005], [1, 1])]
    (rollout_dir / "1.jsonl").write_text(json.dumps(token_record(1, ["8"], [0.2], [0.0], [1])) + "\n")
    (rollout_dir / "2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step2))
    turns = [{"role": "assistant", "text": "calc(3+5)", "tokens": 4, "trained": True},
             {"role": "tool", "text": HOSTILE, "tokens": 9, "trained": False}]
    (run_dir / "val_generations" / "2.jsonl").write_text(json.dumps(
        {"input": "3+5=", "output": "calc(3+5)" + HOSTILE, "gts": "8", "score": 0.0, "step": 2, "turns": turns}) + "\n")
    return rollout_dir, step2


def test_the_page_shows_steps_samples_and_coloured_tokens(tmp_path, chromium):
    run_dir = tmp_path / "run"
    _, step2 = write_run(run_dir)
    trace_viewer.main([str(run_dir)])  # found through config.yaml; validation at its default
    page = run_dir / "traces.html"
    text = page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    dom = DomNodes(chromium(page, fragment="step=rollout:2&colour=advantage"))
    body = next(attrs for tag, attrs, _ in dom.nodes if tag == "body")
    assert "data-pwned" not in body and body["class"] == "mode-advantage"  # the model's text never ran
    assert [t for _, _, t in dom.with_class("step")] == ["step 1 (1)", "step 2 (2)", "step 2 (1)"]
    assert [t for _, _, t in dom.with_class("view-title")] == ["training step 2: 2 of 2 samples"]
    assert len(dom.with_class("sample")) == 2
    tokens = [(attrs["class"].split(), t) for _, attrs, t in dom.with_class("tok") if "title" in attrs]
    assert [t for _, t in tokens] == [p for r in step2 for p in r["pieces"]]  # <script> shown as its text
    # colour classes, against the records: the advantage's sign, and a level per third of the step's largest
    # |advantage|; the gap's size; none on an untrained token
    expected = [["a-p3", "g0"], ["untrained"], ["a-z", "g2"], ["a-n1", "g3"], ["a-n3", "g1"]]
    assert [c[1:] for c, _ in tokens] == expected
    svg_titles = [t for _, _, t in dom.with_class("title")]
    assert svg_titles == ["critic/score/mean", "val/score", "actor/pg_loss"]

    gap_view = DomNodes(chromium(page, fragment="step=rollout:2&colour=gap"))
    assert next(attrs for tag, attrs, _ in gap_view.nodes if tag == "body")["class"] == "mode-gap"
    checked = [attrs["value"] for tag, attrs, _ in gap_view.nodes if tag == "input" and "checked" in attrs]
    assert [t for _, _, t in gap_view.with_class("legend")] == ["engine - actor log-prob: "] and checked

    val = DomNodes(chromium(page, fragment="step=validation:2"))
    turns = [(attrs["class"], t) for _, attrs, t in val.with_class("turn-text")]
    assert [t for _, t in turns] == ["calc(3+5)", HOSTILE]
    assert [t for _, _, t in val.with_class("role")] == ["assistant · 4 tokens", "tool (not trained) · 9 tokens"]
    assert "data-pwned" not in next(attrs for tag, attrs, _ in val.nodes if tag == "body")


def test_config_values_are_read_without_a_yaml_parser(tmp_path):
    import yaml

    from config import load_config, to_yaml

    cfg = load_config("configs/tiny_cpu.yaml", [f"trainer.rollout_data_dir={tmp_path}/it's here",
                                                "trainer.default_local_dir=x"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert yaml.safe_load(to_yaml(cfg))["trainer"]["rollout_data_dir"] == f"{tmp_path}/it's here"
    assert trace_viewer.config_value(tmp_path, "rollout_data_dir") == f"{tmp_path}/it's here"
    assert trace_viewer.config_value(tmp_path, "validation_data_dir") is None
