"""The training side of a PPO step on whatever device there is, without vLLM: the first thing to run
on a GPU machine (its image may not have vLLM), and a smoke test on the CPU.

    torchrun --standalone --nproc_per_node=1 bench/device_check.py --model 700m     # one GPU
    torchrun --standalone --nproc_per_node=2 bench/device_check.py --model tiny     # CPU, gloo

Every rank: the process group (NCCL + gloo on CUDA, gloo on a CPU), an FSDP2 actor over all ranks
with float32 master weights (bf16 compute on CUDA, as train_ppo.py), then each phase timed, with
its peak memory (CUDA: torch's peak allocation; CPU: peak resident set):
  load      models.load_causal_lm: meta init, rank 0 reads the checkpoint and broadcasts it
  log_prob  a no-grad forward over --batch random sequences (old log-probs)
  update    forward + backward + clip + AdamW step of a PPO-shaped loss, --steps times (the last
            one is reported: the first allocates AdamW's state)
  gather    models.iter_full_params(actor, dtype=param_dtype): what every weight sync sends
  offload   parameters and optimizer state to host and back (param_offload / optimizer_offload)
Checks, each failing the run (exit 1) with what differed: the loss is finite and the update changed
the weights; every gathered tensor equals DTensor.full_tensor() cast to the sync dtype; the offload
round trip is bit-exact; on CUDA the offload freed >= 90% of the parameter + optimizer bytes.

Then the offload plan (`make gpu-check`): for each offload combination (memory_plan.flag_combinations)
on FSDP and, with 2+ ranks, HSDP, a fresh actor (+ a reference model with its own flag) walks a step
in the trainer's order with the trainer's functions (memory_plan.plan_moves -> models.apply_moves,
compute_log_probs, an update, models.optimizer_step), and checks: the loss is finite and the
weights move; on CUDA, that every item is on the device or host the table says in every phase,
that entering `generate` frees the actor's shard bytes the plan says (within 10%), and that the
update's measured peak is within 30% of the memory plan's estimate. On the CPU the device checks are
skipped (everything is host memory) and the report says so; the engine (vLLM) is not part of this
check: its rows of the table are checked by the trainer's runs.
Rank 0 prints a table and writes <out>/device_check.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import memory_plan as mp
import models
from mesh_utils import ParallelDims, build_meshes, init_distributed

T = TypeVar("T")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m", help=f"a size {list(bc.SIZES)}, tiny, or a model directory")
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (the first allocates AdamW's state)")
    ap.add_argument("--assets", type=Path, default=bc.DEFAULT_ASSETS)
    ap.add_argument("--out", type=Path, default=bc.DEFAULT_OUT)
    ap.add_argument("--skip-plan", action="store_true", help="skip the offload-plan walk (the second part)")
    return ap.parse_args(argv)


def local_tensors(actor: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Host copies of this rank's parameter shards and optimizer state (local shards, not DTensors:
    their sizes are what this rank holds, and comparing them runs no collective)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()

    shards = [local(p) for p in actor.parameters()]
    state = [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return shards + state


def actual_placement(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Where the actor's parameters and optimizer state are now: 'device' (an accelerator) or 'host'."""
    def where(tensors: list[torch.Tensor]) -> str:
        kinds = {"host" if t.device.type == "cpu" else "device" for t in tensors}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    return {"actor.params": where(list(model.parameters())), "actor.optimizer": where(state) if state else "-"}


