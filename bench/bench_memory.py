"""Peak memory per rank per phase of a PPO step (sync, gen, old_log_prob, ref, update), with and
without parameter / optimizer offload of the actor around the rollout.

    python bench/bench_memory.py                      # 30m model, 2 ranks, vLLM TP=1; outputs/bench/memory.json
    python bench/bench_memory.py --models 100m --layout 2x2

Every rank holds what train_ppo.py holds for GRPO with a KL loss: an FSDP2 actor with AdamW state,
an FSDP2 reference model and a vLLM engine. Each variant runs `--steps` steps of the loop's phases
in train_ppo.py's order and reports the last step (the first one allocates AdamW's state):
  sync          wake the engine's weights, sync_weights(iter_full_params(actor)), wake its KV cache
  gen           [offload: actor parameters and optimizer state to host first] rollout.generate
  old_log_prob  [engine asleep; offload: parameters back first] actor forward, no grad
  ref           reference forward, no grad
  update        [offload: optimizer state back first] forward + backward + AdamW step
                [offload: optimizer state to host after]
Peaks are per phase: on CUDA torch's peak allocation (reset per phase) and the device memory in use
at the phase's end; on the CPU the process's peak resident set (reset per phase through
/proc/self/clear_refs). On the CPU, offloading is a documented no-op (models.py warns: parameters
and optimizer state already live in host memory) and so is vLLM's sleep mode, so both variants
measure the same thing there; on CUDA the script moves the real tensors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import bench_common as bc  # first: it puts the repo root on sys.path
import torch

import models
import rollout as ro
from mesh_utils import DistEnv, Meshes

if TYPE_CHECKING:
    from vllm import LLM

T = TypeVar("T")

PHASES = ("sync", "gen", "old_log_prob", "ref", "update")
PROMPT_LEN = (8, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="30m", help=f"comma list: sizes {list(bc.SIZES)}, tiny, or paths")
    ap.add_argument("--layout", default="2x1", help="WORLDxTP: torchrun ranks x vLLM tensor-parallel size")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per rollout dp group")
    ap.add_argument("--rollout-n", dest="n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8, help="micro batch of the forward/backward passes")
    ap.add_argument("--steps", type=int, default=2, help="steps per variant; the last one is reported")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT / "memory.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-paths", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker (every rank)


def one_step(llm: LLM, actor: torch.nn.Module, ref: torch.nn.Module, optimizer: torch.optim.Optimizer,
             prompts: list[list[int]], offload: bool, tp: tuple[int, int], env: DistEnv,
             args: argparse.Namespace) -> dict:
    """One step's phases; {phase: {peak_gb, end_gb}} for this rank. tp = (infer_tp rank, size)."""
    mem, out = bc.PeakMemory(), {}
    device = env.device
    param_dtype = models.default_dtypes(env.device_type)[0]

    def phase(name: str, fn: Callable[[], T]) -> T:
        mem.reset()
        result = fn()
        out[name] = {"peak_gb": mem.peak_gb(), "end_gb": mem.device_used_gb()}
        return result

    def move(moves: list[tuple[str, str]]) -> None:  # the trainer's mover (offload.plan_moves' items)
        models.apply_moves(moves, {"actor": actor}, {"actor": optimizer}, device)

    def sync() -> None:
        ro.sync_weights(llm, models.iter_full_params(actor, dtype=param_dtype))

    def gen() -> ro.RolloutBatch:
        if offload:
            move([("actor.params", "host"), ("actor.optimizer", "host")])
        return ro.generate(llm, prompts, ro.Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                                                     stop_token_ids=(bc.EOS_TOKEN_ID,), pad_token_id=bc.PAD_TOKEN_ID),
                           step=1)

    def log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return models.compute_log_probs(model, batch, 1.0, args.micro_batch).log_probs

    def update(batch: dict[str, torch.Tensor]) -> None:
        if offload:
            move([("actor.optimizer", "device")])
        for start in range(0, batch["input_ids"].shape[0], args.micro_batch):
            rows = slice(start, start + args.micro_batch)
            micro = {k: v[rows] for k, v in batch.items()}
            lp = models.compute_log_probs(actor, micro, 1.0, args.micro_batch).log_probs  # (b, R)
            mask = batch["response_mask"][rows].float()
            ratio = torch.exp(lp - batch["old_log_probs"][rows])
            kl = lp - batch["ref_log_probs"][rows]
            loss = ((-ratio + 0.001 * kl) * mask).sum() / mask.sum().clamp(min=1)  # a PPO-shaped loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if offload:
            move([("actor.optimizer", "host")])

    phase("sync", sync)
    group = phase("gen", gen)
    ro.sleep(llm)
    if offload:
        models.load_fsdp_model_to_device(actor, device)
    share = ro.split_for_training(group, *tp)  # TP rank r trains on slice r of its group's samples
    batch = {k: v.to(device) for k, v in vars(share).items()}
    batch["old_log_probs"] = phase("old_log_prob", lambda: log_probs(actor, batch))
    batch["ref_log_probs"] = phase("ref", lambda: log_probs(ref, batch))
    phase("update", lambda: update(batch))
    return out


