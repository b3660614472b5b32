import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
# The repo is a set of flat scripts; make them importable from the tests without installing.
sys.path.insert(0, str(ROOT))
# vLLM's sampler runs one small op (the rank of each sampled token's log-prob) through torch.compile, and
# the first generate of every engine process pays ~3 s of dynamo tracing for it; eager gives the same
# integers. The tests and every process they start (clean_env copies this environment) run it eagerly;
# nothing here changes a user's run.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer, tiny models and the demo data set, built once per session into a temp dir."""
    import make_assets

    return make_assets.build_default_assets(tmp_path_factory.mktemp("assets"))


# The CPU set-up's stand-in for torchvision (tests/cpu_compat/sitecustomize.py), which Qwen2-VL's processor and
# vLLM's Qwen2-VL model need: on PYTHONPATH for the processes a VLM test starts, loaded here for in-process checks.
CPU_COMPAT = ROOT / "tests" / "cpu_compat"


def vl_env(**extra: str) -> dict[str, str]:
    """clean_env with the torchvision stand-in on PYTHONPATH (it steps aside where torchvision is installed)."""
    env = clean_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_COMPAT), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="session")
def vl_assets(tmp_path_factory) -> dict[str, Path]:
    """tiny-qwen2-vl and tiny-qwen2.5-vl (make_assets.build_vl_assets), with the stand-in loaded in this process."""
    import importlib.util

    import make_assets

    spec = importlib.util.spec_from_file_location("cpu_compat_sitecustomize", CPU_COMPAT / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return make_assets.build_vl_assets(tmp_path_factory.mktemp("vl_assets"))


@pytest.fixture(scope="session")
def sft_model(tiny_assets, tmp_path_factory) -> Path:
    """tiny-qwen2 after the demo's short supervised warm-up: a weak solver RL can improve."""
    out = tmp_path_factory.mktemp("sft") / "tiny-qwen2-sft"
    run([sys.executable, "sft_warmup.py", "--model", str(tiny_assets["tiny-qwen2"]), "--data", str(tiny_assets["train"]),
         "--out", str(out), "--steps", "75"], timeout=600)
    return out


@pytest.fixture(scope="session")
def early_sft_model(tiny_assets, tmp_path_factory) -> Path:
    """tiny-qwen2 after 15 steps of the demo's supervised warm-up: a student that has started on the task,
    as a distilled student usually has (an untrained one puts most of its samples where the warmed
    teacher's log-probs are so low that k3's clamp at 10 stops their gradient)."""
    out = tmp_path_factory.mktemp("early_sft") / "tiny-qwen2-early"
    run([sys.executable, "sft_warmup.py", "--model", str(tiny_assets["tiny-qwen2"]), "--data", str(tiny_assets["train"]),
         "--out", str(out), "--steps", "15"], timeout=600)
    return out


@pytest.fixture(scope="session")
def demo_reward_model(sft_model, tmp_path_factory) -> Path:
    """A learned reward model of the demo task, trained from the SFT model on its own samples
    (tests/demo_reward_model.py): it prefers correct answers."""
    import demo_reward_model

    return demo_reward_model.build(sft_model, tmp_path_factory.mktemp("rm") / "tiny-qwen2-rm")


@pytest.fixture(scope="session")
def short_runs(request, tiny_assets, sft_model, tmp_path_factory) -> Path:
    """<dir>/<name>: the runs of tests/short_runs.py that the selected tests name with
    @pytest.mark.short_run("name", ...), in a few launches (short_runs.LAUNCHES). The reward model is
    built only when a selected case names `{reward_model}`, the early student only for `{student}`."""
    import short_runs as cases

    wanted = {name for item in request.session.items for mark in item.iter_markers("short_run") for name in mark.args}
    return cases.launch(sorted(wanted), tiny_assets, sft_model, tmp_path_factory.mktemp("short_runs"),
                        reward_model=lambda: request.getfixturevalue("demo_reward_model"),
                        student=lambda: request.getfixturevalue("early_sft_model"))


def short_run(short_runs: Path, name: str) -> Path:
    """One short run's directory; the test asking must carry @pytest.mark.short_run(name)."""
    import short_runs as cases

    out, launch = short_runs / name, short_runs / cases.launch_of(name)
    assert out.is_dir(), f"{name} did not run: mark the test @pytest.mark.short_run({name!r})"
    finished = (f"case {name} done", f"case {name} stopped, as expected")
    if not any(line.startswith(finished) for line in launch.with_suffix(".out").read_text().splitlines()):
        failed = launch.with_suffix(".failed")
        raise AssertionError(f"{name} did not finish; its launch's output ends:\n"
                             + (failed.read_text() if failed.is_file() else "(it did not fail)"))
    return out


@contextmanager
def one_rank_process_group() -> Iterator[None]:
    """A real gloo process group of one rank in this process (FSDP2 needs one), torn down after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a free port, never a hard-coded one
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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


def forward_batch(vocab: int) -> dict[str, torch.Tensor]:
    """A batch for models.compute_log_probs / compute_values: 3 sequences of 6 prompt + 5 response
    tokens, the first prompt left-padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -5:]}


