"""Weight sync (FSDP2 actor -> collocated vLLM engine): seconds per sync against the memory-copy floor
measured in the same run, where the time goes, and the extra peak memory a sync needs.

    python bench/bench_sync.py                                   # layouts 1x1,2x1,2x2; sizes 5m,30m,100m
    python bench/bench_sync.py --layouts 1x1,2x2 --models 100m --reps 5

A layout WxT is torchrun --nproc_per_node=W with vLLM tensor parallel size T (FSDP over all W ranks,
as train_ppo.py does): 1x1 has nothing to gather (the engine's side alone), 2x1 is two engines of one
rank each (configs/tiny_cpu.yaml), 2x2 one engine over two ranks. For each model, on every rank at once:
  copy_floor   bytes / bandwidth of one torch copy_ of the same number of bytes: the floor for moving
               the parameters once (bytes = every full parameter as iter_full_params yields it)
  gather_floor one all_gather_into_tensor of the same bytes over the FSDP group: the floor of the
               transport (gloo over loopback TCP on a CPU box, NCCL on GPUs); 0 in a world of one
  gather       iterating models.iter_full_params(actor) alone: bucketed all-gathers, no engine
  engine_load  rollout.sync_weights from already-gathered tensors: vLLM's side alone
  sync         rollout.sync_weights(llm, iter_full_params(actor)), what train_ppo.py does every step
  extra_peak   peak memory during one sync minus memory before it (CUDA: torch's peak allocation;
               CPU: peak resident set, reset per sync through /proc/self/clear_refs)
Also, in bf16, casting each shard first and gathering half the bytes (what iter_full_params does)
against gathering the fp32 master shards and casting after.

LoRA (--lora-rank R, 0 to skip): the same model with an adapter of rank R, once on every linear layer
(all-linear) and once on q_proj,v_proj, synced as train_ppo.py does after its first sync: the merged
weights of the target modules (and those vLLM fuses with them) only. lora_sync_s against the full
sync_s of the same model and layout is the saving.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import rollout as ro
from lora import LoraSpec, iter_sync_params, sync_modules
from mesh_utils import DistEnv, Meshes
from models import default_dtypes, iter_full_params, load_causal_lm

if TYPE_CHECKING:
    from vllm import LLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="5m,30m,100m", help=f"comma list: sizes {list(bc.SIZES)}, tiny, or paths")
    ap.add_argument("--layouts", default="1x1,2x1,2x2", help="comma list of WORLDxTP")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each measurement (median)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA cases' adapter rank (0: no LoRA cases)")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "sync.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-paths", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker (every rank)


def iter_full_params_gather_first(model: torch.nn.Module,
                                  dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_full_params, except each shard is gathered in its master dtype and cast after (the
    order iter_full_params avoids: twice the bytes when the masters are fp32 and dtype bf16)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        tensor = param.detach()
        yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).to(dtype)


def repeat(fn: Callable[[], object], reps: int) -> list[float]:
    """reps timings of fn(), every rank starting together (they move weights together in training)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        times.append(bc.timed(fn)[0])
    return times


def copy_floor(nbytes: int, numels: list[int], dtype: torch.dtype, device: torch.device,
               reps: int) -> tuple[float, float]:
    """Seconds for one torch copy_ of nbytes, and for per-parameter copies of the same sizes (the floor
    for a loader that copies tensor by tensor), on every rank at once."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)  # both written, so no first-touch page faults inside the timing
    bulk = bc.median(repeat(lambda: dst.copy_(src), reps))
    srcs = [torch.ones(n, dtype=dtype, device=device) for n in numels]
    dsts = [torch.zeros_like(s) for s in srcs]
    per_tensor = bc.median(repeat(lambda: [d.copy_(s) for d, s in zip(dsts, srcs, strict=True)], reps))
    return bulk, per_tensor


def gather_floor(nbytes: int, reps: int, device: torch.device) -> float:
    """Seconds for one all_gather_into_tensor that leaves nbytes on every rank: what the transport
    allows for gathering the parameters, with no per-tensor overhead."""
    world = dist.get_world_size()
    if world == 1:
        return 0.0
    shard = torch.ones(nbytes // world, dtype=torch.uint8, device=device)
    full = torch.empty(shard.numel() * world, dtype=torch.uint8, device=device)
    return bc.median(repeat(lambda: (dist.all_gather_into_tensor(full, shard), bc.synchronize()), reps))


def engine_load(llm: LLM, actor: torch.nn.Module, dtype: torch.dtype, reps: int) -> float:
    """sync_weights from tensors gathered beforehand: vLLM's side of the sync alone."""
    gathered = list(iter_full_params(actor, dtype=dtype))
    return bc.median(repeat(lambda: ro.sync_weights(llm, iter(gathered)), reps))


