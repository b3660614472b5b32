import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

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


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """build(an empty directory) once per test session: its result (a path, or a dict of paths). Under
    pytest-xdist (`make test` runs two workers) the workers share one build: the first to ask builds it under a
    file lock in the session's base directory, the others wait for it and read where it is."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "built_once"  # the session's base, above each worker's own
    root.mkdir(exist_ok=True)
    record = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            (root / name).mkdir()
            result = build(root / name)
            record.write_text(json.dumps({k: str(v) for k, v in result.items()} if isinstance(result, dict)
                                         else str(result)))
    stored = json.loads(record.read_text())
    return {k: Path(v) for k, v in stored.items()} if isinstance(stored, dict) else Path(stored)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer, tiny models and the demo data set, built once per session into a temp dir."""
    import make_assets

    return built_once(tmp_path_factory, "assets", make_assets.build_default_assets)


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
    def build(where: Path) -> Path:
        run([sys.executable, "sft_warmup.py", "--model", str(tiny_assets["tiny-qwen2"]), "--data",
             str(tiny_assets["train"]), "--out", str(where / "tiny-qwen2-sft"), "--steps", "75"], timeout=600)
        return where / "tiny-qwen2-sft"

    return built_once(tmp_path_factory, "sft", build)


@pytest.fixture(scope="session")
def early_sft_model(tiny_assets, tmp_path_factory) -> Path:
    """tiny-qwen2 after 15 steps of the demo's supervised warm-up: a student that has started on the task,
    as a distilled student usually has (an untrained one puts most of its samples where the warmed
    teacher's log-probs are so low that k3's clamp at 10 stops their gradient)."""
    def build(where: Path) -> Path:
        run([sys.executable, "sft_warmup.py", "--model", str(tiny_assets["tiny-qwen2"]), "--data",
             str(tiny_assets["train"]), "--out", str(where / "tiny-qwen2-early"), "--steps", "15"], timeout=600)
        return where / "tiny-qwen2-early"

    return built_once(tmp_path_factory, "early_sft", build)


@pytest.fixture(scope="session")
def demo_reward_model(sft_model, tmp_path_factory) -> Path:
    """A learned reward model of the demo task, trained from the SFT model on its own samples
    (tests/demo_reward_model.py): it prefers correct answers."""
    import demo_reward_model

    return built_once(tmp_path_factory, "rm", lambda where: demo_reward_model.build(sft_model, where / "tiny-qwen2-rm"))


_SHORT_RUNS: dict[str, Path] = {}


@pytest.fixture
def short_runs(request, tiny_assets, sft_model, tmp_path_factory) -> Path:
    """<dir>/<name>: the runs of tests/short_runs.py that the selected tests name with
    @pytest.mark.short_run("name", ...), in a few launches (short_runs.LAUNCHES), once per session for each
    group of tests (worker_group: the TP 1 launch's tests apart from the others, so that two pytest-xdist workers
    can run them side by side). The reward model is built only when a selected case names `{reward_model}`,
    the early student only for `{student}`."""
    import short_runs as cases

    group = worker_group(request.node)
    if group not in _SHORT_RUNS:
        wanted = {name for item in request.session.items if worker_group(item) == group
                  for mark in item.iter_markers("short_run") for name in mark.args}
        _SHORT_RUNS[group] = cases.launch(sorted(wanted), tiny_assets, sft_model,
                                          tmp_path_factory.mktemp(f"short_runs_{group}"),
                                          reward_model=lambda: request.getfixturevalue("demo_reward_model"),
                                          student=lambda: request.getfixturevalue("early_sft_model"))
    return _SHORT_RUNS[group]


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


# `make test` runs two pytest-xdist workers (pytest_xdist_make_scheduler), which take whole units of tests: a
# module (its module fixtures built once), or the tests that read the runs of a group of short-run launches
# (short_run_groups: their `short_runs` fixture runs those launches once). Long units first (LONG_FIRST, a hint
# for the order only), so that the two workers end together.
LONG_FIRST = ("test_checkpoint.py", "test_faults.py", "test_train_ppo.py", "test_rollout.py", "test_memory_plan.py",
              "test_bench.py", "test_tools_demo.py", "test_lora.py", "test_models_full_params.py",
              "test_train_ppo_split.py", "test_reward_remote.py", "test_train_ppo_multinode.py", "test_moe.py",
              "test_prepare_data.py", "test_memory_rehearsal.py", "test_vision.py")


