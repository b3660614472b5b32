"""What every benchmark script shares: model sizes, the device and its dtype, peak memory, launching
torchrun workers, and writing tables and JSON.

Each bench_*.py is both a launcher and (with --worker) the program torchrun runs on every rank:

    python bench/bench_sync.py --models 30m          # launches torchrun, prints a table, writes JSON

Models are Qwen2s built from a transformers config by make_assets.py (random init, the repo's 128-token
character tokenizer, no downloads) into <assets>/bench-<size>. Every width divides by TP=2 and heads
are >= 32 wide (vLLM's CPU attention supports head sizes 32, 64, 80, ...).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# The repo is flat scripts at the top level; make them importable from bench/ (hence E402 below).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import make_assets  # noqa: E402
from mesh_utils import ParallelDims, build_meshes, init_distributed  # noqa: E402

# name -> make_assets.model_config dimensions (about that many parameters with the 128-token vocabulary)
SIZES: dict[str, dict[str, int]] = {
    "5m": dict(hidden=256, layers=8, heads=8, kv_heads=2, intermediate=512),
    "15m": dict(hidden=384, layers=10, heads=6, kv_heads=2, intermediate=1024),
    "30m": dict(hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1408),
    "100m": dict(hidden=1024, layers=9, heads=16, kv_heads=4, intermediate=2752),
    "700m": dict(hidden=2048, layers=16, heads=16, kv_heads=4, intermediate=5632),  # GPU checks
}
DEFAULT_ASSETS = ROOT / "assets"
DEFAULT_OUT = ROOT / "outputs" / "bench"
EOS_TOKEN_ID, PAD_TOKEN_ID = 1, 0  # make_assets' tokenizer: <pad>=0, <eos>=1


# ---------------------------------------------------------------------------------------------
# Models


def ensure_assets(assets: Path) -> dict[str, Path]:
    """The repo's default assets (tokenizer, tiny models, the demo data set); idempotent."""
    return make_assets.build_default_assets(assets)


def resolve_model(spec: str, assets: Path) -> Path:
    """A size name from SIZES (built on first use), "tiny" (assets/tiny-qwen2), or a model directory."""
    if spec in SIZES:
        path = assets / f"bench-{spec}"
        config = make_assets.model_config("qwen2", **SIZES[spec], tied=False)
        make_assets.build_model(path, config, seed=0)  # no-op when it exists
        return path
    if spec == "tiny":
        return ensure_assets(assets)["tiny-qwen2"]
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise SystemExit(f"model {spec!r} is neither a size ({', '.join(SIZES)}, tiny) nor a model directory")
    return path


def model_label(spec: str) -> str:
    return spec if spec in SIZES or spec == "tiny" else Path(spec).name


def split_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def random_prompts(num: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """num prompts of random non-special tokens (ids >= 4), lengths uniform in [lengths[0], lengths[1]]."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (num,), generator=g)
    return [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in sizes]


# ---------------------------------------------------------------------------------------------
# Device, timing, memory


def device_and_dtype() -> tuple[str, str]:
    """("cuda", "bfloat16") on a GPU, ("cpu", "float32") elsewhere: bf16 matmuls are slow on CPUs."""
    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of fn(), with the accelerator synchronised on both sides."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - start, result


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


class PeakMemory:
    """Peak memory of one phase: reset(), run the phase, then peak_gb().

    On CUDA: torch's peak allocation (vLLM's KV cache and weights included: they come from torch's
    allocator), and the device memory in use at the end (what nvidia-smi shows). On the CPU: the
    process's peak resident set, reset through /proc/self/clear_refs (Linux), so it is per phase too;
    freed heap memory is trimmed first so a phase cannot hide its allocations in reused pages.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            # Hand freed heap pages back to the kernel first, or the phase would reuse them without its
            # resident set growing and the peak would miss what the phase allocates.
            _malloc_trim()
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS

    def current_gb(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / 1e9
        return _proc_status_kib("VmRSS") * 1024 / 1e9

    def peak_gb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 1e9
        return _proc_status_kib("VmHWM") * 1024 / 1e9

    def device_used_gb(self) -> float:
        """Whole-device memory in use (CUDA), or the current RSS (CPU)."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            return (total - free) / 1e9
        return self.current_gb()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then undercount reused memory
        pass


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"date": date.today().isoformat(), "cpu_count": os.cpu_count(),
                            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                            "device": "cpu"}
    try:  # optional here: device_check.py runs on GPU images without vLLM
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


# ---------------------------------------------------------------------------------------------
# Launching workers


def clean_env() -> dict[str, str]:
    """The environment for a child torchrun: no rank variables leaking from a parent launch."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun(script: Path | str, nproc: int, args: Sequence[str], log_file: Path, timeout: int = 1800,
             python: Path | str = sys.executable) -> float:
    """Run `script` on nproc ranks (torchrun --standalone picks a free port) with `python` (another
    venv's, for a peer framework); its output goes to log_file. Returns wall seconds; raises with the
    log's tail if it fails."""
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_file, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if proc.returncode != 0:
        tail = log_file.read_text()[-6000:]
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); log {log_file}:\n{tail}")
    return time.perf_counter() - start


