import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# The repo is a set of flat scripts; make them importable from the tests without installing.
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer, tiny models and the demo data set, built once per session into a temp dir."""
    import make_assets

    return make_assets.build_default_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def sft_model(tiny_assets, tmp_path_factory) -> Path:
    """tiny-qwen2 after the demo's short supervised warm-up: a weak solver RL can improve."""
    out = tmp_path_factory.mktemp("sft") / "tiny-qwen2-sft"
    proc = subprocess.run([sys.executable, "sft_warmup.py", "--model", str(tiny_assets["tiny-qwen2"]),
                           "--data", str(tiny_assets["train"]), "--out", str(out), "--steps", "75"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def run_gloo(worker: Callable[..., None], world: int, *args: object, timeout_s: float = 120) -> None:
    """Run worker(rank, *args) on `world` spawned processes (real process groups, no torchrun); a
    deadlock fails the test after timeout_s instead of hanging the suite."""
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} spawned workers did not finish within {timeout_s:.0f} s")


def clean_env() -> dict[str, str]:
    """The environment for a child torchrun: no rank variables leaking from a parent launch."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}
