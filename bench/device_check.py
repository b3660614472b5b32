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

A vision-language model (--vl-shape; Qwen2.5-VL-3B's widths and vocabulary with --vl-layers text and tower
blocks, random weights, on the CUDA machine; `tiny` for the CPU smoke test): rows with images of different
sizes (two in one row, a row without one), the trainer's padded and packed log-probs
(models.compute_log_probs with pixels, grids and 4-row positions) against each other and against the HF
model run on each row alone with its own mrope positions (mm_token_type_ids); the control, HF without the
pixels, must be off. `--vl-shape off` skips it.

Then the offload plan (`make gpu-check`): for each offload combination (offload.flag_combinations)
on FSDP and, with 2+ ranks, HSDP, a fresh actor (+ a reference model with its own flag) walks a step
in the trainer's order with the trainer's functions (offload.plan_moves -> models.apply_moves,
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
import copy
import functools
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import bench_common as bc  # first: it puts the repo root on sys.path
import memory_rehearsal as rehearsal
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import memory_plan as mp
import models
import offload
import train_ppo
from config import load_config
from mesh_utils import ParallelDims, UpdateSpec, build_meshes, init_distributed

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
    ap.add_argument("--vocab-shape", default="0.5b", choices=list(rehearsal.SHAPES),
                    help="the real model whose width and vocabulary the packed / padded / accumulation checks use")
    ap.add_argument("--vocab-layers", type=int, default=4, help="its decoder blocks")
    ap.add_argument("--vocab-size", type=int, default=None, help="override its vocabulary (CPU dry runs only)")
    ap.add_argument("--vl-shape", default="3b", choices=[*VL_SHAPES, "tiny", "off"],
                    help="the vision-language model of the VLM parity checks (off: skip them)")
    ap.add_argument("--vl-layers", type=int, default=4, help="its text blocks and vision blocks (not for tiny)")
    ap.add_argument("--rehearsal", default="", help="arguments of bench/memory_rehearsal.py (default: its own "
                    "defaults, Qwen2.5-0.5B on 6 ranks and 7B on 8); 'off' skips it")
    ap.add_argument("--rehearsal-max-error", type=float, default=0.15,
                    help="on CUDA, each rehearsal phase's planned / measured must be within 1 +- this")
    return ap.parse_args(argv)


# The packed and padded forwards compute the same log-probs up to the compute dtype's rounding (the
# kernels sum in different orders): mean |difference| over real response tokens, as the stale-weights
# check tolerates between the engine and the actor (rollout.STALE_TOLERANCE).
LOGPROB_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
# One micro batch against four of the same samples: the same gradient (the same norm) up to rounding.
ACCUMULATION_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def ragged_batch(samples: int, prompt_len: int, response_len: int, vocab: int, seed: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Rollouts as the trainer holds them: prompts left-padded to P, responses right-padded to R, lengths
    at random (the first sample full length), with the response mask and advantages the update reads."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(max(1, prompt_len // 4), prompt_len + 1, (samples,), generator=generator)
    response_lens = torch.randint(1, response_len + 1, (samples,), generator=generator)
    prompt_lens[0], response_lens[0] = prompt_len, response_len
    columns = torch.arange(prompt_len + response_len)
    prompt_valid = columns[None, :prompt_len] >= (prompt_len - prompt_lens)[:, None]  # (B, P)
    response_valid = columns[None, :response_len] < response_lens[:, None]  # (B, R)
    attention_mask = torch.cat([prompt_valid, response_valid], 1).long()  # (B, P+R)
    input_ids = torch.randint(4, vocab, attention_mask.shape, generator=generator) * attention_mask
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
             "responses": input_ids[:, prompt_len:].contiguous(), "response_mask": response_valid.float(),
             "advantages": torch.randn(samples, response_len, generator=generator)}
    return {k: v.to(device) for k, v in batch.items()}


def real_vocabulary_checks(args: argparse.Namespace, fsdp_mesh: object, device: torch.device, rank: int,
                           param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> list[dict[str, object]]:
    """At a real model's width and vocabulary (random weights, built as load_causal_lm builds them, with
    gradient checkpointing): the packed and padded log-probs and entropies agree; on CUDA the packed row
    runs on the flash sdpa kernel; train_ppo.update_actor's gradient over one micro batch equals its
    accumulation over four (the grad norm and the loss), both finite. Rows of the table."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = {**rehearsal.SHAPES[args.vocab_shape], **({"vocab_size": args.vocab_size} if args.vocab_size else {})}
    config = Qwen2Config(num_hidden_layers=args.vocab_layers, **shape)
    label = f"{args.vocab_shape} x{args.vocab_layers} layers, vocab {config.vocab_size}"
    actor = models.build_sharded(AutoModelForCausalLM, config, fsdp_mesh, device=device, param_dtype=param_dtype,
                                 reduce_dtype=reduce_dtype, activation_checkpointing=True)
    rehearsal.fill_at_random(actor, seed=1)
    batch = ragged_batch(args.batch, args.prompt_len, args.response_len, config.vocab_size, rank, device)
    mask = batch["response_mask"].bool()
    rows = []
    actor.eval()
    with torch.no_grad():
        padded = models.compute_log_probs(actor, batch, 1.0, args.micro_batch, True, use_remove_padding=False)
        packed = models.compute_log_probs(actor, batch, 1.0, args.micro_batch, True, use_remove_padding=True)
    tolerance = LOGPROB_TOLERANCE[param_dtype]
    for what, a, b in (("log-probs", padded.log_probs, packed.log_probs), ("entropy", padded.entropy, packed.entropy)):
        diff = (a - b).abs()[mask]
        rows.append(row(f"packed = padded {what} ({label})", bool(torch.isfinite(diff).all()) and
                        diff.mean().item() <= tolerance, f"mean {diff.mean().item():.2e}, max {diff.max().item():.2e}",
                        f"mean <= {tolerance:g}"))
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                models.compute_log_probs(actor, batch, 1.0, args.micro_batch, use_remove_padding=True)
            rows.append(row("packed rows run on the flash sdpa kernel", True))
        except RuntimeError as e:
            rows.append(row("packed rows run on the flash sdpa kernel", False, str(e).splitlines()[0][:80]))
    cfg = load_config(rehearsal.FLAGSHIP)
    loss = train_ppo.ActorLoss.from_config(cfg)
    batch.update(old_log_probs=packed.log_probs, ref_log_probs=padded.log_probs)
    start = [p.detach().to_local().clone() for p in actor.parameters()]
    norms, losses = {}, {}
    for micro in (args.batch, max(1, args.batch // 4)):
        with torch.no_grad():
            for p, s in zip(actor.parameters(), start, strict=True):
                p.to_local().copy_(s)
        optimizer, _ = models.make_optimizer(actor, cfg.actor_rollout_ref.actor.optim, 1)
        spec = UpdateSpec(epochs=1, mini_batch_size=args.batch, micro_batch_size=micro, max_token_len=None,
                          shuffle=False, loss_agg_mode="token-mean", use_remove_padding=True, grad_clip=1.0)
        metrics, _ = train_ppo.update_actor(actor, optimizer, batch, loss, spec, torch.Generator().manual_seed(0))
        norms[micro], losses[micro] = metrics["actor/grad_norm"], metrics["actor/pg_loss"]
    one, four = norms.values()
    error = abs(one - four) / max(abs(one), 1e-12)
    tolerance = ACCUMULATION_TOLERANCE[param_dtype]
    cut = f"1 = {len(range(0, args.batch, micro))} micro batches"
    rows.append(row(f"gradient accumulation: {cut} (grad norm)",
                    math.isfinite(one) and math.isfinite(four) and error <= tolerance,
                    f"{one:.4g} vs {four:.4g} (rel {error:.1e})", f"rel <= {tolerance:g}"))
    one, four = losses.values()
    rows.append(row(f"gradient accumulation: {cut} (pg loss)",
                    math.isfinite(one) and abs(one - four) <= tolerance * max(abs(one), 1e-3),
                    f"{one:.4g} vs {four:.4g}", f"rel <= {tolerance:g}"))
    del actor, optimizer
    return rows


# Qwen2.5-VL-3B's dimensions (its config.json on the hub), all but the number of blocks (--vl-layers)
VL_SHAPES: dict[str, dict[str, Any]] = {
    "3b": dict(text=dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                         vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
               vision=dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, in_channels=3),
               ids=dict(vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655,
                        video_token_id=151656), tie_word_embeddings=True,
               # (t, h, w) patches of each row's images: 448 x 616, 224 x 336 with 392 x 280, none, 896 x 504
               grids=[[(1, 32, 44)], [(1, 16, 24), (1, 28, 20)], [], [(1, 64, 36)]], text_ids=(0, 151000)),
}
# make_assets' tiny Qwen2.5-VL: 56 x 84, 112 x 56 with 84 x 84, none, 56 x 112 pixels; text past its specials (0-6)
TINY = dict(grids=[[(1, 4, 6)], [(1, 8, 4), (1, 6, 6)], [], [(1, 4, 8)]], text_ids=(7, 128))


def vl_config(shape: str, layers: int) -> Any:
    """The VLM config of --vl-shape: the real widths with `layers` text and tower blocks (the last tower block
    attends to the whole image, the others within windows), or make_assets' tiny Qwen2.5-VL."""
    from transformers import Qwen2_5_VLConfig

    if shape == "tiny":
        import make_assets  # the CPU smoke test's only

        return make_assets.vl_config("qwen2_5_vl")
    dims = VL_SHAPES[shape]
    return Qwen2_5_VLConfig(text_config={**dims["text"], "num_hidden_layers": layers},
                            vision_config={**dims["vision"], "depth": layers, "fullatt_block_indexes": [layers - 1]},
                            tie_word_embeddings=dims["tie_word_embeddings"], **dims["ids"])


def vl_batch(config: Any, grids: list[list[tuple[int, int, int]]], text_ids: tuple[int, int], response_len: int, seed: int,
             device: torch.device) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The trainer's batch of a VLM's rows: per row 8 text tokens, then each image's pads between the vision
    markers, left-padded; random responses (lengths R, R/2, R, 3, ...) right-padded; random pixels; 4-row
    positions left to the caller (they need the model). Also each row's pixel inputs, for the reference."""
    import vision

    generator = torch.Generator().manual_seed(seed)
    merge, v = config.vision_config.spatial_merge_size, config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    prompts, pixels = [], []
    for row_grids in grids:
        ids = torch.randint(*text_ids, (8,), generator=generator).tolist()
        for grid in row_grids:
            ids += [config.vision_start_token_id] + [config.image_token_id] * (math.prod(grid) // merge ** 2) \
                + [config.vision_end_token_id]
        prompts.append(ids)
        pixels.append({"pixel_values": torch.randn(sum(math.prod(g) for g in row_grids), patch_dim, generator=generator),
                       "image_grid_thw": torch.tensor(row_grids, dtype=torch.long)} if row_grids else {})
    P, R = max(map(len, prompts)), response_len
    lengths = [R if i % 2 == 0 else max(1, R // 2) for i in range(len(prompts))]
    lengths[-1] = min(3, R)
    input_ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, lengths, strict=True)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + r] = torch.randint(*text_ids, (r,), generator=generator)
        mask[i, P - len(p):P + r] = 1
    batch = {"input_ids": input_ids, "attention_mask": mask, "responses": input_ids[:, P:],
             "response_mask": (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float(),
             **vision.pixel_rows(pixels, patch_dim)}
    return {k: t.to(device) for k, t in batch.items()}, pixels


def hf_per_sample(model: torch.nn.Module, batch: dict[str, torch.Tensor], pixels: list[dict[str, torch.Tensor]],
                  image_token_id: int, with_pixels: bool = True) -> torch.Tensor:
    """(B, R) log-probs of each row alone, unpadded, by the HF model computing its own mrope positions from
    mm_token_type_ids, the image and video pads banned as the trainer bans them."""
    import vision

    out = torch.zeros(batch["responses"].shape, device=batch["responses"].device)
    banned = vision.pad_token_ids(model.config)
    R = batch["responses"].shape[1]
    for i, row_pixels in enumerate(pixels):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        kwargs = {}
        if row_pixels and with_pixels:
            kwargs = {k: t.to(ids.device) for k, t in row_pixels.items()}
            kwargs["pixel_values"] = kwargs["pixel_values"].to(next(model.parameters()).dtype)
        if row_pixels:
            kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
        with torch.no_grad():
            logits = vision.ban_tokens(model(input_ids=ids, **kwargs).logits[0].float(), banned)  # (L, V)
        num = int(keep[-R:].sum())
        out[i, :num] = torch.log_softmax(logits[-num - 1:-1], dim=-1).gather(-1, ids[0, -num:, None])[:, 0]
    return out


def vl_parity_checks(args: argparse.Namespace, fsdp_mesh: object, device: torch.device, rank: int,
                     param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> list[dict[str, object]]:
    """A VLM at --vl-shape (random weights, built as load_causal_lm builds it): the trainer's padded and packed
    log-probs on image rows agree with each other and with HF run per row (the same weights, unsharded, in the
    compute dtype); HF without the pixels must not. Rows of the table."""
    from transformers import AutoModelForImageTextToText

    import vision

    config = vl_config(args.vl_shape, args.vl_layers)
    text = config.get_text_config()
    label = (f"Qwen2.5-VL {args.vl_shape}" + ("" if args.vl_shape == "tiny" else f" x{args.vl_layers} blocks")
             + f", vocab {text.vocab_size}")
    # HF's own initialisation (norms at 1: the images then move the log-probs well past the tolerance), the
    # same on every rank; the actor's shards cut from it
    torch.manual_seed(0)
    sdpa = {"text_config": "sdpa", "vision_config": "sdpa", "": "sdpa"}
    with torch.device(device):
        # a copy of the config: from_config writes the attention implementation into the one it is given
        hf = AutoModelForImageTextToText.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                     attn_implementation=sdpa).eval()
    actor = models.build_sharded(AutoModelForImageTextToText, config, fsdp_mesh, device=device,
                                 param_dtype=param_dtype, reduce_dtype=reduce_dtype).eval()
    weights = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in actor.named_parameters():
            param.to_local().copy_(distribute_tensor(weights[name], param.device_mesh, param.placements).to_local())
    hf.to(param_dtype)
    rows_of = TINY if args.vl_shape == "tiny" else VL_SHAPES[args.vl_shape]
    grids = rows_of["grids"]
    batch, pixels = vl_batch(config, grids, rows_of["text_ids"], args.response_len, rank, device)
    batch["position_ids"] = vision.sample_positions(actor, batch["input_ids"].cpu(), batch["attention_mask"].cpu(),
                                                    batch["image_grid_thw"].cpu(), config.image_token_id).to(device)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        padded = models.compute_log_probs(actor, batch, 1.0, 2, use_remove_padding=False).log_probs
        packed = models.compute_log_probs(actor, batch, 1.0, len(grids), use_remove_padding=True).log_probs
    reference = hf_per_sample(hf, batch, pixels, config.image_token_id)
    blind = hf_per_sample(hf, batch, pixels, config.image_token_id, with_pixels=False)
    tolerance = LOGPROB_TOLERANCE[param_dtype]
    image_rows = mask & torch.tensor([bool(p) for p in pixels], device=mask.device)[:, None]
    rows = []
    for what, a, b, where in (("packed = padded", packed, padded, mask), ("padded = HF per row", padded, reference, mask),
                              ("packed = HF per row", packed, reference, mask)):
        diff = (a - b).abs()[where]
        rows.append(row(f"VLM {what} log-probs ({label})", bool(torch.isfinite(diff).all())
                        and diff.mean().item() <= tolerance,
                        f"mean {diff.mean().item():.2e}, max {diff.max().item():.2e}", f"mean <= {tolerance:g}"))
    diff = (blind - reference).abs()[image_rows]
    rows.append(row(f"control: HF without the pixels is off ({label})", diff.mean().item() > tolerance,
                    f"mean {diff.mean().item():.2e}", f"mean > {tolerance:g}"))
    del actor, hf
    return rows


def row(check: str, ok: bool | None, value: object = None, limit: object = None) -> dict[str, object]:
    """One row of the table: ok None is a number reported, not checked."""
    return {"check": check, "ok": ok, "value": value, "limit": limit}


def rehearsal_rows(args: argparse.Namespace, device_type: str) -> tuple[list[dict[str, object]], dict | None]:
    """bench/memory_rehearsal.py in its own process (its fake process group cannot share this one's), with
    the allocator's statistics on CUDA: one row per case and phase, planned against measured; gated on
    CUDA (within --rehearsal-max-error), reported on the CPU (its live-storage account is the test's)."""
    cmd = [sys.executable, str(bc.ROOT / "bench" / "memory_rehearsal.py"), *shlex.split(args.rehearsal), "--json"]
    proc = subprocess.run(cmd, cwd=bc.ROOT, capture_output=True, text=True, env=bc.clean_env())
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return [row("memory rehearsal runs", False, f"exit {proc.returncode}: {tail[0][:100]}")], None
    report = json.loads(proc.stdout)
    gate = device_type == "cuda"
    rows = []
    for case in report["cases"]:
        for phase, r in case["phases"].items():
            ok = abs(r["ratio"] - 1) <= args.rehearsal_max_error if gate else None
            rows.append(row(f"rehearsal {case['case']} {phase}: plan / measured ({case['measure']})", ok,
                            f"{r['ratio']:.2f} ({r['planned'] / mp.GIB:.2f} / {r['measured'] / mp.GIB:.2f} GiB)",
                            f"1 +- {args.rehearsal_max_error:g}" if gate else "reported"))
    return rows, report


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


def plan_walk(path: str, flags: offload.OffloadFlags, fsdp_mesh: object, fsdp: int, fsdp_rank: int,
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
    previous = offload.LOADED
    for _ in range(2):
        for phase in offload.PHASES:
            allocated = torch.cuda.memory_allocated() if cuda else 0
            models.apply_moves(offload.plan_moves(flags, previous, phase), {"actor": actor}, {"actor": optimizer},
                               device)
            previous = phase
            if cuda:
                torch.cuda.synchronize()
                planned = offload.placement(flags, phase)
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
                    old = models.compute_log_probs(actor, batch, 1.0, micro_batch).log_probs  # (B, R)
                    models.compute_log_probs(ref, batch, 1.0, micro_batch)
            if phase == "update":
                actor.train()
                for start in range(0, rows, micro_batch):
                    part = slice(start, start + micro_batch)
                    micro = {k: v[part] for k, v in batch.items()}
                    ratio = torch.exp(models.compute_log_probs(actor, micro, 1.0, micro_batch).log_probs - old[part])
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
        return models.compute_log_probs(actor, micro_batch, 1.0, args.micro_batch).log_probs  # (b, R)

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
        move = functools.partial(models.apply_moves, models={"actor": actor}, optimizers={"actor": optimizer},
                                 device=device)
        move([("actor.params", "host"), ("actor.optimizer", "host")])
        freed = (on_device - torch.cuda.memory_allocated()) / 1e9 if env.device_type == "cuda" else 0.0
        move([("actor.params", "device"), ("actor.optimizer", "device")])
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
            for label, flags in offload.flag_combinations():
                walked = plan_walk(str(path), flags, mesh, dims.fsdp, env.rank % dims.fsdp, batch, mask,
                                   args.micro_batch, device, param_dtype, reduce_dtype)
                plan_rows.append({"layout": layout, "flags": label, **walked})
                for check in ("placement_ok", "finite_and_moved", "freed_ok", "estimate_ok"):
                    if check in walked:
                        checks[f"plan[{layout}: {label}] {check}"] = bool(walked[check])
        skipped.append("the engine's rows of the table (vLLM is not used here)")

    vocab_rows = real_vocabulary_checks(args, meshes.fsdp, device, env.rank, param_dtype, reduce_dtype)
    if args.vl_shape == "off":
        skipped.append("the VLM parity checks (--vl-shape off)")
    else:
        vocab_rows += vl_parity_checks(args, meshes.fsdp, device, env.rank, param_dtype, reduce_dtype)
    ok = torch.tensor(float(all(checks.values()) and all(r["ok"] for r in vocab_rows)))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank's checks
    params_m = sum(p.numel() for p in actor.parameters()) / 1e6
    # every rank idle before any tears the groups down (as tests/fault_ckpt_job.py): a rank that left while
    # the other was still inside the all-reduce once ended in gloo's "terminate called without an active
    # exception" (exit -6) at its teardown
    dist.barrier()
    dist.destroy_process_group()
    if env.rank != 0:
        sys.exit(0 if ok.item() else 1)
    if env.device_type == "cuda":
        torch.cuda.empty_cache()  # the rehearsal's process needs the memory this one no longer uses
    rehearsal_report = None
    if args.rehearsal == "off":
        skipped.append("the memory rehearsal (--rehearsal off)")
        rehearsed: list[dict[str, object]] = []
    else:
        rehearsed, rehearsal_report = rehearsal_rows(args, env.device_type)
        if env.device_type != "cuda":
            skipped.append("the rehearsal's plan / measured gate (CUDA only: allocator statistics)")
    rows = [row(f"phase {name}", None, f"{v['seconds']:.2f} s, peak {v['peak_gb']:.2f} GB") for name, v in phases.items()]
    rows += [row(name, passed, *plan_values(name, plan_rows)) for name, passed in checks.items()]
    rows += vocab_rows + rehearsed
    passed = bool(ok.item()) and all(r["ok"] is not False for r in rehearsed)
    report = {"machine": bc.machine_info(), "model": bc.model_label(args.model), "world": world,
              "params_m": params_m, "param_dtype": str(param_dtype),
              "settings": {k: v for k, v in vars(args).items() if k not in ("assets", "out")},
              "phases": phases, "losses": losses, "offload_moved_gb": moved_gb, "offload_freed_gb": freed_gb,
              "checks_rank0": checks, "all_ranks_ok": bool(ok.item()), "plan": plan_rows, "rows": rows,
              "rehearsal": rehearsal_report, "skipped": skipped, "ok": passed}
    bc.write_json(args.out / "device_check.json", report)
    print(f"device check: {report['machine']['device']}, {world} rank(s), {report['model']} "
          f"({params_m:.1f}M params, compute {param_dtype}), batch {args.batch} x {length} tokens")
    marks = {True: "ok", False: "FAIL", None: "-"}
    print(bc.table([{**r, "ok": marks[r["ok"]]} for r in rows],
                   [("ok", "", ""), ("check", "check", ""), ("value", "value", ""), ("limit", "limit", "")]))
    for part in skipped:
        print(f"  skipped: {part}")
    print(f"{'passed' if passed else 'FAILED'} -> {args.out / 'device_check.json'}")
    if not passed:
        sys.exit(1)


def plan_values(name: str, plan_rows: list[dict[str, object]]) -> tuple[object, object]:
    """(value, limit) of an offload-plan check, from its walk's numbers (rank 0's)."""
    for r in plan_rows:
        if name.startswith(f"plan[{r['layout']}: {r['flags']}] "):
            if name.endswith("freed_ok") and "freed_gb" in r:
                return f"freed {r['freed_gb']:.3f} GB", f"plan {r['freed_plan_gb']:.3f} GB +- 10%"
            if name.endswith("estimate_ok") and "update_peak_gb" in r:
                return f"update peak {r['update_peak_gb']:.3f} GB", f"plan {r['update_plan_gb']:.3f} GB +- 30%"
    return None, None


if __name__ == "__main__":
    main(sys.argv[1:])
