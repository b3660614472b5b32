"""A memory rehearsal: the trainer's own phases at a real model's width and vocabulary, one process
acting as rank 0 of a larger world, measured against memory_plan.py's plan at the same shape. It needs
no GPU and no vLLM, and on a GPU it measures with the allocator's statistics.

    python bench/memory_rehearsal.py                             # Qwen2.5-0.5B on 6 ranks, 7B on 8 (~2 min)
    python bench/memory_rehearsal.py --case 0.5b:6 --layers 1 --json

How. torch's fake process group (backend "fake", torch.testing._internal.distributed.fake_pg) gives one
process rank 0 of a world of W: FSDP2 allocates exactly what rank 0 of W ranks allocates (its 1/W shards,
the all-gather outputs, the reduce-scatter inputs) and the collectives move nothing, so the numbers are
garbage and the memory is real. Each case builds a Qwen2 config from the real model's dimensions
(hidden size, heads, intermediate size, vocabulary, tied or not; no download) with --layers decoder
blocks, writes it to a temporary model directory (config.json only), and loads the flagship config
(configs/gsm8k_grpo_1node_6gpu.yaml: GRPO, KL loss, gradient checkpointing, packed rows) at that model,
world and a small batch. The planner's own functions give the plan (mesh_utils.validate ->
memory_plan.memory_inputs -> memory_plan.phase_bytes, FSDP rank 0); the trainer's own functions run the
phases in its order, on an actor and a reference model built as load_causal_lm builds them
(models.build_sharded, the shards filled at random), with AdamW's state present as from step 2:
  sync      models.iter_full_params(actor, bf16), consumed as the engine consumes it (one tensor at a time)
  log_prob  train_ppo.old_policy_forward when the trainer runs one (train_ppo.old_log_prob_source), then
            the reference model's no-grad forward (train_step's step 4)
  update    train_ppo.update_actor over one mini batch of several micro batches (gradient accumulation,
            the loss, the clip and AdamW step of models.optimizer_step)
Every sample is full length (P prompt + R response tokens): the plan's worst case. Compute is bf16 with
fp32 master weights and reductions on every device, as on CUDA, so the plan's "assumes" holds here too.

What is measured, per phase: the bytes live at its start and the most live at once during it.
  CUDA  torch.cuda.max_memory_allocated after reset_peak_memory_stats (every tensor of the process).
  CPU   live-storage accounting (LiveBytes below): a TorchDispatchMode sees every tensor an operator
        returns, counts its untyped storage once (views share it) until the storage is freed (a weakref
        callback), and follows UntypedStorage.resize_, by which FSDP2 allocates and frees its unsharded
        parameters outside the dispatcher. That is the set of tensors the CUDA allocator would hold,
        at the same moments (autograd's saved tensors, gradients, FSDP's buffers and optimizer state
        included), without the allocator's rounding and cache. It is defensible as "what a GPU would
        hold" because it counts storages, not RSS: the host's own allocator, Python and the libraries
        do not enter it. Blind spot: scratch memory that one kernel allocates and frees inside a
        single operator call (never live between two operators), which the CUDA statistic includes.
Saved-tensor hooks alone would miss what is not saved for backward (the all-gather outputs, the
gradients, the reduce-scatter buffers, the sync's buckets); the storage account sees all of it.

`--json` prints, per case and phase, the planned and measured bytes and their ratio; the table shows
GiB. --max-ratio-error (default off) makes the exit status 1 when any phase's planned / measured is off
by more than that fraction. Used by `make bench` (bench/run_all.py) and by bench/device_check.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bench_common as bc  # first: it puts the repo root on sys.path
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memory_plan as mp
import models
import train_ppo
from config import load_config
from mesh_utils import build_meshes, validate

FLAGSHIP = bc.ROOT / "configs" / "gsm8k_grpo_1node_6gpu.yaml"
# The models' real dimensions (their config.json on the hub), all but the number of layers.
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
                 rms_norm_eps=1e-6),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=32768,
               rms_norm_eps=1e-6),
}
DEFAULT_CASES = ("0.5b:6", "7b:8")
PHASES = ("sync", "log_prob", "update")
PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32  # CUDA's (models.default_dtypes("cuda"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help=f"SHAPE:WORLD, SHAPE in {list(SHAPES)} (repeatable; default "
                    f"{' '.join(DEFAULT_CASES)})")
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks (the real models have 24 and 28)")
    ap.add_argument("--prompt-len", type=int, default=64, help="data.max_prompt_length")
    ap.add_argument("--response-len", type=int, default=128, help="data.max_response_length")
    ap.add_argument("--samples", type=int, default=6, help="samples per rank: one mini batch")
    ap.add_argument("--micro-batch", type=int, default=2, help="ppo / log-prob micro batch per rank")
    ap.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (quick dry runs only)")
    ap.add_argument("--overrides", nargs="*", default=[], help="more key=value config overrides")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="the plan's device memory (its verdict)")
    ap.add_argument("--max-ratio-error", type=float, default=None,
                    help="exit 1 when a phase's planned / measured is outside 1 +- this (e.g. 0.15)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    return ap.parse_args(argv)


# -----------------------------------------------------------------------------
# Measuring


class LiveBytes(TorchDispatchMode):
    """The bytes of the untyped storages alive on `device_type` that operators returned while the mode
    was on (see the module docstring), and their peak since reset()."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.current = self.peak = 0
        self._sizes: dict[int, int] = {}  # storage (its C++ address) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._resize = torch.UntypedStorage.resize_

    def reset(self) -> None:
        self.peak = self.current

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key not in self._refs:
            self._sizes[key] = 0
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self.current += size - self._sizes[key]
        self._sizes[key] = size
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self.current -= self._sizes.pop(key)
        del self._refs[key]

    def track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if tensor.device.type == self.device_type:
            self._count(tensor.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    def __enter__(self) -> LiveBytes:
        mode = self
        original = self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:  # FSDP2's alloc/free_storage
            result = original(storage, size)
            if storage.device.type == mode.device_type:
                mode._count(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)


class AllocatorBytes:
    """CUDA: the caching allocator's allocated bytes and their peak since reset()."""

    def __init__(self) -> None:
        self.device_type = "cuda"

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated()

    @property
    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def reset(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def __enter__(self) -> AllocatorBytes:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


# -----------------------------------------------------------------------------
# One case


def parse_case(text: str) -> tuple[str, int]:
    shape, _, world = text.partition(":")
    if shape not in SHAPES or not world.isdigit() or int(world) < 1:
        raise SystemExit(f"--case {text!r}: expected SHAPE:WORLD with SHAPE in {list(SHAPES)}, e.g. 7b:8")
    return shape, int(world)


def write_model_dir(out: Path, shape: str, layers: int, vocab_size: int | None = None) -> Path:
    """config.json of the model's real dimensions with `layers` blocks (no weights: nothing reads them)."""
    from transformers import Qwen2Config

    dims = {**SHAPES[shape], **({"vocab_size": vocab_size} if vocab_size else {})}
    Qwen2Config(num_hidden_layers=layers, **dims).save_pretrained(out)
    return out


def rehearsal_overrides(model_dir: Path, world: int, args: argparse.Namespace) -> list[str]:
    """The flagship config at this model, world and batch: one mini batch of --samples per rank."""
    n = args.samples  # one prompt per rank, `samples` responses each
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.n_gpus_per_node={world}", "trainer.nnodes=1",
            f"data.train_batch_size={world}", f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={world}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
            f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *args.overrides]


def fill_at_random(model: torch.nn.Module, seed: int) -> None:
    """Small random values in this rank's shards (what they are does not matter, only that they are finite)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.normal_(0.0, 0.02, generator=generator)


def full_length_batch(samples: int, prompt_len: int, response_len: int, vocab: int,
                      device: torch.device, low: int = 4) -> dict[str, torch.Tensor]:
    """`samples` rollouts of P + R real tokens each (no padding: the plan's worst case), with what the
    trainer's update reads: advantages, the response mask (the loss's), and ref log-probs to come."""
    generator = torch.Generator().manual_seed(0)
    length = prompt_len + response_len
    input_ids = torch.randint(low, vocab, (samples, length), generator=generator)  # (B, P+R)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "position_ids": torch.arange(length).expand(samples, -1).contiguous(),
             "responses": input_ids[:, prompt_len:].contiguous(),  # (B, R)
             "response_mask": torch.ones(samples, response_len),
             "advantages": torch.randn(samples, response_len, generator=generator)}
    return {k: v.to(device) for k, v in batch.items()}


def plan_totals(per_phase: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per phase: the plan's items without the engine's (vLLM is not part of this rehearsal), their total,
    and its two parts: resident (shards, gradients, optimizer state) and transient (the rest)."""
    out = {}
    for phase in PHASES:
        items = {k: v for k, v in per_phase[phase].items() if not k.startswith("engine.")}
        resident = sum(v for k, v in items.items() if k.endswith((".params", ".grads", ".optimizer")))
        out[phase] = {"items": items, "total": sum(items.values()), "resident": resident,
                      "transient": sum(items.values()) - resident}
    return out


def rehearse(shape: str, world: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Plan and measure one case; the fake process group lives only inside this call."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / f"qwen2.5-{shape}-{args.layers}l", shape, args.layers, args.vocab_size)
        cfg = load_config(FLAGSHIP, rehearsal_overrides(model_dir, world, args))
        case = rehearse_config(cfg, world, device, args.gpu_memory_gb)
    return {"case": f"{shape}:{world}", "shape": shape, "layers": args.layers, **case}


def rehearse_config(cfg: Any, world: int, device: torch.device, gpu_memory_gb: float = 80.0) -> dict[str, Any]:
    """Plan and measure the config's actor (actor_rollout_ref.model.path: a causal LM, or a vision-language
    model whose every sample holds the largest prompt's images, memory_plan.image_load) as rank 0 of `world`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims, plan = validate(cfg, world)
    inputs = mp.memory_inputs(cfg, dims, plan, gpu_memory_gb)
    planned = plan_totals(mp.phase_bytes(inputs, 0))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    meter = LiveBytes(device.type) if device.type != "cuda" else AllocatorBytes()
    try:
        with meter:
            measured, info = _run_phases(cfg, dims, plan, Path(cfg.actor_rollout_ref.model.path), device, meter,
                                         inputs.images)
    finally:
        dist.destroy_process_group()
    phases = {}
    for phase in PHASES:
        p, m = planned[phase], measured[phase]
        phases[phase] = {"planned": p["total"], "measured": m["peak"], "ratio": p["total"] / m["peak"],
                         "planned_resident": p["resident"], "measured_resident": m["start"],
                         "planned_transient": p["transient"], "measured_transient": m["peak"] - m["start"],
                         "planned_items": p["items"], "seconds": m["seconds"]}
    return {"world": world, "device": device.type, "measure": "allocator" if device.type == "cuda" else "live storages",
            "batch": {"samples_per_rank": plan.samples_per_rank, "micro_batch": plan.actor_update.micro_batch_size,
                      "prompt_len": cfg.data.max_prompt_length, "response_len": cfg.data.max_response_length},
            **info, "phases": phases}


def image_columns(model: torch.nn.Module, batch: dict[str, torch.Tensor], images: mp.ImageLoad,
                  image_token_id: int) -> dict[str, torch.Tensor]:
    """A VLM batch's columns for full-length samples that each hold the largest prompt's images (their grids):
    each image's pads after the first prompt token, one token apart, random pixels, and 4-row positions."""
    import vision

    samples, device = batch["input_ids"].shape[0], batch["input_ids"].device
    grid = torch.tensor(images.grids, dtype=torch.long)  # (images, 3)
    patch_dim = model.config.vision_config.in_channels * model.config.vision_config.temporal_patch_size \
        * model.config.vision_config.patch_size ** 2
    per_sample = {"pixel_values": torch.randn(images.patches, patch_dim, generator=torch.Generator().manual_seed(1)),
                  "image_grid_thw": grid}
    input_ids = batch["input_ids"].cpu().clone()
    start, merge = 1, model.config.vision_config.spatial_merge_size
    for g in images.grids:  # each image's run of pads, one text token apart (the chat template's markers)
        tokens = math.prod(g) // merge ** 2
        input_ids[:, start:start + tokens] = image_token_id
        start += tokens + 1
    rows = vision.pixel_rows([per_sample] * samples, patch_dim)
    positions = vision.sample_positions(model, input_ids, batch["attention_mask"].cpu(), rows["image_grid_thw"],
                                        image_token_id)
    return {k: v.to(device) for k, v in {"input_ids": input_ids, "position_ids": positions, **rows}.items()}


def _run_phases(cfg: Any, dims: Any, plan: Any, model_dir: Path, device: torch.device,
                meter: LiveBytes | AllocatorBytes,
                images: mp.ImageLoad | None = None) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    roles = cfg.actor_rollout_ref
    meshes = build_meshes(dims, device.type)
    hf_config = AutoConfig.from_pretrained(model_dir)
    auto_cls = AutoModelForImageTextToText if images is not None else AutoModelForCausalLM
    options = dict(device=device, param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    actor = models.build_sharded(auto_cls, hf_config, meshes.fsdp,
                                 reshard_after_forward=roles.actor.fsdp_config.reshard_after_forward,
                                 activation_checkpointing=roles.model.enable_gradient_checkpointing, **options)
    if images is not None and roles.actor.freeze_vision_tower:
        models.freeze_vision_tower(actor)
    ref = models.build_sharded(auto_cls, hf_config, meshes.fsdp, **options).requires_grad_(False).eval()
    fill_at_random(actor, 0)
    fill_at_random(ref, 0)
    optimizer, _ = models.make_optimizer(actor, roles.actor.optim, 1)
    for param in actor.parameters():  # AdamW's state as from step 2 on (the first step creates it)
        if param.requires_grad:  # a frozen vision tower has none
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = train_ppo.ActorLoss.from_config(cfg)
    spec = plan.actor_update
    source, _ = train_ppo.old_log_prob_source(actor, cfg.algorithm, spec, plan.samples_per_rank)
    batch: dict[str, torch.Tensor] = {}
    measured: dict[str, dict[str, float]] = {}

    def phase(name: str, fn: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = meter.current
        meter.reset()
        t = time.perf_counter()
        result = fn()
        measured[name] = {"start": start, "peak": meter.peak, "seconds": time.perf_counter() - t}
        return result

    def sync() -> int:
        count = 0
        for _name, _tensor in models.iter_full_params(actor, dtype=PARAM_DTYPE):  # the engine holds one at a time
            count += 1
        return count

    def log_prob() -> None:
        if source == "forward":
            old = train_ppo.old_policy_forward(SimpleNamespace(plan=plan, actor_loss=loss, actor=actor, sp_group=None),
                                               batch)
            batch["old_log_probs"] = old.old_log_probs
        ref_spec = plan.ref_log_prob
        with torch.no_grad():  # train_step's step 4: the reference forward
            batch["ref_log_probs"] = models.compute_log_probs(
                ref, batch, loss.temperature, ref_spec.micro_batch_size, max_token_len=ref_spec.max_token_len,
                use_remove_padding=ref_spec.use_remove_padding).log_probs

    def update() -> dict[str, float]:
        metrics, _ = train_ppo.update_actor(actor, optimizer, batch, loss, spec, torch.Generator().manual_seed(0),
                                            own_old_log_probs=source == "update")
        return metrics

    phase("sync", sync)
    # the batch after the sync, as in a step (a VLM's pixels are the plan's from the log-prob forwards on)
    vocab = hf_config.get_text_config().vocab_size
    batch |= full_length_batch(plan.samples_per_rank, cfg.data.max_prompt_length, cfg.data.max_response_length,
                               vocab, device, low=7 if images is not None else 4)  # no image/video pad ids at random
    if images is not None:
        batch |= image_columns(actor, batch, images, hf_config.image_token_id)
    phase("log_prob", log_prob)
    metrics = phase("update", update)
    info = {"old_log_probs_from": source, "params_m": sum(p.numel() for p in actor.parameters()) / 1e6,
            "optimizer_step_skipped": bool(metrics.get("actor/skipped_steps", 0))}
    return measured, info


# -----------------------------------------------------------------------------
# The report


def within(report: dict[str, Any], max_error: float) -> list[str]:
    """The phases whose planned / measured is outside 1 +- max_error, as 'case phase ratio' lines."""
    return [f"{case['case']} {phase}: planned / measured {row['ratio']:.2f}"
            for case in report["cases"] for phase, row in case["phases"].items()
            if abs(row["ratio"] - 1) > max_error]


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    gib = mp.GIB
    return [{"case": c["case"], "phase": phase, "planned": r["planned"] / gib, "measured": r["measured"] / gib,
             "ratio": r["ratio"], "resident_p": r["planned_resident"] / gib, "resident_m": r["measured_resident"] / gib,
             "transient_p": r["planned_transient"] / gib, "transient_m": r["measured_transient"] / gib,
             "seconds": r["seconds"]}
            for c in report["cases"] for phase, r in c["phases"].items()]


COLUMNS = [("case", "case", ""), ("phase", "phase", ""), ("planned", "plan GiB", ".3f"),
           ("measured", "measured GiB", ".3f"), ("ratio", "plan/meas", ".2f"), ("resident_p", "resident plan", ".3f"),
           ("resident_m", "meas", ".3f"), ("transient_p", "transient plan", ".3f"), ("transient_m", "meas", ".3f"),
           ("seconds", "s", ".1f")]


def tables(report: dict[str, Any]) -> list[tuple[str, list[dict], list[tuple[str, str, str]]]]:
    """(title, rows, columns) for run_all's Markdown."""
    return [("memory rehearsal: plan vs measured per phase (rank 0 of the world, fake process group)",
             table_rows(report), COLUMNS)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]
    report = {"benchmark": "memory_rehearsal", "machine": bc.machine_info(),
              "cases": [rehearse(shape, world, args, device) for shape, world in cases]}
    if args.out is not None:
        bc.write_json(args.out, report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for title, rows, columns in tables(report):
            print(title)
            print(bc.table(rows, columns))
    if args.max_ratio_error is not None:
        off = within(report, args.max_ratio_error)
        for line in off:
            print(f"off by more than {args.max_ratio_error:.0%}: {line}", file=sys.stderr)
        return 1 if off else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