# Variables torchrun sets for its workers: a child launch must not inherit a parent launch's.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this one's, without torchrun's rank variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}, **extra}


def torchrun_cmd(nproc: int, script: str | Path, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """`torchrun --nproc_per_node=N [launcher args] script args`; --standalone (a free rendezvous port)
    unless launcher args say otherwise (multi-node tests pass their own rendezvous)."""
    rendezvous = launcher if any(a.startswith("--rdzv") for a in launcher) else ("--standalone", *launcher)
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}", str(script),
            *map(str, args)]


def run(cmd: list[str], timeout: float = 900, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command from the repo root with a deadline; with check, a non-zero exit fails the test
    and shows the ends of its output."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def torchrun(nproc: int, script: str | Path, *args: str, timeout: float = 900,
             env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """A real multi-process launch of `script` (real gloo process groups); fails the test on a non-zero exit."""
    return run(torchrun_cmd(nproc, script, *args, launcher=launcher), timeout=timeout, env=env)


def start_reward_server(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """tests/reward_server.py as a process on a free port: (the process, its base URL). Kill it after."""
    os.environ.update(no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost")  # never via a proxy
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reward_server.py")),
                             *(["--log", str(log)] if log else [])], stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slurm", action="store_true",
                     help="also run the tests marked `slurm`: they start a local SLURM cluster (root; apt-get "
                     "installs SLURM and munge when missing). `make test-slurm` runs them.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="starts a local SLURM cluster: run with --slurm (make test-slurm)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def chromium() -> Callable[..., str]:
    """trace_viewer.chromium (headless Chromium: a page's DOM after its scripts ran). `make test` installs
    Debian's package first, so there a missing browser fails the test; a plain pytest run without it
    skips, saying how to install it."""
    import trace_viewer

    if trace_viewer.chromium_binary() is None:
        why = "needs headless Chromium: apt-get install chromium (as root: make chromium)"
        if os.environ.get("MAKELEVEL"):  # under make, which was to install it
            pytest.fail(why)
        pytest.skip(why)
    return trace_viewer.chromium


class DomNodes(HTMLParser):
    """Every element of an HTML document as (tag, attrs, text directly inside it), in document order."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.nodes: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[int] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.nodes.append((tag, {k: v or "" for k, v in attrs}, []))
        if tag not in ("meta", "input", "br", "img", "circle", "rect", "polyline", "link"):
            self._open.append(len(self.nodes) - 1)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self.nodes[self._open.pop()][0] == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._open:
            self.nodes[self._open[-1]][2].append(data)

    def with_class(self, name: str) -> list[tuple[str, dict[str, str], str]]:
        return [(tag, attrs, "".join(text)) for tag, attrs, text in self.nodes if name in attrs.get("class", "").split()]
