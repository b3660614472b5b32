"""How many bytes each phase of a step holds per rank, before (and while) anything touches a GPU: for
each phase (sync, generate, log_prob, update) and each item of the placement plan (offload.py: where
the actor's parameters, gradients and optimizer state, the critic's, the frozen models' parameters, and
the engine's weights and KV cache live, given the offload flags), the estimated bytes, plus the
activations of one micro batch (its layout: padded rows, one packed row, or a token budget's packed
row; 1/sp of its positions per rank under Ulysses) and the log-prob chunk, and a verdict against the
device's memory. The log_prob and update phases are planned moment by moment (what FSDP2 holds gathered
as each unit unshards and runs its backward, the LM head's logits and their gradient), each phase as its
largest moment.

The whole planner, `python memory_plan.py --config X [--gpu-memory-gb 80] [--json] [key=value ...]`,
prints mesh_utils.py's device map and batch flow, then the memory plan. Nothing in the trainer imports
it: the trainer places its models with offload.py's rules, and the tests check this file's estimates
against measured bytes (tests/test_memory_plan.py, bench/memory_rehearsal.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from config import Config, ConfigError
from mesh_utils import BatchPlan, ParallelDims, describe, plan_arguments, plan_device_map, plan_from_args
from offload import DEVICE, ITEMS, PHASES, OffloadFlags, placement

if TYPE_CHECKING:
    from lora import LoraSpec
    from mesh_utils import UpdateSpec

# -----------------------------------------------------------------------------
# Model shapes, from config.json only


@dataclass(frozen=True)
class VisionShape:
    """What the estimate needs of a vision-language model's vision tower (Qwen2-VL, Qwen2.5-VL)."""

    param_shapes: list[tuple[int, ...]]  # the tower's parameters: patch embedding, blocks, merger
    hidden: int  # the tower's width (Qwen2-VL's embed_dim)
    depth: int
    head_dim: int
    intermediate: int  # its MLP's width
    swiglu: bool  # gate/up/down MLP (Qwen2.5-VL); else fc1, GELU, fc2 (Qwen2-VL)
    rms_norm: bool  # RMSNorm (Qwen2.5-VL); else LayerNorm
    patch_dim: int  # one row of pixel_values: channels x temporal patch x patch x patch
    merge: int  # merge x merge patches make one image token


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a model: its parameters' shapes and its dimensions."""

    param_shapes: list[tuple[int, ...]]  # unique parameters (a tied embedding once), as FSDP2 shards them
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP width a token runs through: a MoE's top_k x expert width (+ shared expert)
    vocab: int
    largest_block_numel: int  # parameters of the largest decoder block
    # parameters of the largest unit gathered only while it runs (models.fsdp_units: a decoder block, an
    # untied embedding or LM head); 0: largest_block_numel
    largest_unit_numel: int = 0
    root_numel: int = 0  # parameters of the root unit (the final norm; a tied embedding)
    # parameters of each unit in the order the forward runs them (an untied embedding, the decoder blocks, an
    # untied LM head); empty: `layers` blocks of largest_block_numel
    unit_numels: tuple[int, ...] = ()
    head_unit: bool = False  # the last of unit_numels is the LM head (untied); else the root holds the output layer
    tied: bool = False  # the root's embedding is the LM head: its gradient is vocab x hidden, summed at the end
    vision: VisionShape | None = None  # a vision-language model's tower (its parameters are in param_shapes too)


def model_shape(path: str, value_head: bool = False, trust_remote_code: bool = False) -> ModelShape:
    """The shapes of the causal LM (or, with value_head, the critic) at `path` (a local directory
    or a hub id in the HF cache), built on the meta device: exact, no weights read, no memory.
    A vision-language model's parameters include its vision tower (sharded, gathered block by block like
    the decoder's); its dimensions are its text model's, and `vision` holds the tower's (vision_shape). Its
    image tokens count in the prompt length (data.max_prompt_length counts them), so the KV cache and the
    decoder's activations hold them; the tower's activations and the pixel buffers follow from the images'
    patches (ImageLoad)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    # the HF cache only: a plan must not wait on (or need) the network
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    vision = getattr(config, "vision_config", None) is not None
    if value_head and vision:
        raise ConfigError(f"{path} is a vision-language model ({config.model_type}); a critic on one is not "
                          f"implemented. Use an estimator without a critic (algorithm.adv_estimator=grpo).")
    if value_head:
        config.num_labels = 1
    auto_cls = (AutoModelForTokenClassification if value_head else AutoModelForImageTextToText if vision
                else AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto_cls.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    # imported here, as torch is: a plan without a model stays instant
    from models import decoder_layers, fsdp_units
    from moe import active_mlp_width

    text = config.get_text_config()  # the config itself, for a text model
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    blocks = decoder_layers(model)
    units = fsdp_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    in_order = ([embed] if any(embed is u for u in units) else []) + list(blocks) \
        + ([head] if head is not None and any(head is u for u in units) else [])  # the forward's order
    return ModelShape(
        param_shapes=[tuple(p.shape) for p in model.parameters()],  # tied ones once, as FSDP2 holds them
        hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=active_mlp_width(text), vocab=text.vocab_size,
        largest_block_numel=max(sum(p.numel() for p in b.parameters()) for b in blocks),
        largest_unit_numel=max(sum(p.numel() for p in unit.parameters()) for unit in units),
        root_numel=sum(p.numel() for p in model.parameters() if id(p) not in in_units),
        unit_numels=tuple(sum(p.numel() for p in unit.parameters()) for unit in in_order),
        head_unit=head is not None and any(head is u for u in units),
        tied=head is not None and embed is not None and head.weight is embed.weight,
        vision=vision_shape(model) if vision else None)


def vision_shape(model: Any) -> VisionShape:
    """The tower's shapes and widths, from the model built on the meta device (its blocks say which MLP and norm)."""
    from vision import vision_tower

    tower = vision_tower(model)
    cfg = model.config.vision_config
    block = tower.blocks[0]
    hidden = getattr(cfg, "embed_dim", None) or cfg.hidden_size  # Qwen2-VL's hidden_size is the merger's output
    swiglu = hasattr(block.mlp, "gate_proj")
    intermediate = block.mlp.up_proj.out_features if swiglu else block.mlp.fc1.out_features
    return VisionShape(param_shapes=[tuple(p.shape) for p in tower.parameters()], hidden=hidden, depth=len(tower.blocks),
                       head_dim=hidden // cfg.num_heads, intermediate=intermediate, swiglu=swiglu,
                       rms_norm="RMSNorm" in type(block.norm1).__name__,
                       patch_dim=cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2,
                       merge=cfg.spatial_merge_size)


# -----------------------------------------------------------------------------
# Bytes