GROUPS_FILE = "TESTS_WORKER_GROUPS"  # the variable naming the file where the workers write each test's group


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):  # xdist's controller
        import tempfile

        os.environ[GROUPS_FILE] = str(Path(tempfile.mkdtemp(prefix="worker_groups_")) / "groups.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler by whole work units, a unit being a worker group (worker_group) or a module. The
    units come from the file the workers write at collection: pytest-xdist 3.8's own groups (xdist_group marks)
    do not reach its scheduler under pytest 9, whose node ids it cannot extend."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return json.loads(Path(os.environ[GROUPS_FILE]).read_text())[nodeid]

    return ByWorkerGroup(config, log)


def short_run_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each short-run launch's group: launches that one test reads together (a comparison across them, or a
    case that NEEDS another's files) are one group, whose fixture runs them on one worker."""
    import short_runs as cases

    parent = {launch: launch for launch in cases.LAUNCHES}

    def root(launch: str) -> str:
        while parent[launch] != launch:
            launch = parent[launch]
        return launch

    for item in items:
        launches = sorted({cases.launch_of(name) for name in _short_runs_read(item)})
        for other in launches[1:]:
            parent[root(other)] = root(launches[0])
    members: dict[str, list[str]] = {}
    for launch in cases.LAUNCHES:
        members.setdefault(root(launch), []).append(launch)
    return {launch: "short_runs_" + "+".join(members[root(launch)]) for launch in cases.LAUNCHES}


def _short_runs_read(item: pytest.Item) -> set[str]:
    import short_runs as cases

    names = {name for mark in item.iter_markers("short_run") for name in mark.args}
    return names | {need for name in names for need in cases.NEEDS.get(name, ())}


def worker_group(item: pytest.Item) -> str | None:
    """The group of short-run launches whose runs a test reads (short_run_groups), None for a test that reads
    none (its unit is its module)."""
    import short_runs as cases

    names = _short_runs_read(item)
    if not names:
        return None
    if not hasattr(item.session, "short_run_groups"):
        item.session.short_run_groups = short_run_groups(item.session.items)
    return item.session.short_run_groups[cases.launch_of(min(names))]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # the short runs' groups first, then the long modules (make test passes --no-loadscope-reorder: the workers
    # take units in this order), the rest after them in their modules' order
    session.short_run_groups = short_run_groups(items)

    def order(item: pytest.Item) -> tuple[int, int]:
        if group := worker_group(item):
            return 0, 0 if group == session.short_run_groups["tp1"] else 1  # the TP 1 launch is the longest
        return (1, LONG_FIRST.index(item.path.name)) if item.path.name in LONG_FIRST else (2, 0)

    items.sort(key=order)
    if (where := os.environ.get(GROUPS_FILE)) and hasattr(config, "workerinput"):  # a pytest-xdist worker
        # for the scheduler (ByWorkerGroup): each test's group, or its module (its module fixtures built once)
        groups = {item.nodeid: worker_group(item) or f"module {item.path.name}" for item in items}
        tmp = Path(f"{where}.{config.workerinput['workerid']}")
        tmp.write_text(json.dumps(groups))
        tmp.replace(where)  # whole: every worker writes the same
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="starts a local SLURM cluster: run with --slurm (make test-slurm)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


_BUSY: dict[tuple[str, str], float] = {}  # (worker, group) -> seconds its tests took (setup, call and teardown)
_GROUPS: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if (where := os.environ.get(GROUPS_FILE)) and (node := getattr(report, "node", None)) is not None:  # controller
        if report.nodeid not in _GROUPS:
            _GROUPS.update(json.loads(Path(where).read_text()))
        group = _GROUPS.get(report.nodeid, "?")
        group = group if not group.startswith("module ") else "modules"
        key = (node.gateway.id, group)
        _BUSY[key] = _BUSY.get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Under pytest-xdist: how long each worker spent on each group's tests, to see which worker set the suite's time."""
    if _BUSY:
        for worker in sorted({w for w, _ in _BUSY}):
            parts = sorted(((g, s) for (w, g), s in _BUSY.items() if w == worker), key=lambda p: -p[1])
            terminalreporter.write_line(f"{worker} busy {sum(s for _, s in parts):.0f} s: "
                                        + ", ".join(f"{g} {s:.0f} s" for g, s in parts))


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
