"""The repo's top-level modules form layers: no import cycle (imports inside functions and under
TYPE_CHECKING count), the low modules import nothing above them, and the layout planner imports no torch."""

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

MODULES = {p.stem for p in ROOT.glob("*.py")}


def imported(module: str) -> set[str]:
    """The repo modules module.py imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & (MODULES - {module})


GRAPH = {m: imported(m) for m in MODULES}
# The floors: each module here may import only the repo modules named (rollout: vLLM, and nothing of ours;
# tracking: the step statistics use ppo_core's masked variance).
BASE = {"config", "attention"}
FLOORS = {"config": set(), "attention": set(), "rollout": set(), "tracking": {"config", "ppo_core"},
          "collectives": set(), "offload": {"config"}, "http_json": {"config"}, "mesh_utils": BASE, "ppo_core": BASE}
# Entry points: command lines that no library module imports (the tests and benches may).
ENTRY_POINTS = {"memory_plan", "train_ppo", "sft_warmup", "prepare_data", "make_assets", "export_hf", "trace_viewer"}


def test_no_import_cycle():
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(module):], module]))
        if module not in done:
            for dep in sorted(GRAPH[module]):
                visit(dep, [*path, module])
            done.add(module)

    for module in sorted(GRAPH):
        visit(module, [])


@pytest.mark.parametrize("module", sorted(FLOORS))
def test_low_modules_import_nothing_above_them(module):
    above = GRAPH[module] - FLOORS[module]
    assert not above, f"{module}.py imports {sorted(above)}; it may import only {sorted(FLOORS[module]) or 'none'}"


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_entry_points_are_imported_by_no_library_module(module):
    """The memory planner in particular: the trainer places its models with offload.py's rules, so the
    estimator is a planner that nothing at run time depends on."""
    assert not [m for m in MODULES if module in GRAPH[m]], [m for m in MODULES if module in GRAPH[m]]


def test_the_layout_planner_imports_no_torch(tmp_path):
    """`python mesh_utils.py` gates every launch script, so it starts at once, even with a config.json at hand."""
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "-X", "importtime", "mesh_utils.py", "--config",
                          "configs/gsm8k_grpo_1node_6gpu.yaml", f"actor_rollout_ref.model.path={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines()}
    assert not loaded & {"torch", "transformers", "vllm", "memory_plan"}, sorted(loaded & {"torch", "memory_plan"})