def read_rank_files(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def launch_workers(script: Path | str, world: int, specs: Sequence[str], paths: Sequence[str],
                   args: Sequence[Any], log_file: Path) -> tuple[float, list[dict]]:
    """Run a bench script's worker (`script --worker`) on `world` ranks over the given models; returns
    wall seconds and each rank's JSON (what run_worker wrote)."""
    with tempfile.TemporaryDirectory() as tmp:
        wall = torchrun(script, world, ["--worker", "--rank-dir", tmp, "--models", ",".join(map(model_label, specs)),
                                        "--model-paths", ",".join(map(str, paths)), *args], log_file)
        return wall, read_rank_files(Path(tmp), world)


def run_worker(bench_model: Callable[..., tuple[dict, Any]], args: Any, tp: int) -> None:
    """The body every bench worker shares: process group, meshes (FSDP over all ranks, vLLM TP=tp),
    then bench_model(label, path, meshes, env, args) -> (result, engine) per model, each result
    printed and all of them written to <rank-dir>/rank<R>.json."""
    import rollout as ro  # here, not at the top: rollout needs vLLM, which device_check.py's images lack

    env = init_distributed()
    world = env.world_size
    meshes = build_meshes(ParallelDims(world, 1, world, world, tp, 1), env.device_type)
    results, engines = [], []
    for label, path in zip(split_list(args.models), split_list(args.model_paths), strict=True):
        # Earlier engines stay referenced and idle: a collected engine shuts itself down, and that
        # tears down the process group the next one needs.
        result, llm = bench_model(label, Path(path), meshes, env, args)
        results.append(result)
        engines.append(llm)
        print(json.dumps(result), flush=True)
    write_json(args.rank_dir / f"rank{env.rank}.json", {"machine": machine_info(), "results": results})
    if engines:
        ro.shutdown(engines[-1])


def gpus_available() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_world_fits(world: int) -> bool:
    """On a GPU machine, a world of N ranks needs N GPUs; a CPU machine runs any world (gloo)."""
    gpus = gpus_available()
    return gpus == 0 or world <= gpus


def fit_world(world: int) -> int:
    """world, or as many ranks as there are GPUs on a machine with fewer."""
    gpus = gpus_available()
    return world if gpus == 0 else min(world, gpus)


# ---------------------------------------------------------------------------------------------
# Output


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) if spec else str(value)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table: columns are (key, header, format spec); missing values print as '-'."""
    cells = [[header for _, header, _ in columns]]
    cells += [[fmt(row.get(key), spec) for key, _, spec in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_tables(tables: list[tuple[str, list[dict], list[tuple[str, str, str]]]]) -> None:
    for title, rows, columns in tables:
        print(title)
        print(table(rows, columns))


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---:" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), s) for k, _, s in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])