def shard_numel(shape: tuple[int, ...], fsdp: int, fsdp_rank: int) -> int:
    """Elements of FSDP2's local shard on `fsdp_rank`: dim 0 cut as torch.chunk cuts it (ceil rows
    per rank, the last ranks fewer or none)."""
    if not shape:
        return 1
    rows = -(-shape[0] // fsdp)
    mine = max(0, min(rows, shape[0] - fsdp_rank * rows))
    return mine * math.prod(shape[1:])


def param_shard_bytes(shape: ModelShape, fsdp: int, fsdp_rank: int, dtype_bytes: int = 4) -> int:
    """fp32 master-weight shard bytes on one rank (gradients are the same size and dtype)."""
    return sum(shard_numel(s, fsdp, fsdp_rank) for s in shape.param_shapes) * dtype_bytes


def adam_state_bytes(shape: ModelShape, fsdp: int, fsdp_rank: int) -> int:
    """AdamW's state on one rank: exp_avg and exp_avg_sq (fp32, shard-sized) and a float32 `step`
    per parameter."""
    return 2 * param_shard_bytes(shape, fsdp, fsdp_rank) + 4 * len(shape.param_shapes)


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool, sp: int = 1, packed: bool = False) -> int:
    """Bytes autograd saves for backward on one rank in one training forward of (micro_batch, seq_len)
    tokens (rows of the micro batch: padded, its samples; packed, one row of their valid tokens; see
    forward_layout) through an HF Llama/Qwen2-style decoder (sdpa attention, RMSNorm, SwiGLU), up to
    the LM head's input. With Ulysses (sp > 1) each rank runs ceil(seq_len / sp) positions of every row
    (attention's all-to-all trades them for 1/sp of the heads over all positions: the same bytes) but
    builds the whole row's mask, if it has one. Per token and layer, with e = dtype_bytes, h hidden,
    q = heads x head_dim, kv = kv_heads x head_dim, i = intermediate:
      2 RMSNorms      each its float32 input (4h) and its normalised output (e h)
      attention       q, k, v projections; q and k rotated and embedded; sdpa's output and o_proj's
                      input: e (5 q + 4 kv)
      SwiGLU          gate, silu(gate), up, their product: 4 e i
    With gradient checkpointing a block keeps only its input (e h); backward then recomputes one
    block at a time, which `peak_recompute_bytes` adds. Shared by all blocks: the final norm
    (4h + e h), the rotary cos and sin (2 e head_dim) and, for padded rows, the boolean (seq_len,
    seq_len) attention mask of each; a packed row has none (attention.py runs sdpa per sequence)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e = dtype_bytes
    tokens = micro_batch * -(-seq_len // sp)  # this rank's positions
    per_layer = 2 * (4 * h + e * h) + e * (5 * q + 4 * kv) + 4 * e * i
    kept = e * h if checkpointing else per_layer
    shared = 4 * h + e * h + 2 * e * shape.head_dim
    return tokens * (shape.layers * kept + shared) + (0 if packed else micro_batch * seq_len * seq_len)


def vision_activation_bytes(v: VisionShape, patches: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Bytes autograd saves for backward in the vision tower's training forward of `patches` patches (a
    micro batch's images; attention runs image by image, sdpa per window or image, so no mask grows with
    them). Per patch and block, with e = dtype_bytes, d the tower's width, i its MLP's:
      2 norms      LayerNorm: its input (e d) each; RMSNorm: its float32 input and its output (4d + e d)
      attention    the norm's output, qkv's output (3), q and k rotated (2), sdpa's output, proj's input and
                   the second norm's output: 9 e d
      MLP          fc1's output, GELU's and fc2's input: 3 e i; SwiGLU's gate, silu, up, product: 4 e i
    With gradient checkpointing a block keeps only its input (e d). Shared by the blocks, per patch: the
    patch embedding's input (e x patch_dim), the rotary cos and sin (float32, head_dim each) and the merger
    (its norm, then the inputs of fc1, GELU and fc2: 3 e d). Within 10% of what autograd saves on both
    towers (tests/test_memory_plan.py; a few % measured)."""
    e, d, i = dtype_bytes, v.hidden, v.intermediate
    norm = 4 * d + e * d if v.rms_norm else e * d
    per_block = 2 * norm + 9 * e * d + (4 if v.swiglu else 3) * e * i
    kept = e * d if checkpointing else per_block
    shared = e * v.patch_dim + 2 * 4 * v.head_dim + norm + 3 * e * d
    return patches * (v.depth * kept + shared)


def vision_recompute_bytes(v: VisionShape, patches: int, dtype_bytes: int) -> int:
    """With gradient checkpointing, one tower block's recomputed activations during its backward."""
    full = vision_activation_bytes(v, patches, dtype_bytes, False)
    kept = vision_activation_bytes(v, patches, dtype_bytes, True)
    return (full - kept) // max(v.depth, 1) + patches * dtype_bytes * v.hidden


def pixel_bytes(samples: int, micro_samples: int, patches: int, patch_dim: int, dtype_bytes: int) -> int:
    """A VLM batch's pixels on one rank: the batch column pixel_values, float32 (samples, patches, patch_dim),
    the widest sample's patches in every row (vision.pixel_rows), held from the log-prob forwards to the end
    of the update; and a micro batch's images concatenated for the tower (float32) and cast to the compute
    dtype (vision.micro_batch_pixels)."""
    return (samples * 4 + micro_samples * (4 + dtype_bytes)) * patches * patch_dim


def peak_recompute_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                         checkpointing: bool, sp: int = 1) -> int:
    """With gradient checkpointing, one block's recomputed activations exist during its backward."""
    if not checkpointing:
        return 0
    one = activation_bytes(shape, micro_batch, seq_len, dtype_bytes, False, sp, packed=True)
    base = activation_bytes(shape, micro_batch, seq_len, dtype_bytes, True, sp, packed=True)
    return (one - base) // max(shape.layers, 1) + micro_batch * -(-seq_len // sp) * dtype_bytes * shape.hidden