def plan_walk(path: str, flags: mp.OffloadFlags, fsdp_mesh: object, fsdp: int, fsdp_rank: int,
              batch: dict[str, torch.Tensor], mask: torch.Tensor, micro_batch: int, device: torch.device,
              param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> dict[str, object]:
    """Two steps of the trainer's phase order with `flags`: the moves, a log-prob forward (actor and
    reference), an update, and the checks of the docstring. Returns one row of the table."""
    cuda = device.type == "cuda"
    kwargs = dict(device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    actor = models.load_causal_lm(path, fsdp_mesh, **kwargs)
    ref = models.load_causal_lm(path, fsdp_mesh, cpu_offload=flags.ref_param, **kwargs).eval()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    shape = mp.model_shape(path)
    rows, length = batch["input_ids"].shape
    response_len = batch["responses"].shape[1]
    estimate = mp.MemoryInputs(
        actor=shape, critic=None, use_ref=True, flags=flags, fsdp=fsdp, infer_tp=1, compute_bytes=param_dtype.itemsize,
        engine_bytes=param_dtype.itemsize, prompt_len=length - response_len, response_len=response_len,
        ppo_micro=micro_batch, log_prob_micro=micro_batch, critic_micro=None, actor_checkpointing=False,
        critic_checkpointing=False, gpu_memory_utilization=0.0, gpu_memory_bytes=1)
    update_estimate = sum(v for k, v in mp.phase_bytes(estimate, fsdp_rank)["update"].items()
                          if not k.startswith("engine."))
    row: dict[str, object] = {"losses": [], **({"placement_ok": True} if cuda else {})}
    before = [p.detach().to_local().cpu().clone() for p in actor.parameters()]
    previous = mp.LOADED
    for _ in range(2):
        for phase in mp.PHASES:
            allocated = torch.cuda.memory_allocated() if cuda else 0
            models.apply_moves(mp.plan_moves(flags, previous, phase), {"actor": actor}, {"actor": optimizer},
                               device)
            previous = phase
            if cuda:
                torch.cuda.synchronize()
                planned = mp.placement(flags, phase)
                actual = actual_placement(actor, optimizer)
                for item, where in actual.items():
                    if where != "-" and where != planned[item]:
                        row["placement_ok"] = False
                        row.setdefault("placement_errors", []).append(f"{phase}: {item} on {where}, "
                                                                       f"plan {planned[item]}")
                if phase == "generate" and flags.actor_param:
                    row["freed_gb"] = (allocated - torch.cuda.memory_allocated()) / 1e9
                    row["freed_plan_gb"] = mp.param_shard_bytes(shape, fsdp, fsdp_rank) / 1e9
                torch.cuda.reset_peak_memory_stats()
            if phase == "log_prob":
                with torch.no_grad():
                    old = models.compute_log_probs(actor, batch, 1.0, micro_batch)[0]  # (B, R)
                    models.compute_log_probs(ref, batch, 1.0, micro_batch)
            if phase == "update":
                actor.train()
                for start in range(0, rows, micro_batch):
                    part = slice(start, start + micro_batch)
                    micro = {k: v[part] for k, v in batch.items()}
                    ratio = torch.exp(models.compute_log_probs(actor, micro, 1.0, micro_batch)[0] - old[part])
                    loss = (-ratio * mask[part]).sum() / mask.sum()
                    loss.backward()
                    row["losses"].append(loss.item())
                metrics: dict[str, float] = {}
                models.optimizer_step(actor, optimizer, 1.0, "actor", metrics)
                if cuda:  # everything on the device at the update's peak, against the plan's sum
                    row["update_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                    row["update_plan_gb"] = update_estimate / 1e9
    after = [p.detach().to_local().cpu() for p in actor.parameters()]
    moved = torch.tensor(float(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))))
    dist.all_reduce(moved)
    row["finite_and_moved"] = all(map(math.isfinite, row["losses"])) and moved.item() > 0
    if cuda and "freed_gb" in row:
        row["freed_ok"] = abs(row["freed_gb"] - row["freed_plan_gb"]) <= 0.1 * row["freed_plan_gb"]
    if cuda:
        row["estimate_ok"] = abs(row["update_plan_gb"] - row["update_peak_gb"]) <= 0.3 * row["update_peak_gb"]
    del actor, ref, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:  # noqa: PLR0915 - one linear script
    args = parse_args(argv)
    env = init_distributed()
    world, device = env.world_size, env.device
    if env.rank == 0:
        bc.resolve_model(args.model, args.assets)  # built once, before the other ranks read it
    dist.barrier()
    path = bc.resolve_model(args.model, args.assets)
    meshes = build_meshes(ParallelDims(world, 1, world, world, 1, 1), env.device_type)
    param_dtype, reduce_dtype = models.default_dtypes(env.device_type)
    mem, phases, checks = bc.PeakMemory(), {}, {}

    def phase(name: str, fn: Callable[[], T]) -> T:
        dist.barrier()
        mem.reset()
        seconds, result = bc.timed(fn)
        phases[name] = {"seconds": seconds, "peak_gb": mem.peak_gb(), "end_gb": mem.device_used_gb()}
        return result

    actor = phase("load", lambda: models.load_causal_lm(str(path), meshes.fsdp, device=device,
                                                        param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    vocab = actor.config.vocab_size
    generator = torch.Generator().manual_seed(env.rank)
    length = args.prompt_len + args.response_len
    input_ids = torch.randint(2, vocab, (args.batch, length), generator=generator).to(device)  # (B, P+R)
    attention_mask = torch.ones_like(input_ids)
    position_ids = torch.arange(length, device=device).expand(args.batch, -1)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "responses": input_ids[:, args.prompt_len:]}  # (B, R)
    lengths = torch.randint(1, args.response_len + 1, (args.batch,), generator=generator)
    mask = (torch.arange(args.response_len)[None, :] < lengths[:, None]).float().to(device)  # (B, R)

    def log_probs(rows: slice = slice(None)) -> torch.Tensor:
        micro_batch = {k: v[rows] for k, v in batch.items()}
        return models.compute_log_probs(actor, micro_batch, 1.0, args.micro_batch)[0]  # (b, R)

    with torch.no_grad():
        old = phase("log_prob", log_probs)
    before = local_tensors(actor, optimizer)[:len(list(actor.parameters()))]

    def update() -> float:
        total = 0.0
        for start in range(0, args.batch, args.micro_batch):
            rows = slice(start, start + args.micro_batch)
            ratio = torch.exp(log_probs(rows) - old[rows])
            loss = (-ratio * mask[rows]).sum() / mask.sum()  # token-mean over this rank's batch
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    losses = [phase("update", update) for _ in range(args.steps)]
    changed = torch.tensor(float(any([not torch.equal(b, p.detach().to_local().cpu())
                                      for b, p in zip(before, actor.parameters(), strict=True)])))
    dist.all_reduce(changed)
    checks["update_finite_and_moved"] = all(map(torch.isfinite, map(torch.tensor, losses))) and changed.item() > 0

    phase("gather", lambda: sum(1 for _ in models.iter_full_params(actor, dtype=param_dtype)))
    # lists, not short-circuiting generators: full_tensor() is a collective every rank must reach
    checks["gather_equals_full_tensor"] = all([
        name == ref_name and torch.equal(full, ref.detach().full_tensor().to(param_dtype))
        for (name, full), (ref_name, ref) in zip(models.iter_full_params(actor, dtype=param_dtype),
                                                 actor.named_parameters(remove_duplicate=False), strict=True)])

    snapshot = local_tensors(actor, optimizer)
    moved_gb = sum(t.numel() * t.element_size() for t in snapshot) / 1e9

    def offload_and_back() -> float:
        on_device = torch.cuda.memory_allocated() if env.device_type == "cuda" else 0
        models.offload_fsdp_model_to_cpu(actor)
        models.offload_optimizer(optimizer)
        freed = (on_device - torch.cuda.memory_allocated()) / 1e9 if env.device_type == "cuda" else 0.0
        models.load_fsdp_model_to_device(actor, device)
        models.load_optimizer(optimizer, device)
        return freed

    freed_gb = phase("offload", offload_and_back)
    checks["offload_round_trip_exact"] = all([
        torch.equal(a, b) for a, b in zip(snapshot, local_tensors(actor, optimizer), strict=True)])
    if env.device_type == "cuda":
        checks["offload_freed_device_memory"] = freed_gb >= 0.9 * moved_gb

    plan_rows, skipped = [], []
    if args.skip_plan:
        skipped.append("the offload-plan walk (--skip-plan)")
    else:
        if env.device_type != "cuda":
            skipped.append("device placement, freed bytes and the memory estimate (CPU: everything is host memory)")
        layouts = [("fsdp", ParallelDims(world, 1, world, world, 1, 1))]
        if world >= 2 and world % 2 == 0:
            layouts.append(("hsdp", ParallelDims(world, 1, world, world // 2, 1, 1)))
        else:
            skipped.append(f"HSDP (needs an even number of ranks >= 2; this run has {world})")
        for layout, dims in layouts:
            mesh = build_meshes(dims, env.device_type).fsdp
            for label, flags in mp.flag_combinations():
                row = plan_walk(str(path), flags, mesh, dims.fsdp, env.rank % dims.fsdp, batch, mask,
                                args.micro_batch, device, param_dtype, reduce_dtype)
                plan_rows.append({"layout": layout, "flags": label, **row})
                for check in ("placement_ok", "finite_and_moved", "freed_ok", "estimate_ok"):
                    if check in row:
                        checks[f"plan[{layout}: {label}] {check}"] = bool(row[check])
        skipped.append("the engine's rows of the table (vLLM is not used here)")

    ok = torch.tensor(float(all(checks.values())))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank's checks
    if env.rank == 0:
        report = {"machine": bc.machine_info(), "model": bc.model_label(args.model), "world": world,
                  "params_m": sum(p.numel() for p in actor.parameters()) / 1e6, "param_dtype": str(param_dtype),
                  "settings": {k: v for k, v in vars(args).items() if k not in ("assets", "out")},
                  "phases": phases, "losses": losses, "offload_moved_gb": moved_gb, "offload_freed_gb": freed_gb,
                  "checks_rank0": checks, "all_ranks_ok": bool(ok.item()), "plan": plan_rows, "skipped": skipped}
        bc.write_json(args.out / "device_check.json", report)
        print(f"device check: {report['machine']['device']}, {world} rank(s), {report['model']} "
              f"({report['params_m']:.1f}M params, compute {param_dtype}), batch {args.batch} x {length} tokens")
        print(bc.table([{"phase": k, **v} for k, v in phases.items()],
                       [("phase", "phase", ""), ("seconds", "seconds", ".3f"), ("peak_gb", "peak GB", ".2f"),
                        ("end_gb", "in use GB", ".2f")]))
        if plan_rows:
            print(bc.table(plan_rows, [("layout", "layout", ""), ("flags", "offload flags", ""),
                                       ("placement_ok", "placement", ""), ("finite_and_moved", "finite+moved", ""),
                                       ("freed_gb", "freed GB", ".3f"), ("freed_plan_gb", "plan GB", ".3f"),
                                       ("update_peak_gb", "update peak GB", ".3f"),
                                       ("update_plan_gb", "plan GB", ".3f")]))
        for name, passed in checks.items():
            print(f"  {'ok  ' if passed else 'FAIL'} {name}")
        for part in skipped:
            print(f"  skipped: {part}")
        print(f"-> {args.out / 'device_check.json'}")
    dist.destroy_process_group()
    if not ok.item():
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