LORA_TARGETS = ("all-linear", ("q_proj", "v_proj"))


def lora_sync(path: Path, meshes: Meshes, llm: LLM, targets: str | tuple[str, ...], rank: int,
              device: torch.device, reps: int) -> dict:
    """Seconds of a LoRA sync after the first (merged target modules only), and the bytes it moves."""
    param_dtype, reduce_dtype = default_dtypes(device.type)
    spec = LoraSpec(rank, float(rank), targets, None, str(path))
    actor = load_causal_lm(str(path), meshes.fsdp, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           wrap=spec.add_adapter)
    modules = sync_modules(actor, ro.packed_modules(llm))
    ro.sync_weights(llm, iter_sync_params(actor, param_dtype))  # the first sync: every weight, merged
    nbytes = sum(t.numel() * t.element_size() for _, t in iter_sync_params(actor, param_dtype, modules))
    times = repeat(lambda: ro.sync_weights(llm, iter_sync_params(actor, param_dtype, modules), partial=True), reps)
    return {"targets": targets if isinstance(targets, str) else ",".join(targets), "rank": rank,
            "lora_bytes_gb": nbytes / 1e9, "lora_sync_s": bc.median(times), "lora_sync_s_reps": times}


def bench_model(label: str, path: Path, meshes: Meshes, env: DistEnv,
                args: argparse.Namespace) -> tuple[dict, LLM]:
    device_type, engine_dtype = bc.device_and_dtype()
    device = env.device
    param_dtype, reduce_dtype = default_dtypes(device_type)
    actor = load_causal_lm(str(path), meshes.fsdp, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    llm = ro.build_rollout_engine(str(path), meshes.rollout, max_model_len=64,
                                  gpu_memory_utilization=args.gpu_memory_utilization, dtype=engine_dtype,
                                  enforce_eager=device_type == "cpu", max_num_seqs=16)
    elem = torch.empty((), dtype=param_dtype).element_size()
    numels = [p.numel() for _, p in actor.named_parameters(remove_duplicate=False)]  # global sizes, tied twice
    nbytes = sum(numels) * elem
    ro.sync_weights(llm, iter_full_params(actor, dtype=param_dtype))  # warm-up: vLLM records layer metadata once
    copy_s, per_tensor_copy_s = copy_floor(nbytes, numels, param_dtype, device, args.reps)
    gather_floor_s = gather_floor(nbytes, args.reps, device)
    gather_s = bc.median(repeat(lambda: sum(1 for _ in iter_full_params(actor, dtype=param_dtype)), args.reps))
    engine_s = engine_load(llm, actor, param_dtype, args.reps)

    sync_times = repeat(lambda: ro.sync_weights(llm, iter_full_params(actor, dtype=param_dtype)), args.reps)
    # Peaks in syncs of their own: resetting the peak trims the heap first (see bc.PeakMemory), and a
    # sync timed right after would pay page faults that a training step's sync does not.
    mem = bc.PeakMemory()
    extra_peaks = []
    for _ in range(args.reps):
        dist.barrier()
        mem.reset()
        before = mem.current_gb()
        ro.sync_weights(llm, iter_full_params(actor, dtype=param_dtype))
        extra_peaks.append(mem.peak_gb() - before)

    bf16 = torch.bfloat16
    gather_bf16_after = bc.median(repeat(lambda: sum(1 for _ in iter_full_params_gather_first(actor, bf16)),
                                         args.reps))
    gather_bf16_first = bc.median(repeat(lambda: sum(1 for _ in iter_full_params(actor, dtype=bf16)), args.reps))

    lora_cases = [lora_sync(path, meshes, llm, targets, args.lora_rank, device, args.reps)
                  for targets in (LORA_TARGETS if args.lora_rank > 0 else ())]

    world = dist.get_world_size()
    result = {
        "model": label, "params_m": sum(p.numel() for p in actor.parameters()) / 1e6,
        "world": world, "tp": args.tp, "fsdp": world, "dtype": str(param_dtype).removeprefix("torch."),
        "bytes_gb": nbytes / 1e9,
        "copy_floor_s": copy_s, "copy_gbps": nbytes / copy_s / 1e9, "per_tensor_copy_s": per_tensor_copy_s,
        "gather_floor_s": gather_floor_s, "gather_s": gather_s,
        # each rank receives (world - 1) / world of every parameter
        "gather_recv_gbps": nbytes * (world - 1) / world / gather_s / 1e9 if world > 1 else None,
        "engine_load_s": engine_s,
        "sync_s": bc.median(sync_times), "sync_s_reps": sync_times,
        "extra_peak_gb": max(extra_peaks),
        "bf16_gather_then_cast_s": gather_bf16_after, "bf16_cast_then_gather_s": gather_bf16_first,
        "lora": lora_cases,
    }
    result["sync_vs_floor"] = result["sync_s"] / copy_s
    result["sync_vs_transport_floor"] = result["sync_s"] / (copy_s + gather_floor_s)
    result["extra_peak_vs_bytes"] = result["extra_peak_gb"] / result["bytes_gb"]
    return result, llm


def worker(args: argparse.Namespace) -> None:
    bc.run_worker(bench_model, args, tp=args.tp)


# ---------------------------------------------------------------------------------------------
# Launcher


COLUMNS = [("layout", "WxTP", ""), ("model", "model", ""), ("bytes_gb", "GB moved", ".3f"),
           ("copy_floor_s", "copy floor s", ".4f"), ("gather_floor_s", "gather floor s", ".3f"),
           ("gather_s", "gather s", ".3f"), ("engine_load_s", "engine load s", ".3f"), ("sync_s", "sync s", ".3f"),
           ("sync_vs_floor", "sync/copy floor", ".1f"), ("sync_vs_transport_floor", "sync/(copy+gather floor)", ".1f"),
           ("extra_peak_gb", "extra peak GB", ".3f")]
LORA_COLUMNS = [("layout", "WxTP", ""), ("model", "model", ""), ("targets", "LoRA targets", ""), ("rank", "rank", ""),
                ("bytes_gb", "full GB", ".3f"), ("lora_bytes_gb", "LoRA GB", ".3f"), ("sync_s", "full sync s", ".3f"),
                ("lora_sync_s", "LoRA sync s", ".3f"), ("lora_vs_full", "LoRA/full time", ".2f")]

# Over ranks: a sync ends when the slowest rank ends, so times take the max; so do memory peaks.
MAX_KEYS = ("copy_floor_s", "per_tensor_copy_s", "gather_floor_s", "gather_s", "engine_load_s", "sync_s", "extra_peak_gb",
            "bf16_gather_then_cast_s", "bf16_cast_then_gather_s")


def merge_ranks(per_rank: list[dict]) -> dict:
    merged = dict(per_rank[0])
    for key in MAX_KEYS:
        merged[key] = max(r[key] for r in per_rank)
    merged["sync_vs_floor"] = merged["sync_s"] / merged["copy_floor_s"]
    merged["sync_vs_transport_floor"] = merged["sync_s"] / (merged["copy_floor_s"] + merged["gather_floor_s"])
    merged["extra_peak_vs_bytes"] = merged["extra_peak_gb"] / merged["bytes_gb"]
    merged["layout"] = f"{merged['world']}x{merged['tp']}"
    merged["per_rank"] = [{k: r[k] for k in MAX_KEYS} for r in per_rank]
    merged["lora"] = [dict(case, lora_sync_s=max(r["lora"][i]["lora_sync_s"] for r in per_rank))
                      for i, case in enumerate(per_rank[0]["lora"])]
    for case in merged["lora"]:
        case["lora_vs_full"] = case["lora_sync_s"] / merged["sync_s"]
    return merged


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    lora_rows = [{**{k: r[k] for k in ("layout", "model", "bytes_gb", "sync_s")}, **case}
                 for r in report["results"] for case in r.get("lora", [])]
    return [(f"weight sync, FSDP actor -> vLLM (max over ranks; {report['wall_s']:.0f}s)", report["results"], COLUMNS),
            ("LoRA weight sync after the first: merged target modules only, against the full sync", lora_rows,
             LORA_COLUMNS)]


def run(args: argparse.Namespace) -> dict:
    specs = bc.split_list(args.models)
    paths = [str(bc.resolve_model(s, args.assets)) for s in specs]
    results, machine, skipped, wall = [], None, [], 0.0
    layouts = bc.split_list(args.layouts)
    if not any(bc.cuda_world_fits(int(x.split("x")[0])) for x in layouts):
        layouts.append("1x1")  # a single-GPU machine: at least the engine-side numbers
    for layout in layouts:
        world, tp = (int(x) for x in layout.split("x"))
        if not bc.cuda_world_fits(world):
            skipped.append(f"{layout}: needs {world} GPUs")
            continue
        seconds, ranks = bc.launch_workers(Path(__file__), world, specs, paths, [
            "--tp", tp, "--reps", args.reps, "--gpu-memory-utilization", args.gpu_memory_utilization,
            "--lora-rank", args.lora_rank],
            args.out.parent / "logs" / f"sync_{layout}.log")
        wall += seconds
        machine = ranks[0]["machine"]
        for i in range(len(specs)):
            results.append(merge_ranks([r["results"][i] for r in ranks]))
    report = {"benchmark": "sync", "machine": machine, "wall_s": wall, "settings": {"reps": args.reps},
              "skipped": skipped, "results": results}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    for s in skipped:
        print(f"skipped {s}")
    print(f"-> {args.out}")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