def forward_layout(micro: int, seq_len: int, packed: bool, max_tokens: int | None,
                   samples_per_rank: int | None = None) -> tuple[int, int]:
    """(rows, row length) of one training micro batch as models.compute_log_probs runs it:
      padded            `micro` rows of P+R positions
      packed            one row of their valid tokens, at most micro x (P+R)
      token budget      (use_dynamic_bsz; max_tokens valid tokens, the sp group's) packed: one row of at
                        most max_tokens, however many samples it holds; padded: as many P+R rows as
                        the budget admits samples of 2 valid tokens, at most the rank's samples
    """
    if max_tokens is None:
        return (1, micro * seq_len) if packed else (micro, seq_len)
    if packed:
        return 1, max_tokens
    return max(1, min(max_tokens // 2, samples_per_rank or max_tokens)), seq_len


def head_positions(rows: int, row_len: int, packed: bool, micro: int, response_len: int, sp: int,
                   dynamic: bool) -> int:
    """Positions one rank runs through the LM head in a micro batch: with Ulysses, every position of
    its slice; packed, the response tokens (at most micro x R, or the token budget); padded, the
    R+1 last positions of each row."""
    if sp > 1:
        return rows * -(-row_len // sp)
    if packed:
        return row_len if dynamic else micro * response_len
    return rows * (response_len + 1)


def logprob_chunk_bytes(shape: ModelShape, positions: int, dtype_bytes: int, chunk_rows: int = 1024,
                        backward: bool = False) -> int:
    """The most the LM head's logits for `positions` (head_positions, in the compute dtype) and
    ppo_core.logprobs_and_entropy's float32 chunks of rows hold at once. Forward: the logits and three
    chunks (the upcast chunk, its softmax and their product, for the entropy). Backward (`backward`, the
    update; the larger of its moments and the forward's): in _LogProbEntropy's backward the saved logits,
    their gradient (same size and dtype) and three chunks (the previous chunk's probabilities live until
    the next chunk's are made). The way back through the temperature division and the row select holds
    no more (two logits-sized tensors: models.compute_log_probs divides the head's output in place, not
    a view of it, which would hold four)."""
    logits, chunk = positions * shape.vocab * dtype_bytes, min(chunk_rows, positions) * shape.vocab * 4
    forward = logits + 3 * chunk
    return max(forward, 2 * logits + 3 * chunk) if backward else forward


def _units(shape: ModelShape) -> list[int]:
    """The parameters of each unit in forward order (ModelShape.unit_numels, or `layers` blocks)."""
    return list(shape.unit_numels) or [shape.largest_unit_numel or shape.largest_block_numel] * max(shape.layers, 1)


def forward_gathered_bytes(shape: ModelShape, dtype_bytes: int, fsdp: int) -> tuple[int, int]:
    """(the most FSDP2 holds gathered while a forward's units unshard, what it holds at the LM head's
    matmul) in the compute dtype. FSDP2 (torch 2.13, FSDPParamGroup.wait_for_unshard) copies each unit's
    all-gather output into its unsharded parameters and, in a forward, frees that flat output only once
    the next unit's copy-out is done: unit k's copy-out holds the root's parameters, unit k-1's flat
    output, unit k's and its parameters (the first unit's predecessor is the root, whose flat output is
    its size); the units before k are resharded. At the head: the root and, untied, the head's output
    and parameters, or, with the head in the root, the last unit's output. With fsdp 1 there is no flat
    output: the root and one unit."""
    e, root, units = dtype_bytes, shape.root_numel, _units(shape)
    if fsdp == 1:
        return e * (root + max(units)), e * (root + (units[-1] if shape.head_unit else 0))
    peak = max([2 * root] + [root + prev + 2 * n for prev, n in zip([root] + units[:-1], units, strict=True)])
    return e * peak, e * (root + (2 if shape.head_unit else 1) * units[-1])


def backward_gathered_bytes(shape: ModelShape, dtype_bytes: int, reduce_bytes: int = 4,
                            trained: bool = True) -> tuple[int, int, int]:
    """What FSDP2 holds gathered in a backward, at three kinds of moment (compute dtype e, float32
    reduce-scatter, bytes): (while the logits' gradient lives: the LM head's backward; with activations:
    every unit's; alone: the tied root's last, when the activations are freed).
    The root is gathered again at the backward's start and held to its end, and with a tied embedding
    so is the LM head's weight gradient (vocab x hidden, made at the head, summed with the embedding's
    at the end). Unit k's backward (backward order) holds its parameters and gradient (2e), the next
    unit's all-gather output (prefetched, e) and unit k-1's float32 reduce-scatter input (4; FSDP2 keeps
    one until the next reduce-scatter); its post-backward reshards it, drops k-1's input and makes its
    own: its gradient, that input and the prefetched unit. The tied root's end: its parameters, the two
    gradients and their sum (4e), and the last unit's reduce-scatter input; then its gradient and its
    own input. Frozen (`trained` false: LoRA's base, whose adapter's gradients are too small to count), a
    unit's backward holds its parameters and the prefetched unit's, and no gradient."""
    e, r, root = dtype_bytes, reduce_bytes, shape.root_numel
    units = _units(shape)[::-1]
    g = e if trained else 0  # a unit's gradient
    if not trained:
        r = 0
    head_grad = shape.vocab * shape.hidden if shape.tied and trained else 0
    held = e * (root + head_grad)
    prev, nxt = [0] + units[:-1], units[1:] + [0]
    during = [held + r * p + (e + g) * n + e * q for p, n, q in zip(prev, units, nxt, strict=True)]
    post = [held + (g + r) * n + e * q for n, q in zip(units, nxt, strict=True)]
    if shape.head_unit:
        first, rest = during[0], during[1:] + post
    else:  # the head's matmul runs in the root: the root, the head's weight gradient, the first unit prefetched
        first, rest = held + e * units[0], during + post
    end = (e * root + 3 * e * head_grad + r * units[-1]) if shape.tied and trained else 0
    return first, max(rest), max(end, (g + r) * root)


def gathered_bytes(shape: ModelShape, dtype_bytes: int, backward: bool, fsdp: int = 2) -> int:
    """The most FSDP2 holds gathered at once in a forward (forward_gathered_bytes) or, with `backward`,
    in a forward and backward (backward_gathered_bytes) of the model, whatever else is live."""
    forward = max(forward_gathered_bytes(shape, dtype_bytes, fsdp))
    return max(forward, *backward_gathered_bytes(shape, dtype_bytes)) if backward else forward


def grad_bytes(trained_shard: int, trained_full: int, accumulate_unsharded: bool) -> int:
    """A trained model's gradients in the update: its fp32 shard, reduce-scattered after every micro
    batch; with fsdp_config.accumulate_unsharded_grads (and more than one micro batch per optimizer
    step) also the full unsharded fp32 gradient that every rank holds between micro batches."""
    return trained_shard + (trained_full if accumulate_unsharded else 0)


def sync_bucket_bytes(shape: ModelShape, dtype_bytes: int, fsdp: int,
                      bucket_bytes: int = 16 * 2**20) -> int:
    """models.iter_full_params' largest bucket in the engine's dtype: up to `bucket_bytes` of parameters,
    or one larger parameter whole (a Qwen2.5 embedding: hundreds of MiB), plus, on more than one rank,
    the bucket's shards cast to that dtype and packed for the all-gather (2/fsdp of it)."""
    total = sum(math.prod(s) for s in shape.param_shapes) * dtype_bytes
    largest = max(math.prod(s) for s in shape.param_shapes) * dtype_bytes
    bucket = max(min(bucket_bytes, total), largest)
    return bucket + (2 * bucket // fsdp if fsdp > 1 else 0)


GIB = 2**30


@dataclass(frozen=True)
class ImageLoad:
    """The images of the largest prompt: its patches (all its images) and its images, and where they came from."""

    patches: int  # rows of pixel_values one sample holds
    images: int
    tokens: int  # its image pad tokens: patches / merge^2 (in data.max_prompt_length, in the KV cache)
    source: str
    grids: tuple[tuple[int, int, int], ...] = ()  # its images' (t, h, w) patches, when read from the data


def image_load(cfg: Config, image_processor: Any, merge: int) -> ImageLoad:
    """The largest prompt's images in data.train_files (and val_files), local files read for their image
    headers only (vision.image_grid: the processor's resize); without local files, one image at the image
    processor's largest size (its size.longest_edge, Qwen2-VL's max_pixels: preprocessor_config.json)."""
    from pathlib import Path

    from data import _as_list, load_rows
    from vision import image_grid, image_size

    files = [f for key in ("train_files", "val_files") for f in _as_list(getattr(cfg.data, key) or [])]
    if files and all(Path(f).expanduser().is_file() for f in files):
        largest: tuple[int, tuple] = (0, ())
        for row in load_rows(files, "data.train_files"):
            grids = tuple(image_grid(image_size(image), image_processor) for image in row.get("images") or ())
            largest = max(largest, (sum(math.prod(g) for g in grids), grids))
        patches, grids = largest
        return ImageLoad(patches, len(grids), patches // merge ** 2,
                         f"the largest prompt's images in data.train_files/val_files ({len(files)} file(s))", grids)
    bounds = image_processor.size
    max_pixels = bounds.get("longest_edge") if hasattr(bounds, "get") else bounds.longest_edge
    patch = image_processor.patch_size
    side = patch * merge  # smart_resize keeps h x w <= max_pixels in multiples of patch x merge
    patches = (max_pixels // side ** 2) * merge ** 2
    return ImageLoad(patches, 1, patches // merge ** 2,
                     f"one image per prompt at the image processor's largest, {max_pixels} pixels (no local data files)")


@dataclass(frozen=True)
class MemoryInputs:
    """What the estimate reads from the config, the layout and the batch plan (for one FSDP rank)."""

    actor: ModelShape
    critic: ModelShape | None
    use_ref: bool
    flags: OffloadFlags
    fsdp: int
    infer_tp: int
    compute_bytes: int  # 2 for bf16 compute on CUDA
    engine_bytes: int  # the engine's weight dtype
    prompt_len: int
    response_len: int
    ppo_micro: int  # actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (resolved)
    log_prob_micro: int
    critic_micro: int | None
    actor_checkpointing: bool
    critic_checkpointing: bool
    gpu_memory_utilization: float
    gpu_memory_bytes: int
    adapter: list[tuple[int, ...]] | None = None  # LoRA: the adapter's parameter shapes (None: full fine-tuning)
    sp: int = 1  # actor_rollout_ref.actor.ulysses_sequence_parallel_size
    actor_packed: bool = False  # actor_rollout_ref.model.use_remove_padding
    critic_packed: bool = False  # critic.model.use_remove_padding
    # use_dynamic_bsz: the valid tokens of one micro batch (mesh_utils.BatchPlan's, the per-gpu budget x sp);
    # None: micro batches of a fixed number of samples
    ppo_max_tokens: int | None = None
    log_prob_max_tokens: int | None = None
    critic_max_tokens: int | None = None
    samples_per_rank: int | None = None  # what bounds a padded token-budget micro batch
    # fsdp_config.accumulate_unsharded_grads with more than one micro batch per optimizer step: the full
    # unsharded gradient is held between micro batches (actor's, critic's)
    accumulate_unsharded_grads: bool = False
    critic_accumulate_unsharded_grads: bool = False
    reward_model: ModelShape | None = None  # reward_model.enable: the model that scores in the generate phase
    reward_micro: int = 1  # reward_model.micro_batch_size_per_gpu (resolved)
    reward_packed: bool = True  # reward_model.model.use_remove_padding
    teacher: ModelShape | None = None  # distillation.enabled: the teacher, run forward in the log_prob phase
    teacher_topk: int | None = None  # forward_kl_topk's k: the teacher's top-k log-probs and ids stay in the batch
    split: bool = False  # a separate rollout pool: no engine on the trainers (theirs sleeps for good at start)
    pool_ranks: int = 0  # a separate rollout pool's ranks: its reward model is sharded over them (0: collocated)
    images: ImageLoad | None = None  # a VLM: the largest prompt's images (image_load)
    freeze_vision_tower: bool = False  # actor.freeze_vision_tower: the tower takes no gradient nor AdamW state


def phase_bytes(m: MemoryInputs, fsdp_rank: int) -> dict[str, dict[str, int]]:
    """Estimated device bytes per phase and item on one rank (rank `fsdp_rank` of its FSDP group)."""
    actor_shard = param_shard_bytes(m.actor, m.fsdp, fsdp_rank)
    trained_shard, actor_adam = actor_shard, adam_state_bytes(m.actor, m.fsdp, fsdp_rank)
    trained_full = param_shard_bytes(m.actor, 1, 0)
    if m.adapter is not None:  # LoRA: the frozen base plus the adapter, which alone has gradients and Adam state
        trained_shard = sum(shard_numel(s, m.fsdp, fsdp_rank) for s in m.adapter) * 4
        trained_full = sum(math.prod(s) for s in m.adapter) * 4
        actor_shard, actor_adam = actor_shard + trained_shard, 2 * trained_shard + 4 * len(m.adapter)
    tower = m.actor.vision.param_shapes if m.actor.vision else []
    if m.freeze_vision_tower and tower and m.adapter is None:  # the language model alone is trained
        trained_shard -= sum(shard_numel(s, m.fsdp, fsdp_rank) for s in tower) * 4
        trained_full -= sum(math.prod(s) for s in tower) * 4
        actor_adam = 2 * trained_shard + 4 * (len(m.actor.param_shapes) - len(tower))
    critic_shard = param_shard_bytes(m.critic, m.fsdp, fsdp_rank) if m.critic else 0
    critic_full = param_shard_bytes(m.critic, 1, 0) if m.critic else 0
    engine_weights = sum(math.prod(s) for s in m.actor.param_shapes) * m.engine_bytes // m.infer_tp
    engine_total = int(m.gpu_memory_utilization * m.gpu_memory_bytes)
    out: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        where = placement(m.flags, phase)
        on = {item: where[item] == DEVICE for item in ITEMS}
        b = {
            "actor.params": actor_shard if on["actor.params"] else 0,
            "actor.grads": grad_bytes(trained_shard, trained_full, m.accumulate_unsharded_grads)
            if on["actor.grads"] else 0,
            "actor.optimizer": actor_adam if on["actor.optimizer"] else 0,
            "critic.params": critic_shard if m.critic and on["critic.params"] else 0,
            "critic.grads": grad_bytes(critic_shard, critic_full, m.critic_accumulate_unsharded_grads)
            if m.critic and on["critic.grads"] else 0,
            "critic.optimizer": adam_state_bytes(m.critic, m.fsdp, fsdp_rank) if m.critic and on["critic.optimizer"]
            else 0,
            "ref.params": actor_shard if m.use_ref and on["ref.params"] else 0,
            "reward_model.params": (param_shard_bytes(m.reward_model, m.fsdp, fsdp_rank)  # a split's: on the pool
                                    if m.reward_model and on["reward_model.params"] and not m.split else 0),
            "teacher.params": param_shard_bytes(m.teacher, m.fsdp, fsdp_rank) if m.teacher and on["teacher.params"] else 0,
            "engine.weights": engine_weights if on["engine.weights"] and not m.split else 0,
            "engine.kv_cache": max(0, engine_total - engine_weights) if on["engine.kv_cache"] and not m.split else 0,
            "gathered_blocks": 0,
            "activations": 0,
            "log_prob_chunk": 0,
            "reward_model.forward": 0,
            "teacher.topk": 0,
            "pixels": 0,
        }
        if phase == "sync":
            b["gathered_blocks"] = sync_bucket_bytes(m.actor, m.engine_bytes, m.fsdp)
        if phase == "generate" and m.reward_model is not None and not m.split:  # it scores beside the awake engine
            b["reward_model.forward"] = _reward_forward_bytes(m, m.fsdp)
        if phase == "log_prob":
            b |= _log_prob_peak(m)
        if m.teacher_topk and phase in ("log_prob", "update"):  # float32 log-probs and int64 ids per response token
            b["teacher.topk"] = (m.samples_per_rank or 0) * m.response_len * m.teacher_topk * (4 + 8)
        if phase == "update":
            b |= _update_peak(m)
        if m.images is not None and m.actor.vision is not None and phase in ("log_prob", "update"):
            micro = m.log_prob_micro if phase == "log_prob" else m.ppo_micro
            max_tokens = m.log_prob_max_tokens if phase == "log_prob" else m.ppo_max_tokens
            b["pixels"] = pixel_bytes(m.samples_per_rank or micro, _micro_samples(m, micro, max_tokens),
                                      m.images.patches, m.actor.vision.patch_dim, m.compute_bytes)
        out[phase] = b
    return out


# The transient items of a phase's moments: what FSDP2 holds gathered, the activations, the LM head's logits
# and float32 chunks. A phase's plan is its largest moment (the items of that moment), not the sum of each
# item's own largest: a tied model's embedding gradients peak at the end of the backward, when the logits
# and the activations are long freed.
Moment = dict[str, int]


def rollout_rank_bytes(m: MemoryInputs) -> dict[str, int]:
    """A rank of a separate rollout pool: its engine (weights and KV cache within gpu_memory_utilization), and
    one bucket of the weights trainer 0 broadcasts (received whole, then loaded), beside it at the sync. With
    reward_model.enable also the reward model, sharded over the pool's ranks (its shard on the device unless
    reward_model.model.fsdp_config.param_offload) and its forward, which scores the pool's batch beside the
    engine (the sync bucket is freed by then: the larger of the two counts)."""
    engine_weights = sum(math.prod(s) for s in m.actor.param_shapes) * m.engine_bytes // m.infer_tp
    engine_total = int(m.gpu_memory_utilization * m.gpu_memory_bytes)
    out = {"engine.weights": engine_weights, "engine.kv_cache": max(0, engine_total - engine_weights),
           "sync_bucket": sync_bucket_bytes(m.actor, m.engine_bytes, 1)}
    if m.reward_model is not None:
        resident = placement(m.flags, "generate")["reward_model.params"] == DEVICE  # the first shard is the largest
        out["reward_model.params"] = param_shard_bytes(m.reward_model, m.pool_ranks, 0) if resident else 0
        forward = _reward_forward_bytes(m, m.pool_ranks)
        out["sync_bucket"], out["reward_model.forward"] = ((out["sync_bucket"], 0) if out["sync_bucket"] >= forward
                                                           else (0, forward))
    return out


def _largest(moments: list[Moment]) -> Moment:
    return max(moments, key=lambda items: sum(items.values()))


def _moment(gathered: int = 0, activations: int = 0, head: int = 0) -> Moment:
    return {"gathered_blocks": gathered, "activations": activations, "log_prob_chunk": head}


def _log_prob_peak(m: MemoryInputs) -> Moment:
    """The log_prob phase's no-grad forwards (the actor's, the reference's, the teacher's), one micro batch at
    a time (models.compute_log_probs releases a micro batch's logits before the next one's forward): while
    the units unshard (forward_gathered_bytes); at the LM head's matmul, the logits beside what is gathered
    there; then the logits and the float32 chunks, nothing gathered (the root reshards after the forward)."""
    moments = []
    for shape in (m.actor, m.teacher):
        if shape is None:
            continue
        positions = _head_positions(m, m.log_prob_micro, m.log_prob_max_tokens)
        logits = positions * shape.vocab * m.compute_bytes
        units, at_head = forward_gathered_bytes(shape, m.compute_bytes, m.fsdp)
        if shape.vision is not None and m.images is not None:  # the tower's no-grad forward: a block at a time
            patches = _micro_samples(m, m.log_prob_micro, m.log_prob_max_tokens) * m.images.patches
            moments.append(_moment(units, vision_recompute_bytes(shape.vision, patches, m.compute_bytes)))
        moments += [_moment(units), _moment(at_head, head=logits),
                    _moment(head=logprob_chunk_bytes(shape, positions, m.compute_bytes))]
    return _largest(moments)


def _update_peak(m: MemoryInputs) -> Moment:
    """The update's micro batch, forward and backward, of the actor (and of the critic, after it): every
    activation is counted at every moment but the tied root's last (the forward saves them, the backward
    frees them block by block; with checkpointing, one block's recompute too). The actor's moments: its
    forward's units unshard (forward_gathered_bytes); at the LM head's matmul, the logits; the log-prob
    backward (logprob_chunk_bytes), nothing gathered; the head's backward, beside the logits' gradient;
    every unit's backward; the tied root's end (backward_gathered_bytes). The critic's: its forward and
    backward gathered beside its activations (its values are one number per token)."""
    e = m.compute_bytes
    positions = _head_positions(m, m.ppo_micro, m.ppo_max_tokens)
    logits = positions * m.actor.vocab * e
    acts = _update_activations(m, critic=False)
    units, at_head = forward_gathered_bytes(m.actor, e, m.fsdp)
    first, rest, end = backward_gathered_bytes(m.actor, e, trained=m.adapter is None)
    moments = [_moment(units, acts), _moment(at_head, acts, logits),
               _moment(0, acts, logprob_chunk_bytes(m.actor, positions, e, backward=True)),
               _moment(first, acts, logits), _moment(rest, acts), _moment(end)]
    if m.critic is not None and m.critic_micro:
        moments.append(_moment(gathered_bytes(m.critic, e, backward=True, fsdp=m.fsdp),
                               _update_activations(m, critic=True)))
    return _largest(moments)


def _update_activations(m: MemoryInputs, critic: bool, checkpointing: bool | None = None,
                        recompute: bool = True) -> int:
    """One update micro batch's activations (and, with recompute, a checkpointed block's recompute) on
    one rank, of the actor or the critic (0 without one); checkpointing overrides the config's."""
    shape = m.critic if critic else m.actor
    micro = m.critic_micro if critic else m.ppo_micro
    if shape is None or not micro:
        return 0
    if checkpointing is None:
        checkpointing = m.critic_checkpointing if critic else m.actor_checkpointing
    packed = m.critic_packed if critic else m.actor_packed
    max_tokens = m.critic_max_tokens if critic else m.ppo_max_tokens
    rows, row_len = forward_layout(micro, m.prompt_len + m.response_len, packed, max_tokens, m.samples_per_rank)
    text = activation_bytes(shape, rows, row_len, m.compute_bytes, checkpointing, m.sp, packed)
    text_recompute = peak_recompute_bytes(shape, rows, row_len, m.compute_bytes, checkpointing, m.sp)
    tower = tower_recompute = 0
    if shape.vision is not None and m.images is not None and not m.freeze_vision_tower:
        # a frozen tower saves nothing for backward: no gradient flows into it
        patches = _micro_samples(m, micro, max_tokens) * m.images.patches
        tower = vision_activation_bytes(shape.vision, patches, m.compute_bytes, checkpointing)
        tower_recompute = vision_recompute_bytes(shape.vision, patches, m.compute_bytes) if checkpointing else 0
    # one block is recomputed at a time, the tower's after the language model's
    return text + tower + (max(text_recompute, tower_recompute) if recompute else 0)


def _micro_samples(m: MemoryInputs, micro: int, max_tokens: int | None) -> int:
    """The samples of one micro batch, whose images the tower runs: `micro`, or with a token budget as many
    samples of the largest prompt (its image tokens and one response token) as it admits."""
    if max_tokens is None:
        return micro
    least = (m.images.tokens if m.images else 0) + 1
    return max(1, min(max_tokens // least, m.samples_per_rank or max_tokens))


def _reward_forward_bytes(m: MemoryInputs, fsdp: int) -> int:
    """The reward model's no-grad forward of one micro batch, sharded over `fsdp` ranks: two of its blocks
    gathered, and the activations one block holds while it runs (nothing is kept for a backward)."""
    shape = m.reward_model
    rows, row_len = forward_layout(m.reward_micro, m.prompt_len + m.response_len, m.reward_packed, None)
    mask = 0 if m.reward_packed else rows * row_len * row_len
    return (gathered_bytes(shape, m.compute_bytes, backward=False, fsdp=fsdp)
            + peak_recompute_bytes(shape, rows, row_len, m.compute_bytes, True) + mask)


def _head_positions(m: MemoryInputs, micro: int, max_tokens: int | None) -> int:
    """The positions of one micro batch that go through the actor's LM head on one rank (head_positions)."""
    rows, row_len = forward_layout(micro, m.prompt_len + m.response_len, m.actor_packed, max_tokens,
                                   m.samples_per_rank)
    return head_positions(rows, row_len, m.actor_packed, micro, m.response_len, m.sp, max_tokens is not None)


def _remedies(m: MemoryInputs, phase: str, items: dict[str, int], over: int,
              ppo_mini_per_rank: int) -> list[tuple[str, int]]:
    """(the key=value to set, the bytes it frees in `phase`), in the order worth trying."""
    out: list[tuple[str, int]] = []
    engine = items["engine.weights"] + items["engine.kv_cache"]
    if phase in ("log_prob", "update") and engine:
        out.append(("actor_rollout_ref.rollout.free_cache_engine=true", engine))
    if phase in ("sync", "generate"):
        room = m.gpu_memory_bytes - (sum(items.values()) - engine)
        if room > items["engine.weights"]:
            util = math.floor(room / m.gpu_memory_bytes * 100) / 100
            out.append((f"actor_rollout_ref.rollout.gpu_memory_utilization={util:.2f}", over))
    def freed(**change: Any) -> int:  # the phase planned again with the change: its largest moment may move
        return sum(items.values()) - sum(phase_bytes(replace(m, **change), 0)[phase].values())

    if phase == "update":
        if not m.actor_checkpointing:
            out.append(("actor_rollout_ref.model.enable_gradient_checkpointing=true", freed(actor_checkpointing=True)))
        smaller = [d for d in range(m.ppo_micro - 1, 0, -1) if ppo_mini_per_rank % d == 0]
        if m.ppo_max_tokens is not None:  # token budgets: the budget, not the micro batch size, sets the bytes
            smaller = []
            per_gpu, least = m.ppo_max_tokens // m.sp, -(-(m.prompt_len + m.response_len) // m.sp)
            if m.actor_packed:  # the largest budget that fits, else the least (one sample)
                budgets = range(per_gpu - 1, least - 1, -max(1, (per_gpu - least) // 64))
                freeing = {t: freed(ppo_max_tokens=t * m.sp) for t in budgets}
                budget = next((t for t, f in freeing.items() if f >= over), least)
                if budget < per_gpu:
                    out.append((f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
                                freeing.get(budget, freed(ppo_max_tokens=budget * m.sp))))
            else:  # padded, a budget admits many short samples, each P+R positions long
                out.append(("actor_rollout_ref.model.use_remove_padding=true", freed(actor_packed=True)))
        if smaller:
            freeing = {d: freed(ppo_micro=d) for d in smaller}
            d = next((d for d in smaller if freeing[d] >= over), smaller[-1])
            out.append((f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={d}", freeing[d]))
    if phase == "log_prob" and m.log_prob_micro > 1:
        smaller = list(range(m.log_prob_micro - 1, 0, -1))
        freeing = {d: freed(log_prob_micro=d) for d in smaller}
        d = next((d for d in smaller if freeing[d] >= over), 1)
        out.append((f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={d}", freeing[d]))
    for item, key, flag in (("actor.optimizer", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                             m.flags.actor_optimizer),
                            ("critic.optimizer", "critic.fsdp_config.optimizer_offload", m.flags.critic_optimizer),
                            ("ref.params", "actor_rollout_ref.ref.fsdp_config.param_offload", m.flags.ref_param),
                            ("teacher.params", "distillation.teacher_models.teacher_model.fsdp_config.param_offload",
                             m.flags.teacher_param)):
        if items[item] and not flag and (item in ("ref.params", "teacher.params") or phase != "update"):
            out.append((f"{key}=true", items[item]))
    if phase == "generate":
        for item, key, flag in (("actor.params", "actor_rollout_ref.actor.fsdp_config.param_offload",
                                 m.flags.actor_param),
                                ("critic.params", "critic.fsdp_config.param_offload", m.flags.critic_param)):
            if items[item] and not flag:
                out.append((f"{key}=true", items[item]))
    return out


def verdict(m: MemoryInputs, per_phase: dict[str, dict[str, int]], ppo_mini_per_rank: int) -> tuple[bool, str]:
    """(fits, one line): the tightest phase against the device's memory and, when it does not fit,
    the key to change and a value that makes it fit (or that helps most, when no single one does)."""
    limit = m.gpu_memory_bytes
    totals = {phase: sum(items.values()) for phase, items in per_phase.items()}
    worst = max(totals, key=totals.get)

    def gb(n: float) -> str:
        return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"

    head = f"phase {worst} needs {gb(totals[worst])} of {gb(limit)} (--gpu-memory-gb)"
    if totals[worst] <= limit:
        return True, f"fits: the largest phase, {head}, leaves {gb(limit - totals[worst])}"
    over = totals[worst] - limit
    remedies = _remedies(m, worst, per_phase[worst], over, ppo_mini_per_rank)
    enough = [(key, freed) for key, freed in remedies if freed >= over]
    if enough:
        key, freed = enough[0]
        return False, f"does not fit: {head}; set {key} (frees about {gb(freed)})"
    if remedies:
        key, freed = max(remedies, key=lambda r: r[1])
        return False, (f"does not fit: {head}; no single key frees {gb(over)}: set {key} (frees the most, "
                       f"{gb(freed)}) and shard over more ranks (more trainer.n_gpus_per_node, fsdp_size=-1)")
    return False, (f"does not fit: {head}; no single key frees {gb(over)}: shard over more ranks "
                   f"(actor_rollout_ref.actor.fsdp_config.fsdp_size=-1, more trainer.n_gpus_per_node) or "
                   f"lower data.max_response_length")


def memory_inputs(cfg: Config, dims: ParallelDims, plan: BatchPlan, gpu_memory_gb: float) -> MemoryInputs:
    """Read the model shapes (config.json) and the settings; raises OSError/ValueError when the
    model's config cannot be read."""
    roles = cfg.actor_rollout_ref
    trust = roles.model.trust_remote_code
    actor = model_shape(roles.model.path, trust_remote_code=trust)
    critic_update = plan.critic_update  # None: no critic (mesh_utils.BatchPlan resolves each role once)
    critic = model_shape(cfg.critic.model.path or roles.model.path, value_head=True,
                         trust_remote_code=trust) if critic_update is not None else None
    from lora import LoraSpec  # imported here (torch, peft): a plan without a model stays instant

    spec = LoraSpec.from_config(roles.model)
    teacher = teacher_topk = None
    if cfg.distillation.enabled:  # the teacher's shapes; its top-k stays in the batch (forward_kl_topk)
        teacher = model_shape(cfg.distillation.teacher_models.teacher_model.model_path, trust_remote_code=trust)
        loss = cfg.distillation.distillation_loss
        teacher_topk = loss.topk if loss.loss_mode == "forward_kl_topk" else None
    return MemoryInputs(
        # with LoRA the reference is the actor with its adapter disabled: no copy of its own
        actor=actor, critic=critic, use_ref=plan.ref_log_prob is not None and spec is None,
        flags=OffloadFlags.from_config(cfg), fsdp=dims.fsdp, infer_tp=dims.infer_tp, compute_bytes=2,
        engine_bytes=2, prompt_len=cfg.data.max_prompt_length, response_len=cfg.data.max_response_length,
        ppo_micro=plan.actor_update.micro_batch_size, log_prob_micro=plan.old_log_prob.micro_batch_size,
        critic_micro=critic_update.micro_batch_size if critic_update else None,
        actor_checkpointing=roles.model.enable_gradient_checkpointing,
        critic_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
        gpu_memory_utilization=roles.rollout.gpu_memory_utilization, gpu_memory_bytes=int(gpu_memory_gb * GIB),
        adapter=adapter_shapes(roles.model.path, spec, trust) if spec else None, sp=dims.sp,
        actor_packed=plan.actor_update.use_remove_padding,
        critic_packed=critic_update is not None and critic_update.use_remove_padding,
        ppo_max_tokens=plan.actor_update.max_token_len, log_prob_max_tokens=plan.old_log_prob.max_token_len,
        critic_max_tokens=critic_update.max_token_len if critic_update else None,
        samples_per_rank=plan.samples_per_rank,
        accumulate_unsharded_grads=_holds_unsharded_grads(plan.actor_update),
        critic_accumulate_unsharded_grads=critic_update is not None and _holds_unsharded_grads(critic_update),
        reward_model=(model_shape(cfg.reward_model.model.path, value_head=True,
                                  trust_remote_code=cfg.reward_model.model.trust_remote_code)
                      if cfg.reward_model.enable else None),
        reward_micro=cfg.reward_model.micro_batch_size_per_gpu or roles.rollout.log_prob_micro_batch_size_per_gpu,
        reward_packed=cfg.reward_model.model.use_remove_padding,
        teacher=teacher, teacher_topk=teacher_topk, split=dims.split,
        pool_ranks=dims.launched - dims.world_size if dims.split else 0,
        images=image_load(cfg, _image_processor(roles.model.path, trust), actor.vision.merge) if actor.vision else None,
        freeze_vision_tower=roles.actor.freeze_vision_tower)


def _image_processor(path: str, trust_remote_code: bool) -> Any:
    """A VLM's image processor (its preprocessor_config.json: patch size, merge size, pixel bounds), from disk."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)


def _holds_unsharded_grads(update: UpdateSpec) -> bool:
    """fsdp_config.accumulate_unsharded_grads matters only when an optimizer step has several micro
    batches (a token budget may always cut several)."""
    return update.accumulate_unsharded_grads and (update.max_token_len is not None
                                                  or update.micro_batch_size < update.mini_batch_size)


def adapter_shapes(path: str, spec: LoraSpec, trust_remote_code: bool = False) -> list[tuple[int, ...]]:
    """The shapes of the LoRA adapter (lora.LoraSpec) that peft puts on the model at `path`, found by
    putting it on the model built on the meta device (exact, no weights read, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return [tuple(p.shape) for p in spec.add_adapter(model).parameters() if p.requires_grad]


def has_config_json(path: str) -> bool:
    """A local directory with config.json, or a hub id whose config.json is in the HF cache."""
    from pathlib import Path

    if Path(path).expanduser().is_dir():
        return (Path(path).expanduser() / "config.json").is_file()
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(path, "config.json"), str)
    except Exception:  # not a valid repo id either
        return False


def check_model_split(cfg: Config, dims: ParallelDims) -> None:
    """The trainer's start-up checks of the actor's heads against the rollout TP and the Ulysses degrees
    (models.py), when its config.json is at hand: what vLLM would refuse minutes into a run."""
    roles = cfg.actor_rollout_ref
    path, trust = roles.model.path, roles.model.trust_remote_code
    if not has_config_json(path):
        return
    from transformers import AutoConfig

    from models import check_sequence_parallel_heads, check_tensor_parallel

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=True)
    check_tensor_parallel(config.get_text_config(), dims.infer_tp, path)  # a VLM's: its language model's heads
    check_sequence_parallel_heads(path, dims.sp, trust, "actor_rollout_ref.model.path")


def memory_report(cfg: Config, dims: ParallelDims, plan: BatchPlan, gpu_memory_gb: float) -> dict[str, Any]:
    """The planner's `memory` section: per FSDP rank and phase, bytes per item, and the verdict.
    {"error": message} when the model's config.json cannot be read."""
    paths = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path}
    if plan.critic_update is not None and cfg.critic.model.path is not None:
        paths["critic.model.path"] = cfg.critic.model.path
    key, path = next(((k, p) for k, p in paths.items() if not has_config_json(p)), next(iter(paths.items())))
    message = (f"no memory plan: cannot read the config.json of {key}={path!r}. Give a "
               f"local model directory, or download the model to the HF cache first (huggingface-cli download "
               f"{path}); the planner reads only config.json and never downloads.")
    if not has_config_json(path):  # say so at once, without importing transformers (seconds)
        return {"error": message}
    try:
        m = memory_inputs(cfg, dims, plan, gpu_memory_gb)
    except (OSError, ValueError) as e:
        return {"error": f"{message} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"}
    ranks = [phase_bytes(m, r) for r in range(m.fsdp)]
    fits, line = verdict(m, ranks[0], plan.actor_update.mini_batch_size)  # FSDP rank 0 holds the largest shards
    pool = rollout_rank_bytes(m) if dims.split else None
    if pool is not None and (pool["engine.kv_cache"] == 0 or sum(pool.values()) > m.gpu_memory_bytes):
        rm = pool.get("reward_model.params", 0) + pool.get("reward_model.forward", 0)
        beside = (f", the reward model ({rm / GIB:.2f} GiB: its shard over the pool's {m.pool_ranks} rank(s) and "
                  f"its forward; reward_model.model.fsdp_config.param_offload=true keeps the shard on the host)"
                  if "reward_model.params" in pool else "")
        fits, line = False, (f"does not fit: a rollout rank's engine weights ({pool['engine.weights'] / GIB:.2f} GiB) "
                             f"and a sync bucket ({pool['sync_bucket'] / GIB:.2f} GiB){beside} beside "
                             f"actor_rollout_ref.rollout.gpu_memory_utilization={m.gpu_memory_utilization} of "
                             f"{m.gpu_memory_bytes / GIB:.2f} GiB (--gpu-memory-gb) leave no KV cache; change "
                             f"gpu_memory_utilization, or raise tensor_model_parallel_size")
    if m.images is not None and m.images.tokens >= m.prompt_len:
        fits, line = False, (f"does not fit: the largest prompt's {m.images.images} image(s) take {m.images.tokens} "
                             f"image tokens, data.max_prompt_length={m.prompt_len} leaves no room for its text; raise "
                             f"data.max_prompt_length, or lower the image processor's max_pixels "
                             f"(preprocessor_config.json)")
    return {"assumes": "CUDA: bf16 compute and engine weights, fp32 master weights, gradients and Adam state",
            "gpu_memory_gb": gpu_memory_gb, "fits": fits, "verdict": line,
            "per_fsdp_rank": ranks,  # rank r of the world is entry r % fsdp_size (the trainers, when split)
            "totals_rank0": {phase: sum(items.values()) for phase, items in ranks[0].items()},
            "rollout_rank": pool,  # a separate pool's rank (None: collocated)
            "vision": vision_report(m, ranks[0]),
            "in_flight": in_flight_memory(cfg, m, dims.rollout_dp, ranks[0]["generate"]["engine.kv_cache"])}


# the host bytes of one carried token (rollout.Trajectory: a Python int id, a float log-prob, an int version,
# each an object plus a list slot)
CARRIED_TOKEN_HOST_BYTES = 3 * (32 + 8)


def in_flight_memory(cfg: Config, m: MemoryInputs, rollout_dp: int, kv_budget: int) -> dict[str, int] | None:
    """trainer.v1.trainer_mode=colocate_async: the sequences one engine holds at once ((1 + num_warmup_batches)
    batches of prompt groups, n samples each), the KV cache they need at full length against the engine's
    (kv_budget), and the host memory of the samples carried between steps (all but a batch's worth, at most
    max_response_length tokens each). None in sync mode."""
    v1 = cfg.trainer.v1
    if v1.trainer_mode != "colocate_async":
        return None
    groups = (1 + v1.colocate_async.num_warmup_batches) * (cfg.data.train_batch_size // rollout_dp)
    sequences = groups * cfg.actor_rollout_ref.rollout.n
    per_token = 2 * m.actor.layers * m.actor.kv_heads * m.actor.head_dim * m.engine_bytes // m.infer_tp
    carried = sequences - (cfg.data.train_batch_size // rollout_dp) * cfg.actor_rollout_ref.rollout.n
    return {"sequences": sequences, "kv_bytes": sequences * (m.prompt_len + m.response_len) * per_token,
            "kv_budget": kv_budget, "carried_samples": carried,
            "carried_host_bytes": carried * m.response_len * CARRIED_TOKEN_HOST_BYTES}


def vision_report(m: MemoryInputs, rank0: dict[str, dict[str, int]]) -> dict[str, Any] | None:
    """A VLM's part of the plan on FSDP rank 0: its tower's shards (gradients and AdamW state unless frozen),
    its activations in an update micro batch, the pixels held, and its image tokens in the engine's KV cache
    (each sequence holds the largest prompt's). None for a text model."""
    v, images = m.actor.vision, m.images
    if v is None or images is None:
        return None
    shard = sum(shard_numel(s, m.fsdp, 0) for s in v.param_shapes) * 4
    patches = _micro_samples(m, m.ppo_micro, m.ppo_max_tokens) * images.patches
    kv_per_token = 2 * m.actor.layers * m.actor.kv_heads * m.actor.head_dim * m.engine_bytes // m.infer_tp
    return {"images": asdict(images), "tower.params": shard, "tower.grads": 0 if m.freeze_vision_tower else shard,
            "tower.optimizer": 0 if m.freeze_vision_tower else 2 * shard + 4 * len(v.param_shapes),
            "tower.activations": 0 if m.freeze_vision_tower else vision_activation_bytes(
                v, patches, m.compute_bytes, m.actor_checkpointing),
            "pixels": rank0["update"]["pixels"], "image_tokens_kv_per_sequence": images.tokens * kv_per_token,
            "image_share_of_prompt": images.tokens / m.prompt_len}


def describe_memory(report: dict[str, Any]) -> str:
    """The memory section as a table (GiB per item and phase, FSDP rank 0: the largest shards)."""
    if "error" in report:
        return f"Memory plan: {report['error']}"
    rank0 = report["per_fsdp_rank"][0]
    items = [i for i in next(iter(rank0.values())) if any(rank0[p][i] for p in PHASES)]
    lines = [f"Memory plan per rank, GiB on the device ({report['assumes']}; FSDP rank 0, the largest shards):",
             f"  {'item':<18}" + "".join(f"{p:>10}" for p in PHASES)]
    for item in items:
        lines.append(f"  {item:<18}" + "".join(f"{rank0[p][item] / GIB:>10.2f}" for p in PHASES))
    lines.append(f"  {'total':<18}" + "".join(f"{report['totals_rank0'][p] / GIB:>10.2f}" for p in PHASES))
    pool = report.get("rollout_rank")
    if pool:  # a separate rollout pool: the table above is a trainer's (no engine), this a rollout rank's
        lines[0] = lines[0].replace("Memory plan per rank", "Memory plan per trainer rank (its engine asleep for good)")
        lines.append("  rollout rank, GiB: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in pool.items())
                     + f"; total {sum(pool.values()) / GIB:.2f}")
    vl = report.get("vision")
    if vl:  # a VLM: what its tower and images take (inside the items above)
        im = vl["images"]
        lines.append(f"  vision: {im['images']} image(s), {im['patches']} patches, {im['tokens']} image tokens in the "
                     f"largest prompt ({vl['image_share_of_prompt']:.0%} of data.max_prompt_length; "
                     f"{im['source']}); the tower's shards {vl['tower.params'] / GIB:.2f} GiB, gradients "
                     f"{vl['tower.grads'] / GIB:.2f}, AdamW {vl['tower.optimizer'] / GIB:.2f}, update activations "
                     f"{vl['tower.activations'] / GIB:.2f}; pixels {vl['pixels'] / GIB:.2f} GiB; image tokens "
                     f"{vl['image_tokens_kv_per_sequence'] / 2**20:.1f} MiB of KV per sequence")
    lines.append(f"  verdict: {report['verdict']}")
    flight = report.get("in_flight")
    if flight:  # colocate_async: what the groups in flight hold
        share = flight["kv_bytes"] / flight["kv_budget"] if flight["kv_budget"] else float("inf")
        lines.append(f"  in flight (colocate_async): {flight['sequences']} sequences per engine need "
                     f"{flight['kv_bytes'] / GIB:.2f} GiB of KV at full length ({share:.0%} of its KV cache"
                     f"{'; beyond it vLLM preempts and recomputes' if share > 1 else ''}); up to "
                     f"{flight['carried_samples']} carried samples hold {flight['carried_host_bytes'] / GIB:.2f} GiB "
                     f"of host memory")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The planner: the layout and batch flow (mesh_utils), then the memory plan


def _memory_gb(text: str) -> float:
    """--gpu-memory-gb: a finite number of GiB > 0 (argparse reports the error as a usage error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be the device's memory in GiB, a number > 0 (e.g. 80)")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = plan_arguments("Explain and validate a config with no GPU and no process group: the device map and "
                        "batch flow (as mesh_utils.py prints them), then the memory per rank and phase. Exits 1 "
                        "with the reason when the config is invalid.",
                        "python memory_plan.py --config configs/gsm8k_grpo_lora_1gpu.yaml --gpu-memory-gb 80")
    ap.add_argument("--gpu-memory-gb", type=_memory_gb, default=80.0,
                    help="device memory per GPU that the memory plan is checked against (default 80)")
    args = ap.parse_args(argv)
    planned = plan_from_args(args)
    if planned is None:
        return 1
    cfg, dims, plan = planned
    try:
        check_model_split(cfg, dims)
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 1
    memory = memory_report(cfg, dims, plan, args.gpu_memory_gb)
    if args.json:
        out = {"dims": asdict(dims), "device_map": asdict(plan_device_map(dims)), "batch": asdict(plan),
               "memory": memory}
        print(json.dumps(out, indent=1))
    else:
        print(describe(cfg, dims, plan))
        print(describe_memory(memory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