def bench_model(label: str, path: Path, meshes: Meshes, env: DistEnv,
                args: argparse.Namespace) -> tuple[dict, LLM]:
    device_type, engine_dtype = bc.device_and_dtype()
    param_dtype, reduce_dtype = models.default_dtypes(device_type)
    mem = bc.PeakMemory()
    mem.reset()
    kwargs = dict(device=env.device, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    actor = models.load_causal_lm(str(path), meshes.fsdp, **kwargs)
    ref = models.load_causal_lm(str(path), meshes.fsdp, **kwargs).eval()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    llm = ro.build_rollout_engine(str(path), meshes.rollout, max_model_len=PROMPT_LEN[1] + args.max_tokens,
                                  gpu_memory_utilization=args.gpu_memory_utilization, dtype=engine_dtype,
                                  enforce_eager=device_type == "cpu", max_num_seqs=256)
    loaded = {"peak_gb": mem.peak_gb(), "end_gb": mem.device_used_gb()}
    dp_rank, dp = meshes.rollout.get_local_rank("dp"), meshes.rollout.size(0)
    everyone = bc.random_prompts(args.prompts * dp, 128, PROMPT_LEN, seed=0)
    prompts = everyone[dp_rank * args.prompts:(dp_rank + 1) * args.prompts]
    tp = (meshes.rollout.get_local_rank("infer_tp"), meshes.rollout.size(1))
    variants = {}
    for offload in (False, True):
        for _ in range(args.steps):
            phases = one_step(llm, actor, ref, optimizer, prompts, offload, tp, env, args)
        variants["param_and_optimizer_offload" if offload else "no_offload"] = phases
    numel = sum(p.numel() for p in actor.parameters())
    return {"model": label, "params_m": numel / 1e6, "load": loaded, "variants": variants,
            "offload_is_noop": device_type == "cpu"}, llm


def worker(args: argparse.Namespace) -> None:
    bc.run_worker(bench_model, args, tp=int(args.layout.split("x")[1]))


# ---------------------------------------------------------------------------------------------
# Launcher


def table_rows(results: list[dict]) -> list[dict]:
    """One row per (model, variant, phase): every rank's peak side by side."""
    rows = []
    for r in results:
        ranks = r["per_rank"]
        rows.append({"model": r["model"], "variant": "-", "phase": "after load",
                     **{f"rank{i}": rank["load"]["peak_gb"] for i, rank in enumerate(ranks)}})
        for variant in ranks[0]["variants"]:
            for phase in PHASES:
                peaks = {f"rank{i}": rank["variants"][variant][phase]["peak_gb"] for i, rank in enumerate(ranks)}
                rows.append({"model": r["model"], "variant": variant, "phase": phase, **peaks})
    return rows


def tables(report: dict) -> list[tuple[str, list[dict], list]]:
    """(title, rows, columns) of what this benchmark shows, for the console and results.md."""
    machine, layout = report["machine"], report["settings"]["layout"]
    unit = "peak GB (CUDA: torch peak allocation)" if machine and machine["device"] != "cpu" else "peak RSS GB"
    world = max((len(r["per_rank"]) for r in report["results"]), default=0)
    columns = [("model", "model", ""), ("variant", "variant", ""), ("phase", "phase", "")]
    columns += [(f"rank{i}", f"rank {i}", ".2f") for i in range(world)]
    title = f"memory per rank per phase, layout {layout}, {unit} ({report['wall_s']:.0f}s)"
    return [(title, table_rows(report["results"]), columns)]


def run(args: argparse.Namespace) -> dict:
    specs = bc.split_list(args.models)
    paths = [str(bc.resolve_model(s, args.assets)) for s in specs]
    world, tp = (int(x) for x in args.layout.split("x"))
    if not bc.cuda_world_fits(world):  # fewer GPUs than ranks: as many ranks as GPUs, one engine each
        world = bc.fit_world(world)
        args.layout = f"{world}x1"
        print(f"only {world} GPU(s): layout {args.layout}")
    results, machine, wall, skipped = [], None, 0.0, None
    if world >= tp:
        wall, ranks = bc.launch_workers(Path(__file__), world, specs, paths, [
            "--layout", args.layout, "--prompts", args.prompts, "--rollout-n", args.n, "--max-tokens",
            args.max_tokens, "--micro-batch", args.micro_batch, "--steps", args.steps,
            "--gpu-memory-utilization", args.gpu_memory_utilization], args.out.parent / "logs" / "memory.log")
        machine = ranks[0]["machine"]
        for i in range(len(specs)):
            per_rank = [r["results"][i] for r in ranks]
            results.append({k: per_rank[0][k] for k in ("model", "params_m", "offload_is_noop")}
                           | {"layout": args.layout, "per_rank": per_rank})
    else:
        skipped = f"layout {args.layout}: TP larger than the world"
    report = {"benchmark": "memory", "machine": machine, "wall_s": wall, "skipped": skipped,
              "settings": {"layout": args.layout, "prompts_per_dp_group": args.prompts, "n": args.n,
                           "max_tokens": args.max_tokens, "micro_batch": args.micro_batch, "steps": args.steps},
              "results": results}
    bc.write_json(args.out, report)
    bc.print_tables(tables(report))
    if any(r["offload_is_noop"] for r in results):
        print("CPU run: offload moves nothing (parameters and optimizer state already live in host memory), "
              "so both variants measure the same; on CUDA the offload variant moves the real tensors.")
    if skipped:
        print(f"skipped: {skipped}")
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
