"""FSDP2 model building for the actor (and critic/reference): load, shard, offload, forward helpers.

Free functions taking explicit meshes and dtypes (torchtitan's apply_fsdp style):

    param_dtype, reduce_dtype = default_dtypes(device.type)
    model = load_causal_lm("Qwen/Qwen2.5-0.5B", fsdp_mesh, device=device,
                           param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # batch: input_ids, attention_mask, position_ids (B, P+R) and responses (B, R)
    log_probs = compute_log_probs(model, batch, temperature=1.0, micro_batch_size=8).log_probs  # (B, R)
    for name, tensor in iter_full_params(model): ...   # HF names, full tensors, gathered in buckets

Loading never holds more than one full copy of the weights on a host: every rank builds the model
with its parameters on the meta device (accelerate's init_empty_weights; buffers stay real), shards
it, and only rank 0 reads the checkpoint and broadcasts it tensor by tensor into the shards. Master
weights stay float32; MixedPrecisionPolicy casts for compute.
"""

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Required, TypedDict, Unpack

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate import init_empty_weights
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
)

import ppo_core as core
import ulysses
from attention import register_packed_attention
from collectives import all_gather_single
from config import ConfigError
from moe import RouterReplay, check_cpu_engine_expert_width, mlp_widths, routes_from_rows, routes_to_rows
from vision import dummy_image, is_vision_config, micro_batch_pixels, pad_token_ids, vision_tower

logger = logging.getLogger(__name__)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def default_dtypes(device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) for compute: bf16/fp32 on CUDA, fp32/fp32 on CPU (bf16 is slow there)."""
    if device_type == "cuda":
        return torch.bfloat16, torch.float32
    return torch.float32, torch.float32


# ---------------------------------------------------------------------------------------------
# Building and sharding


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found without model-specific names.

    HF models list their block class in `_no_split_modules` (e.g. "Qwen2DecoderLayer"); models
    that do not declare it are searched for their longest nn.ModuleList of same-typed modules.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if layers:
        return layers
    candidates = [
        list(ml) for ml in model.modules()
        if isinstance(ml, nn.ModuleList) and len(ml) > 0 and len({type(m) for m in ml}) == 1
    ]
    if not candidates:
        raise ValueError(
            f"Cannot find the decoder blocks of {type(model).__name__}: it declares no "
            "`_no_split_modules` and has no nn.ModuleList of same-typed blocks to shard one by one."
        )
    return max(candidates, key=len)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules apply_fsdp shards as units of their own, in order: each decoder block, then the input
    embedding and the LM head when they are two parameters (an untied one, or a model without a head,
    as the critic's scalar head is too small to matter). The root unit keeps the rest (the final norm),
    gathered from its first forward to the end of its backward: a tied embedding stays there, since
    one parameter cannot sit in two units, and it is needed at both ends of the model anyway (the
    embedding's lookup first and the head's matmul last, in forward and again in backward)."""
    units = list(decoder_layers(model))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        return units
    return units + [m for m in (embed, head) if m is not None]


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """fully_shard each unit (fsdp_units: decoder blocks, an untied embedding and LM head), then the
    root. A 2D ('ddp','fsdp') mesh gives HSDP.

    cpu_offload (FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer step on the host for
    the whole run) is for a model that is never moved by hand: the reference model. The actor and
    critic are moved between phases by apply_moves instead; the two mechanisms on one model fight."""
    if fsdp_mesh.ndim not in (1, 2):
        raise ValueError(f"fsdp_mesh must be 1D ('fsdp') or 2D ('ddp','fsdp'); got dims {fsdp_mesh.mesh_dim_names}")
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload and fsdp_mesh.device_type == "cpu":
        _warn_once("fsdp_config.param_offload of a frozen model (reference, reward model) has no effect on CPU: "
                   "parameters already live in host memory.")
    elif cpu_offload:
        offload = CPUOffloadPolicy()
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=fsdp_mesh, mp_policy=mp_policy, offload_policy=offload)
    for unit in fsdp_units(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block in backward. HF's flag keeps parameter names unchanged
    (a checkpoint_wrapper would insert `_checkpoint_wrapped_module.` into every name)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class ShardingOptions(TypedDict, total=False):
    """Keywords of load_causal_lm and load_value_model (defaults in brackets)."""

    device: Required[torch.device]  # where the shards live (unless cpu_offload)
    param_dtype: Required[torch.dtype]  # compute dtype (default_dtypes gives it); master weights stay fp32
    reduce_dtype: Required[torch.dtype]  # gradient reduce-scatter dtype
    reshard_after_forward: bool  # [True] free the gathered parameters after each block's forward
    cpu_offload: bool  # [False] FSDP2's CPUOffloadPolicy, for the reference model only (see apply_fsdp)
    activation_checkpointing: bool  # [False] recompute each decoder block in backward
    # [attention.ATTENTION_NAME] transformers' attention kernel: "packed_sdpa" is sdpa that runs a packed
    # row one sequence at a time (no (N, N) mask); "ulysses_sdpa" adds sequence parallelism
    attn_implementation: str
    trust_remote_code: bool  # [False] allow the checkpoint's own modelling code
    # [None] applied to the model before sharding, and to rank 0's loaded copy before its weights are
    # broadcast (lora.LoraSpec.add_adapter: a peft adapter, its weights loaded or initialised on rank 0)
    wrap: Callable[[nn.Module], nn.Module] | None


def load_causal_lm(name_or_path: str, fsdp_mesh: DeviceMesh, **options: Unpack[ShardingOptions]) -> nn.Module:
    """An FSDP2-sharded causal LM with float32 master weights, from an HF path or hub name.

    Every rank builds the model with its parameters on the meta device (no memory), shards it,
    allocates only its shard, then rank 0 alone reads the checkpoint and broadcasts it tensor by tensor.
    """
    return _load_sharded(AutoModelForCausalLM, name_or_path, fsdp_mesh, **options)


def load_value_model(name_or_path: str, fsdp_mesh: DeviceMesh, **options: Unpack[ShardingOptions]) -> nn.Module:
    """The critic: the same transformer with a scalar head per token (verl's choice,
    AutoModelForTokenClassification with num_labels=1). From a causal-LM checkpoint the body is
    loaded and the head starts at zero, so the first value estimates are 0 rather than noise.
    Loaded and sharded as load_causal_lm does."""
    return _load_sharded(AutoModelForTokenClassification, name_or_path, fsdp_mesh,
                         config_overrides={"num_labels": 1, "classifier_dropout": 0.0}, zero_init_head=True,
                         **options)


def load_reward_model(name_or_path: str, fsdp_mesh: DeviceMesh, **options: Unpack[ShardingOptions]) -> nn.Module:
    """A learned reward model from a sequence-classification checkpoint with one label (its body and its
    `score` head, no bias). Built as the critic is, a scalar per token (AutoModelForTokenClassification,
    as verl's reward worker does), so that one forward serves padded and packed rows alike and the score
    is read at each sequence's last real token (compute_sequence_scores). Every weight must come from the
    checkpoint: a missing head is an error, never a random one."""
    return _load_sharded(AutoModelForTokenClassification, name_or_path, fsdp_mesh,
                         config_overrides={"num_labels": 1, "classifier_dropout": 0.0,
                                           "token_classification_bias": False},
                         require_all_weights="reward_model.model.path", **options)


def load_frozen_model(load: Callable[..., nn.Module], name_or_path: str, fsdp_mesh: DeviceMesh, *,
                      param_offload: bool, **options: Unpack[ShardingOptions]) -> nn.Module:
    """A model that is only ever run forward (the reference model, the reward model, a teacher): `load`
    (load_causal_lm, load_reward_model, ...) with FSDP2's CPUOffloadPolicy when param_offload, so its
    shards live on the host and stream to the device one block at a time inside its own forward; no
    gradients, eval mode. apply_moves never touches it (memory_plan counts it as `<name>.params`)."""
    model = load(name_or_path, fsdp_mesh, cpu_offload=param_offload, **options)
    model.requires_grad_(False)
    return model.eval()


def _load_sharded(
    auto_cls: type,
    name_or_path: str,
    fsdp_mesh: DeviceMesh,
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    config_overrides: dict | None = None,
    zero_init_head: bool = False,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    require_all_weights: str | None = None,
) -> nn.Module:
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # Set after loading: from_pretrained drops keyword arguments its config class does not declare
    # (transformers 5 ignores classifier_dropout=0.0 there, leaving the critic head's dropout at 0.1).
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if auto_cls is AutoModelForCausalLM and is_vision_config(config):
        auto_cls = AutoModelForImageTextToText  # a VLM: its vision tower, projector and language model
    model = build_sharded(auto_cls, config, fsdp_mesh, device=device, param_dtype=param_dtype,
                          reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
                          cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                          attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, wrap=wrap)
    _load_weights_from_rank0(model, auto_cls, name_or_path, config, trust_remote_code, zero_init_head, wrap,
                             require_all_weights)
    _check_tied_embeddings(model)
    return model


def build_sharded(auto_cls: type, config: Any, fsdp_mesh: DeviceMesh, *, device: torch.device,
                  param_dtype: torch.dtype, reduce_dtype: torch.dtype, reshard_after_forward: bool = True,
                  cpu_offload: bool = False, activation_checkpointing: bool = False,
                  attn_implementation: str | None = None, trust_remote_code: bool = False,
                  wrap: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The FSDP2-sharded model of `config` (an HF config) as load_causal_lm builds it, before any weight
    is read: float32 shards allocated on `device` but uninitialised, buffers as the constructor made them.
    load_causal_lm fills the shards from the checkpoint; bench/memory_rehearsal.py fills them at random."""
    # Parameters on the meta device; buffers real, as the constructor computes them: it is the only
    # source of the non-persistent ones (rotary inv_freq, ...), which no checkpoint holds.
    attention: str | dict[str, str] = attn_implementation or register_packed_attention()
    if is_vision_config(config):  # the language model packs; the vision tower runs plain sdpa over its patches
        attention = {"text_config": attention, "vision_config": "sdpa", "": "sdpa"}
    with init_empty_weights(include_buffers=False):
        model = auto_cls.from_config(config, dtype=torch.float32, attn_implementation=attention,
                                     trust_remote_code=trust_remote_code)
    model.tie_weights()  # init_empty_weights re-creates every parameter it moves, which unties them
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if wrap is not None:
        model = wrap(model)
    apply_fsdp(model, fsdp_mesh, param_dtype, reduce_dtype, reshard_after_forward, cpu_offload)
    # to_empty allocates the parameter shards, and re-allocates the buffers uninitialised: put back
    # the constructor's values (persistent buffers are then loaded again from the checkpoint).
    buffers = dict(model.named_buffers(remove_duplicate=False))
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        buffer.copy_(buffers[name])
    return model


def _load_weights_from_rank0(
    model: nn.Module, auto_cls: type, name_or_path: str, config: object, trust_remote_code: bool,
    zero_init_head: bool, wrap: Callable[[nn.Module], nn.Module] | None = None,
    require_all_weights: str | None = None,
) -> None:
    """Fill the sharded (empty) model's parameters from the checkpoint that only rank 0 reads (broadcast to
    the others), or, when the model's mesh is part of the world (a split job's trainers: torch broadcasts over
    the whole world), that every rank of the mesh reads. require_all_weights (the config key of the path): a
    parameter the checkpoint lacks is an error, on every rank."""
    full_state: dict[str, torch.Tensor] = {}
    missing: list[list[str]] = [[]]
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    every_rank_reads = mesh is not None and mesh.mesh.numel() < dist.get_world_size()
    if dist.get_rank() == 0 or every_rank_reads:
        source, info = auto_cls.from_pretrained(
            name_or_path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code,
            output_loading_info=True)
        missing = [sorted(info["missing_keys"])]
        if require_all_weights is not None and missing[0] == ["score.bias"]:
            # transformers without `token_classification_bias` (before 5.13) gives the head a bias that a
            # sequence-classification checkpoint lacks: zero is exactly the head it saved
            source.score.bias.data.zero_()
            missing = [[]]
    if require_all_weights is not None and not every_rank_reads:
        dist.broadcast_object_list(missing, src=0)
        if missing[0]:
            raise ConfigError(
                f"{require_all_weights}={name_or_path!r} lacks {', '.join(missing[0][:4])}: it is not a "
                f"sequence-classification checkpoint with one label and no head bias (save one with "
                f"AutoModelForSequenceClassification(..., num_labels=1).save_pretrained).")
    if dist.get_rank() == 0 or every_rank_reads:
        if zero_init_head:
            head = getattr(source, "score", None) or getattr(source, "classifier", None)
            if head is None:
                raise RuntimeError(f"{type(source).__name__} has no output head to zero-initialise.")
            for p in head.parameters():
                p.data.zero_()
        if wrap is not None:
            source = wrap(source)
        full_state = source.state_dict()
        del source
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=not every_rank_reads)
    set_model_state_dict(model, full_state, options=options)


def _check_tied_embeddings(model: nn.Module) -> None:
    """Tied input/output embeddings must remain one parameter after sharding and to_empty."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is not None and out_emb.weight is not in_emb.weight:
        raise RuntimeError(
            f"{type(model).__name__} has tie_word_embeddings=True but its input and output embeddings "
            "are two parameters after FSDP sharding; updates would diverge."
        )


# ---------------------------------------------------------------------------------------------
# Memory phases: param_offload / optimizer_offload around the rollout
#
# offload.plan_moves says what moves between two phases of a step; apply_moves does it. On the
# CPU every move is a no-op (everything already lives in host memory), but the plan is the same.


def apply_moves(moves: Sequence[tuple[str, str]], models: Mapping[str, nn.Module | None],
                optimizers: Mapping[str, torch.optim.Optimizer | None], device: torch.device,
                sleep_engine: Callable[[], object] | None = None) -> None:
    """Carry out offload.plan_moves' list: ("actor.params", "host") offloads the actor's shards,
    ("critic.optimizer", "device") loads the critic's Adam state, ("engine.kv_cache", "freed") puts
    the engine to sleep (`sleep_engine`); the engine's way back ("device") is rollout.sync_weights'
    own wake-up, so it is not done here. Entries for a model that is not built (None) are skipped."""
    for item, where in moves:
        owner, part = item.split(".")
        if owner == "engine":
            if part == "kv_cache" and where == "freed" and sleep_engine is not None:
                sleep_engine()
            continue
        if part == "params" and models.get(owner) is not None:
            model = models[owner]
            if where == "host":
                offload_fsdp_model_to_cpu(model)
            else:
                load_fsdp_model_to_device(model, device)
        elif part == "optimizer" and optimizers.get(owner) is not None:
            _move_optimizer_state(optimizers[owner], torch.device("cpu") if where == "host" else device,
                                  f"{owner}.fsdp_config.optimizer_offload")
        elif part not in ("params", "optimizer"):
            raise ValueError(f"apply_moves: cannot move {item!r} (only <model>.params / <model>.optimizer "
                             "and engine.kv_cache are moved)")


def _is_on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


@torch.no_grad()
def offload_fsdp_model_to_cpu(model: nn.Module) -> None:
    """Move the parameter shards to host memory to free the accelerator for the rollout."""
    if _is_on_cpu(model):
        _warn_once("fsdp_config.param_offload: parameters already live in host memory (CPU run or already "
                   "offloaded); nothing to move.")
        return
    model.to("cpu")
    torch.accelerator.empty_cache()


@torch.no_grad()
def load_fsdp_model_to_device(model: nn.Module, device: torch.device) -> None:
    """Bring the parameter shards back to `device` for training."""
    if device.type == "cpu":
        _warn_once("fsdp_config.param_offload: running on CPU; nothing to load.")
        return
    model.to(device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device, key: str) -> None:
    tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    if all(t.device.type == "cpu" for t in tensors) and device.type == "cpu":
        _warn_once(f"{key}: optimizer state already lives in host memory; nothing to move.")
        return
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value):
                state[name] = value.to(device, non_blocking=True)
    if device.type == "cpu":
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()


# ---------------------------------------------------------------------------------------------
# Forward helpers


_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")  # (B, P+R); a VLM's position_ids (B, 4, P+R)
_PIXEL_KEYS = ("pixel_values", "image_grid_thw")  # a VLM's rows' images (vision.pixel_rows)


def _response_len(batch: Mapping[str, torch.Tensor]) -> int:
    """R, once the batch is known to hold what a forward needs."""
    missing = [key for key in _FORWARD_KEYS if key not in batch]
    if missing:
        raise KeyError(f"the batch needs {list(_FORWARD_KEYS)} to run a forward; it has no {missing} "
                       f"(keys: {sorted(batch)})")
    return batch["responses"].shape[1]


def token_budget_micro_batches(attention_mask: torch.Tensor, max_token_len: int,
                               dp_group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Row indices of each micro batch cut by token count (verl's use_dynamic_bsz): none holds more
    than max_token_len valid tokens, their counts are balanced (ppo_core.token_budget_partitions).

    Collective over dp_group (the ranks that hold distinct samples and train together; None: every rank)
    when torch.distributed is initialised: each of them gets the same number of micro batches, because each
    micro batch's forward all-gathers the FSDP shards, and a rank with one more would wait forever for the
    others (the ranks of an sp group hold the same samples, so they cut alike).
    """
    seq_lens = attention_mask.sum(-1).tolist()  # (B,) valid tokens per sample
    num_parts = 1
    while True:
        parts = core.token_budget_partitions(seq_lens, max_token_len, num_parts)
        if not dist.is_initialized():
            break
        counts = torch.tensor([len(parts), -len(parts)], device=attention_mask.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=dp_group)  # (most, -fewest) over the ranks
        if counts[0] == -counts[1]:
            break
        num_parts = int(counts[0])  # grows each round, and never past this rank's samples
    return [torch.tensor(p, dtype=torch.long, device=attention_mask.device) for p in parts]


def _micro_batches(batch: Mapping[str, torch.Tensor], micro_batch_size: int, max_token_len: int | None,
                   dp_group: dist.ProcessGroup | None = None) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(rows, model inputs) of each micro batch: runs of micro_batch_size rows, or token-budget micro
    batches when max_token_len is set (agreed over dp_group)."""
    num_rows = batch["input_ids"].shape[0]
    device = batch["input_ids"].device
    if max_token_len is None:
        row_groups = [torch.arange(s, min(s + micro_batch_size, num_rows), device=device)
                      for s in range(0, num_rows, micro_batch_size)]
    else:
        row_groups = token_budget_micro_batches(batch["attention_mask"], max_token_len, dp_group)
    keys = [key for key in (*_SEQUENCE_KEYS, *_PIXEL_KEYS) if key in batch]
    for rows in row_groups:
        yield rows, {key: batch[key][rows] for key in keys}


def _in_batch_order(pieces: list[torch.Tensor], row_groups: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch results and put their rows back in the batch's order."""
    rows = torch.cat(row_groups)
    out = torch.cat(pieces)
    if bool((rows == torch.arange(len(rows), device=rows.device)).all()):
        return out
    return out[torch.argsort(rows)]  # indexing keeps the graph, for callers with grad enabled


def _pack(inputs: Mapping[str, torch.Tensor], response_len: int) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                           torch.Tensor]:
    """The micro batch's valid tokens in one row (verl's use_remove_padding), each sequence with its
    own position ids from 0. With no attention mask, transformers reads the restarts in position_ids
    as sequence boundaries: sdpa gets a block-diagonal causal mask, flash attention its varlen kernel,
    so attention never crosses sequences.

    Returns the model inputs (1, N), the packed index of the position that predicts each real response
    token (K,), and which response positions are real (b, R).
    """
    valid = inputs["attention_mask"].bool()  # (b, P+R): left-padded prompts, right-padded responses
    packed_index = valid.flatten().cumsum(0).view(valid.shape) - 1  # (b, P+R): place in the packed row
    response_valid = valid[:, -response_len:]  # (b, R)
    # response token j sits at column P+j and is predicted from column P+j-1 (the last prompt token for j=0)
    predictors = packed_index[:, -response_len - 1:-1][response_valid]  # (K,)
    positions = inputs["position_ids"]
    if positions.dim() == 3:  # a VLM's (b, 4, P+R) -> (4, 1, N): the text row restarts at each sequence
        packed_positions = positions.transpose(0, 1)[:, valid][:, None]
    else:
        packed_positions = positions[valid][None]  # (1, N)
    model_inputs = {"input_ids": inputs["input_ids"][valid][None], "position_ids": packed_positions,
                    **_pixel_inputs(inputs)}
    return model_inputs, predictors, response_valid


def _pixel_inputs(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A VLM micro batch's pixel_values and image_grid_thw, its rows' images in row order ({} for none)."""
    if "image_grid_thw" not in inputs:
        return {}
    return micro_batch_pixels(inputs["pixel_values"], inputs["image_grid_thw"])


def _trim(inputs: Mapping[str, torch.Tensor], response_len: int) -> tuple[dict[str, torch.Tensor], int]:
    """The padded micro batch without its all-padding columns: those left of its longest prompt (prompts
    are left-padded to P) and right of its longest response (R). The forward then runs over the micro
    batch's longest sample rather than P+R; position ids are explicit and padding is masked, so every
    real token's output is the same. Returns the inputs and the response columns kept, r <= R."""
    first, end = _trimmed_columns(inputs["attention_mask"], response_len)
    prompt_len = inputs["attention_mask"].shape[1] - response_len
    trimmed = {key: inputs[key][..., first:end] for key in _SEQUENCE_KEYS}
    if trimmed["position_ids"].dim() == 3:  # a VLM's (b, 4, r) -> (4, b, r), as transformers takes them
        trimmed["position_ids"] = trimmed["position_ids"].transpose(0, 1)
    return {**trimmed, **_pixel_inputs(inputs)}, end - prompt_len


def _trimmed_columns(attention_mask: torch.Tensor, response_len: int) -> tuple[int, int]:
    """(first, end): the columns _trim keeps, from the micro batch's longest prompt to its longest response."""
    columns = attention_mask.bool().any(0).tolist()  # (P+R,) one host sync
    prompt_len = len(columns) - response_len
    first = next((i for i, c in enumerate(columns[:prompt_len]) if c), prompt_len - 1)
    kept = max((j + 1 for j, c in enumerate(columns[prompt_len:]) if c), default=1)
    first = min(first, prompt_len - 1)  # the last prompt column predicts the first response token
    return first, prompt_len + kept


def _forward_positions(attention_mask: torch.Tensor, response_len: int, packed: bool) -> torch.Tensor:
    """(b, P+R) bool: the positions of a micro batch its forward runs, in the forward's row-major order:
    the real tokens packed (_pack); the trimmed columns padded (_trim), padding inside them included."""
    if packed:
        return attention_mask.bool()
    first, end = _trimmed_columns(attention_mask, response_len)
    ran = torch.zeros_like(attention_mask, dtype=torch.bool)
    ran[:, first:end] = True
    return ran


def _unpack(values: torch.Tensor, response_valid: torch.Tensor) -> torch.Tensor:
    """(K, ...) per real response token -> (b, R, ...), zero on the padding."""
    out = values.new_zeros((*response_valid.shape, *values.shape[1:]))
    mask = response_valid.view(*response_valid.shape, *(1,) * (values.dim() - 1)).expand_as(out)
    return out.masked_scatter(mask, values)


@dataclass(frozen=True)
class ForwardOut:
    """compute_log_probs' outputs, in the batch's row order; each output not asked for is None."""

    log_probs: torch.Tensor  # (B, R) of the response tokens under logits / temperature
    entropy: torch.Tensor | None = None  # (B, R) calc_entropy
    truncated: torch.Tensor | None = None  # (B, R) truncation: under the engine's top-k / top-p cut, no grad
    topk_values: torch.Tensor | None = None  # (B, R, k) topk: each position's k largest log-probs
    topk_ids: torch.Tensor | None = None  # (B, R, k) topk: their token ids
    gathered: torch.Tensor | None = None  # (B, R, k) topk_ids: the log-probs at those ids
    sum_pi_squared: torch.Tensor | None = None  # (B, R) calc_sum_pi_squared: sum_v pi(v)^2
    routed_experts: torch.Tensor | None = None  # (B, P+R, layers, k) int16 a recording router_replay's routes


@dataclass(frozen=True)
class _Layout:
    """One micro batch's forward as the heads read it: the logits (..., V) / temperature and the label of
    each of their positions, and the ways between those positions and the micro batch's response rows."""

    logits: torch.Tensor  # (K, V) packed; (b, r+1, V) padded; (1, N/sp, V) this rank's Ulysses slice
    labels: torch.Tensor  # (K,) / (b, r+1) / (1, N/sp)
    to_rows: Callable[[torch.Tensor], torch.Tensor]  # a per-position result (..., [k]) -> (b, R, [k])
    predicting: Callable[[torch.Tensor], torch.Tensor]  # the positions that predict a response token
    from_rows: Callable[[torch.Tensor], torch.Tensor]  # (b, R, k) per response token -> per predicting position


def _packed_layout(model: nn.Module, inputs: Mapping[str, torch.Tensor], response_len: int,
                   temperature: float) -> _Layout:
    model_inputs, predictors, response_valid = _pack(inputs, response_len)
    out = model(**model_inputs, use_cache=False, logits_to_keep=predictors)
    # in place as below, on the output itself: in place on its row (a view) would make autograd's
    # way back hold four logits-sized tensors instead of two
    logits = out.logits.div_(temperature)[0]  # (K, V)
    labels = inputs["input_ids"][:, -response_len:][response_valid]  # (K,)
    return _Layout(logits, labels, functools.partial(_unpack, response_valid=response_valid), lambda x: x,
                   lambda x: x[response_valid])


def _padded_layout(model: nn.Module, inputs: Mapping[str, torch.Tensor], response_len: int,
                   temperature: float) -> _Layout:
    inputs, kept = _trim(inputs, response_len)  # (b, <= P+R): the micro batch's longest sample
    out = model(**inputs, use_cache=False, logits_to_keep=kept + 1)
    # In place and in the model's dtype (bf16 on GPU), as verl does: a copy, let alone a float32
    # one, would double the largest tensor of the forward.
    logits = out.logits.div_(temperature)  # (b, r+1, V)
    # Position t predicts token t+1: the last prompt token predicts the first response token, and
    # the final position predicts past the end. That position goes through the maths with label 0
    # and is dropped after: slicing it off first would copy the logits to make them contiguous.
    labels = F.pad(inputs["input_ids"][:, -kept:], (0, 1))  # (b, r+1)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # (b, r, ...) -> (b, R, ...), 0 in the trimmed columns
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, response_len - kept))

    return _Layout(logits, labels, to_rows, lambda x: x[:, :-1], lambda x: x[:, :kept])


def _sequence_parallel_layout(model: nn.Module, inputs: Mapping[str, torch.Tensor], response_len: int,
                              temperature: float, sp_group: dist.ProcessGroup) -> _Layout:
    model_inputs, predictors, response_valid = _pack(inputs, response_len)
    logits, labels, gather = ulysses.sequence_parallel_logits(model, model_inputs, temperature, sp_group)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # (1, N/sp) of this rank's slice -> (b, R) on every rank
        return _unpack(gather(x)[0, predictors], response_valid)

    return _Layout(logits, labels, to_rows, lambda x: x, lambda x: x[response_valid])


def _heads(layout: _Layout, calc_entropy: bool, truncation: tuple[int, float] | None,
           topk: tuple[int, int | None] | None, topk_ids: torch.Tensor | None,
           calc_sum_pi_squared: bool) -> dict[str, torch.Tensor]:
    """The requested outputs of one micro batch, each in its rows (b, R[, k]): ForwardOut's fields."""
    logits, labels, to_rows, predicting = layout.logits, layout.labels, layout.to_rows, layout.predicting
    log_probs, entropy = core.logprobs_and_entropy(logits, labels, calc_entropy)  # per position each
    out = {"log_probs": to_rows(predicting(log_probs))}
    if calc_entropy:
        out["entropy"] = to_rows(predicting(entropy))
    if truncation is not None:
        out["truncated"] = to_rows(predicting(core.truncated_log_probs(logits, labels, *truncation)))
    if topk is not None:
        values, ids = core.topk_log_probs(predicting(logits), *topk)  # (positions, k) each
        out["topk_values"], out["topk_ids"] = to_rows(values), to_rows(ids)
    if topk_ids is not None:
        out["gathered"] = to_rows(core.gather_log_probs(predicting(logits), layout.from_rows(topk_ids)))
    if calc_sum_pi_squared:
        out["sum_pi_squared"] = to_rows(predicting(core.sum_pi_squared_from_logits(logits)))
    return out


def compute_log_probs(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    temperature: float,
    micro_batch_size: int,
    calc_entropy: bool = False,
    *,
    max_token_len: int | None = None,
    use_remove_padding: bool = False,
    sp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    truncation: tuple[int, float] | None = None,
    calc_sum_pi_squared: bool = False,
    topk: tuple[int, int | None] | None = None,
    topk_ids: torch.Tensor | None = None,
    router_replay: RouterReplay | None = None,
    routed_experts: torch.Tensor | None = None,
) -> ForwardOut:
    """Log-probs (B, R) of the response tokens under logits / temperature, and what else is asked for,
    from the same forward (ForwardOut): their entropies; with truncation=(top_k, top_p) the log-probs
    under the engine's sampling distribution, the top-k / top-p cut of the same logits
    (ppo_core.truncated_log_probs); with topk=(k, vocab_limit) the k largest log-probs of each position
    and their ids (ppo_core.topk_log_probs; a teacher's, for on-policy distillation); with topk_ids
    (B, R, k) the log-probs at those ids (the student's side of that loss, with grad); neither top-k with
    sp_group; with calc_sum_pi_squared sum_v pi(v)^2 (ppo_core.sum_pi_squared_from_logits). Grad flows
    if the caller has it enabled.

    batch holds "input_ids", "attention_mask", "position_ids" (each (B, P+R): prompts, then responses)
    and "responses" (B, R), which gives R. Micro batches are runs of micro_batch_size rows, or cut by
    token count when max_token_len is set (token_budget_micro_batches; collective over dp_group). With
    use_remove_padding each micro batch's valid tokens run packed in one row (_pack), and positions
    past a response's end come back as 0; padded, each micro batch runs over its longest sample (_trim),
    and they hold the model's output there up to its longest response, 0 after. Either way only
    the positions that predict response tokens go through the LM head (`logits_to_keep`), and
    ppo_core.logprobs_and_entropy upcasts one chunk of rows at a time, so no forward holds the (tokens,
    vocab) logits in float32 at once, and under grad the backward keeps only the logits in their own
    dtype (the entropy costs nothing there unless a loss uses it). The cut log-probs carry no gradient.

    With sp_group (Ulysses; packed only, and every rank of the group must hold the same batch), each rank
    runs 1/sp of every packed row (ulysses.py) and gets every sample's result back: then all positions
    of its slice go through the LM head, not only the response's.

    A MoE's routes (actor.router_replay, R2): with router_replay (moe.RouterReplay, its hooks on `model`) in
    "record", ForwardOut.routed_experts holds each row's experts (B, P+R, layers, k), -1 where no forward
    ran the position; in "replay", routed_experts (B, P+R, layers, k), recorded so in any layout or cut,
    are forced on the same rows' tokens (moe.routes_from_rows), whatever this call's layout and cut.

    A vision-language model's batch also holds its rows' images, pixel_values (B, patches, D) and
    image_grid_thw (B, images, 3) (vision.pixel_rows), and position_ids (B, 4, P+R), each sample's computed
    once (vision.sample_positions); each micro batch takes its rows' images in row order, and one without an
    image runs a zero-weighted dummy image through the tower (_dummy_image_without_images).
    A VLM's image and video pad ids, which its engine never samples (vision.pad_token_ids), get probability 0
    in every output, as in the engine's distribution.
    """
    response_len = _response_len(batch)
    _check_sp_packed(sp_group, use_remove_padding)
    _check_vision_inputs(model, batch)
    banned_token_ids = pad_token_ids(model.config) if vision_tower(model) is not None else ()
    if sp_group is not None and (topk is not None or topk_ids is not None):
        raise NotImplementedError("compute_log_probs: top-k log-probs under Ulysses (config refuses forward_kl_topk "
                                  "with ulysses_sequence_parallel_size > 1)")
    if router_replay is not None and sp_group is not None:
        raise NotImplementedError("compute_log_probs: router replay under Ulysses (config refuses router_replay.mode "
                                  "R2 with ulysses_sequence_parallel_size > 1)")
    if router_replay is not None and (router_replay.mode == "replay") != (routed_experts is not None):
        raise ValueError("compute_log_probs: routed_experts go with a replaying router_replay, and only with it")
    pieces: dict[str, list[torch.Tensor]] = {}
    row_groups = []
    for rows, inputs in _micro_batches(batch, micro_batch_size, max_token_len, dp_group):
        ran = None if router_replay is None else _forward_positions(inputs["attention_mask"], response_len,
                                                                    use_remove_padding)  # (b, P+R)
        if routed_experts is not None:  # the recorded experts of this forward's tokens, in its order
            router_replay.force(routes_from_rows(routed_experts[rows], ran))
        with _dummy_image_without_images(model, inputs):
            if sp_group is not None:
                layout = _sequence_parallel_layout(model, inputs, response_len, temperature, sp_group)
            elif use_remove_padding:
                layout = _packed_layout(model, inputs, response_len, temperature)
            else:
                layout = _padded_layout(model, inputs, response_len, temperature)
        if banned_token_ids:  # never sampled: the engine's distribution has them at probability 0
            layout.logits[..., list(banned_token_ids)] = torch.finfo(layout.logits.dtype).min
        heads = _heads(layout, calc_entropy, truncation, topk, None if topk_ids is None else topk_ids[rows],
                       calc_sum_pi_squared)
        if router_replay is not None and router_replay.mode == "record":
            heads["routed_experts"] = routes_to_rows(router_replay.routes, ran)
        for name, value in heads.items():
            pieces.setdefault(name, []).append(value)
        layout = None  # released now: held, the logits would sit beside the next micro batch's whole forward
        row_groups.append(rows)
    return ForwardOut(**{name: _in_batch_order(parts, row_groups) for name, parts in pieces.items()})


def _check_vision_inputs(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
    """A VLM's batch holds (B, 4, P+R) positions (vision.sample_positions) and its rows' pixels: with 1-D or
    3-row positions its forward is silently wrong (image tokens at text positions; packed rows attending
    across samples), and without pixels its image tokens embed as text."""
    if vision_tower(model) is None:
        return
    positions = batch["position_ids"]
    if positions.dim() != 3 or positions.shape[1] != 4:
        raise ValueError(f"a vision-language model's position_ids must be (B, 4, P+R) (the text row, then the 3 "
                         f"mrope rows: vision.sample_positions), not {tuple(positions.shape)}")
    missing = [key for key in _PIXEL_KEYS if key not in batch]
    if missing:
        raise ValueError(f"a vision-language model's batch needs {list(_PIXEL_KEYS)} (vision.pixel_rows); it has no "
                         f"{missing}")


@contextlib.contextmanager
def _dummy_image_without_images(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """A VLM micro batch without an image still runs its vision tower, on a zero image whose output enters the
    embeddings times 0 (verl's dummy image): each tower block is an FSDP unit, so a rank that skipped the tower
    would all-gather the next unit while the others gather the tower's, a collective mismatch (a hang on
    GPUs, an abort with gloo), and its backward would miss the tower's reduce-scatters. The tower runs inside
    the root module's forward (a pre-hook on the language model), where the root unit's parameters (the patch
    embedding, the merger) are gathered."""
    tower = vision_tower(model)
    if tower is None or _pixel_inputs(inputs):
        yield
        return
    cfg = model.config.vision_config
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    merge = cfg.spatial_merge_size
    dummy = dummy_image(patch_dim, merge, inputs["input_ids"].device)

    def add_zero_image(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        embeds = kwargs["inputs_embeds"]  # (b, L, H)
        out = tower(dummy["pixel_values"].to(embeds.dtype), grid_thw=dummy["image_grid_thw"])
        kwargs["inputs_embeds"] = embeds + 0.0 * out.pooler_output.mean()
        return args, kwargs

    handle = model.model.language_model.register_forward_pre_hook(add_zero_image, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def compute_values(critic: nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int, *,
                   max_token_len: int | None = None, use_remove_padding: bool = False,
                   sp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """V(s_t) for each response token (B, R): the critic's output at the position that predicts that
    token (the last prompt token for the first response token). batch, micro batches, packing,
    sp_group and dp_group as for compute_log_probs. Grad flows if enabled."""
    response_len = _response_len(batch)
    _check_sp_packed(sp_group, use_remove_padding)
    values, row_groups = [], []
    for rows, inputs in _micro_batches(batch, micro_batch_size, max_token_len, dp_group):
        if sp_group is not None:
            model_inputs, predictors, response_valid = _pack(inputs, response_len)
            token_values = ulysses.sequence_parallel_values(critic, model_inputs, sp_group)  # (1, N) on every rank
            values.append(_unpack(token_values[0, predictors], response_valid))  # (b, R)
        elif use_remove_padding:
            model_inputs, predictors, response_valid = _pack(inputs, response_len)
            out = critic(**model_inputs, use_cache=False)  # (1, N, 1): one number per token, no need to trim
            values.append(_unpack(out.logits[0, predictors, 0].float(), response_valid))  # (b, R)
        else:
            inputs, kept = _trim(inputs, response_len)  # (b, <= P+R): the micro batch's longest sample
            out = critic(**inputs, use_cache=False)
            values.append(F.pad(out.logits[:, -kept - 1:-1, 0].float(), (0, response_len - kept)))  # (b, R)
        row_groups.append(rows)
    return _in_batch_order(values, row_groups)


def compute_sequence_scores(model: nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int, *,
                            use_remove_padding: bool = False) -> torch.Tensor:
    """A reward model's score per sequence (B,), float32: its output at the sequence's last real token (the
    last 1 of its attention mask, where verl's reward worker reads it). batch: input_ids, attention_mask,
    position_ids (B, T), padded on either side; runs of micro_batch_size rows, each packed into one row of
    its valid tokens with use_remove_padding (_pack's layout), else padded. No grad."""
    scores = []
    with torch.no_grad():
        for _, inputs in _micro_batches(batch, micro_batch_size, None):
            valid = inputs["attention_mask"].bool()  # (b, T)
            if not bool(valid.any(-1).all()):
                raise ValueError("compute_sequence_scores: a row has no real token (its attention_mask is all 0)")
            if use_remove_padding:
                out = model(input_ids=inputs["input_ids"][valid][None], position_ids=inputs["position_ids"][valid][None],
                            use_cache=False)  # (1, N, 1)
                last = valid.sum(-1).cumsum(0) - 1  # (b,) each sequence's last token in the packed row
                scores.append(out.logits[0, last, 0].float())  # (b,)
            else:
                out = model(**inputs, use_cache=False)  # (b, T, 1)
                last = valid.shape[1] - 1 - valid.flip(-1).int().argmax(-1)  # (b,) the last 1 of each row
                scores.append(out.logits[torch.arange(len(last), device=last.device), last, 0].float())  # (b,)
    return torch.cat(scores)


def _check_sp_packed(sp_group: dist.ProcessGroup | None, use_remove_padding: bool) -> None:
    if sp_group is not None and not use_remove_padding:
        raise ValueError("sequence parallelism (sp_group) runs on packed micro batches: pass use_remove_padding=True "
                         "(config: actor_rollout_ref.model.use_remove_padding / critic.model.use_remove_padding).")


def padding_fraction(attention_mask: torch.Tensor, use_remove_padding: bool) -> float:
    """The fraction of the tokens a training forward processes that are padding. Padded, every row
    runs at the length of the longest sample of its micro batch (_trim); counted here with the whole
    batch as one micro batch, 1 - valid / (B x that length), an upper bound when micro batches are
    smaller; packed (use_remove_padding), only valid tokens run: 0."""
    if use_remove_padding:
        return 0.0
    return 1.0 - attention_mask.sum().item() / (attention_mask.shape[0] * trimmed_width(attention_mask))


def trimmed_width(attention_mask: torch.Tensor) -> int:
    """The columns a padded forward of these rows runs over (_trim): first to last real column."""
    span = attention_mask.bool().any(0).nonzero()
    return int(span.max() - span.min()) + 1 if len(span) else attention_mask.shape[1]


# Buckets of at most this many bytes are gathered in one collective. Per-parameter gathers pay a fixed
# cost each (~1 ms with gloo, which dominates small models); much larger buckets stop paying off, and
# on the CPU, allocations over glibc's 32 MiB mmap ceiling are fresh page-faulted memory every time.
GATHER_BUCKET_BYTES = 16 * 2**20


def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None,
                     bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, full tensor) for every parameter, in named_parameters order,
    all-gathering the shards a bucket of parameters (<= bucket_bytes, or one larger parameter) at a
    time, so at most one bucket of full tensors exists beyond the shards and what the consumer holds.
    A collective: every rank of the FSDP mesh must consume the iterator in step.

    A tied parameter comes under each of its names (model.embed_tokens.weight and lm_head.weight),
    as in an HF state dict, gathered again for the second name rather than held: vLLM 0.32's
    layerwise reload_weights unties the engine's lm_head while reloading, and an lm_head that
    receives no tensor keeps its old weights.

    Each shard is cast to `dtype` before the gather, not after: with fp32 master weights and a
    bf16 engine that moves half the bytes (bench/bench_sync.py measures both orders).
    """
    named = ((name, param.detach()) for name, param in model.named_parameters(remove_duplicate=False))
    yield from gather_full_tensors(named, dtype, bucket_bytes)


def gather_full_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                        bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_full_params' bucketed gather, for any stream of (name, DTensor shard or plain tensor) pairs
    in the same order on every rank (lora.iter_sync_params feeds it merged shards). A collective."""
    bucket: list[tuple[str, DTensor]] = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, DTensor):
            yield from _gather_bucket(bucket)
            bucket = []
            yield name, tensor if dtype is None else tensor.to(dtype)
            continue
        mesh_device = tensor.device_mesh.device_type
        if tensor.device.type != mesh_device:  # shards offloaded to CPU gather on the mesh device
            tensor = tensor.to(mesh_device)
        if dtype is not None:
            tensor = tensor.to(dtype)  # elementwise on the local shard: same values, fewer bytes to gather
        if bucket and not _same_bucket(bucket[0][1], tensor, bucket_bytes, [t for _, t in bucket]):
            yield from _gather_bucket(bucket)
            bucket = []
        bucket.append((name, tensor))
    yield from _gather_bucket(bucket)




def _row_sharded_dim(tensor: DTensor) -> int | None:
    """The mesh dim a DTensor is sharded over when its layout is FSDP's (dim-0 shards on one mesh
    dim, replicated on any other, i.e. FSDP or HSDP); None for any other layout."""
    shard_dims = [i for i, p in enumerate(tensor.placements) if p.is_shard(0)]
    others_replicated = all(p.is_replicate() for i, p in enumerate(tensor.placements) if i not in shard_dims)
    return shard_dims[0] if len(shard_dims) == 1 and others_replicated and tensor.ndim > 0 else None


def _same_bucket(first: DTensor, tensor: DTensor, bucket_bytes: int, bucket: list[DTensor]) -> bool:
    """Can `tensor` join the bucket that starts with `first`: one flat buffer, one collective."""
    dim = _row_sharded_dim(tensor)
    size = sum(t.numel() * t.element_size() for t in [*bucket, tensor])
    return (dim is not None and dim == _row_sharded_dim(first) and tensor.device_mesh == first.device_mesh
            and tensor.dtype == first.dtype and size <= bucket_bytes)


def _gather_bucket(bucket: list[tuple[str, DTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """All-gather a bucket's dim-0 shards in one collective and cut out each full tensor.

    Shards follow torch.chunk along dim 0 (DTensor's Shard(0), which FSDP2 uses): every rank holds
    ceil(rows / world) rows except the last non-empty ones, which hold fewer or none. Each rank's
    shards are packed into equal slots padded to that size, so after the gather rank k's rows of a
    parameter sit at the start of its slot and the padding only ever follows the last real row.
    """
    if not bucket:
        return
    first = bucket[0][1]
    mesh_dim = _row_sharded_dim(first)
    if mesh_dim is None:  # not FSDP's layout (only ever one tensor per bucket then): DTensor's own gather
        [(name, tensor)] = bucket
        yield name, tensor.full_tensor()
        return
    world = first.device_mesh.size(mesh_dim)
    if world == 1:  # a one-rank FSDP group: the shards are the full tensors, nothing to move
        yield from ((name, tensor.to_local()) for name, tensor in bucket)
        return
    rows = [-(-t.shape[0] // world) for _, t in bucket]  # ceil: rows per rank's slot
    slot = [r * (t.numel() // t.shape[0] if t.shape[0] else 0) for r, (_, t) in zip(rows, bucket, strict=True)]
    local = torch.empty(sum(slot), dtype=first.dtype, device=first.to_local().device)  # padding stays unset
    offset = 0
    for n, (_, t) in zip(slot, bucket, strict=True):
        shard = t.to_local().reshape(-1)
        local[offset:offset + shard.numel()].copy_(shard)
        offset += n
    gathered = torch.empty(world * sum(slot), dtype=local.dtype, device=local.device)  # flat: gloo wants 1D
    all_gather_single(gathered, local, group=first.device_mesh.get_group(mesh_dim))
    gathered = gathered.view(world, sum(slot))  # (world, slots)
    offset = 0
    for r, n, (name, t) in zip(rows, slot, bucket, strict=True):
        # contiguous: with one row per rank the reshape is a strided view, and loaders may .view() it
        full = gathered[:, offset:offset + n].reshape(world * r, *t.shape[1:])[:t.shape[0]].contiguous()
        offset += n
        yield name, full


# ---------------------------------------------------------------------------------------------
# Optimizer: AdamW with verl's lr schedule, and a step that skips non-finite gradients


def lr_lambda(optim_cfg: Mapping[str, Any], total_steps: int) -> Callable[[int], float]:
    """verl's schedule, as a factor of optim.lr for optimizer step `step` (0-based): linear warmup from
    0 over lr_warmup_steps (<= 0: lr_warmup_steps_ratio x the schedule's length), then constant, or a
    half cosine down to min_lr_ratio (lr_scheduler_type; warmup_style, verl's older name, wins when
    set). The length is optim.total_training_steps when > 0, else the run's `total_steps`."""
    length = optim_cfg["total_training_steps"] if optim_cfg["total_training_steps"] > 0 else total_steps
    warmup = optim_cfg["lr_warmup_steps"]
    if warmup <= 0:
        warmup = int(optim_cfg["lr_warmup_steps_ratio"] * length)
    kind = optim_cfg["warmup_style"] or optim_cfg["lr_scheduler_type"]
    floor = optim_cfg["min_lr_ratio"]

    def fn(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, length - warmup)
        return max(floor, math.cos(math.pi * progress) * (1 - floor) * 0.5 + (1 + floor) * 0.5)

    return fn


def set_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                         optim_cfg: Mapping[str, Any]) -> list[str]:
    """After a resume: the config's lr (the schedule's base), weight decay and betas over the checkpoint's,
    the schedule's position kept. Returns what changed, one 'name: old -> new' each."""
    changed = []
    for i, group in enumerate(optimizer.param_groups):
        for name, new in (("weight_decay", optim_cfg["weight_decay"]), ("betas", tuple(optim_cfg["betas"]))):
            old = tuple(group[name]) if name == "betas" else group[name]
            if old != new:
                changed.append(f"{name}: {old} -> {new}")
                group[name] = new
        if scheduler.base_lrs[i] != optim_cfg["lr"]:
            changed.append(f"lr: {scheduler.base_lrs[i]} -> {optim_cfg['lr']}")
            scheduler.base_lrs[i] = group["initial_lr"] = optim_cfg["lr"]
            group["lr"] = optim_cfg["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
    return list(dict.fromkeys(changed))


def freeze_vision_tower(model: nn.Module) -> int:
    """actor.freeze_vision_tower: the VLM's vision tower (its patch embedding, blocks and merger) takes no
    gradient and, left out of make_optimizer, holds no optimizer state; the language model trains. Returns
    how many tensors were frozen. The tower still runs forward on every micro batch (the dummy image)."""
    tower = vision_tower(model)
    if tower is None:
        raise ConfigError(f"actor_rollout_ref.actor.freeze_vision_tower=true, but {type(model).__name__} has no "
                          f"vision tower (not a vision-language model); set it to false.")
    tower.requires_grad_(False)
    return sum(1 for _ in tower.parameters())


def make_optimizer(model: nn.Module, optim_cfg: Mapping[str, Any],
                   total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable (sharded) parameters and its lr schedule, from an `optim` config
    section. Frozen ones (the base weights under a LoRA adapter) get no optimizer state."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=optim_cfg["lr"], betas=tuple(optim_cfg["betas"]),
                                  weight_decay=optim_cfg["weight_decay"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, prefix: str,
                   metrics: dict[str, float]) -> bool:
    """Clip and step; a non-finite gradient skips the step (counted in <prefix>/skipped_steps).
    Every rank sees the same total norm, so all ranks skip together."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    ok = bool(torch.isfinite(grad_norm))
    if ok:
        optimizer.step()
    else:
        print(f"[rank {dist.get_rank()}] warning: non-finite {prefix} grad norm {grad_norm.item()}; "
              f"skipping this update", flush=True)
        metrics[f"{prefix}/skipped_steps"] = metrics.get(f"{prefix}/skipped_steps", 0) + 1
    optimizer.zero_grad(set_to_none=True)
    metrics[f"{prefix}/grad_norm"] = grad_norm.item() if ok else float("nan")
    return ok


# vLLM 0.32's CPU attention backend supports these head sizes only (CPUAttentionBackend.
# get_supported_head_sizes; its kernels are specialised per size).
CPU_ENGINE_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def read_model_config(path: str, key: str, trust_remote_code: bool) -> Any:
    """The transformers config of the model the config key `key` names, or one ConfigError line saying why it
    cannot be read (before anything loads: a missing path fails here, not in a traceback minutes later)."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # a missing path, no config.json, an unknown architecture, no network
        raise ConfigError(
            f"{key}={path!r}: cannot read the model's config ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Give a local directory with config.json and weights, "
            f"or a hub id that is downloaded already (this program does not fetch at run time)."
        ) from None


def check_model(path: str, needed_length: int, trust_remote_code: bool, device_type: str, infer_tp: int = 1) -> None:
    """Before anything loads: the model's config can be read, prompt + response fit its context, vLLM can
    split it over infer_tp ranks, and (on the CPU) vLLM's CPU engine can run its attention and sync its
    experts. Each failure
    is one ConfigError line."""
    config = read_model_config(path, "actor_rollout_ref.model.path", trust_remote_code)
    if is_vision_config(config):  # a VLM: its language model's sizes (train_ppo.load_data checks the run's keys)
        config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and needed_length > limit:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {needed_length} tokens exceeds the model's "
            f"max_position_embeddings={limit} ({path}); lower one of them so their sum is <= {limit}."
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None:
        check_tensor_parallel(config, infer_tp, path)
    if device_type == "cpu":
        check_cpu_engine_expert_width(config, infer_tp, path)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if device_type == "cpu" and head_dim is not None and head_dim not in CPU_ENGINE_HEAD_SIZES:
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} has attention heads of size {head_dim}; vLLM's CPU engine "
            f"runs head sizes {', '.join(map(str, CPU_ENGINE_HEAD_SIZES))} only. Use such a model on the CPU "
            f"(e.g. hidden_size / num_attention_heads = 32), or a GPU."
        )


def check_teacher(path: str, tokenizer: Any, student_vocab_rows: int, trust_remote_code: bool) -> int:
    """Before anything loads: distillation's teacher at `path` reads the student's token ids as the student
    does. Its tokenizer must map every token to the same id as `tokenizer` (the actor's); its embedding may
    have more rows (padding past the tokenizer), never fewer than the student's `student_vocab_rows`, or a
    sampled id would have no teacher log-prob. Returns len(tokenizer): the ids a teacher's top-k may name
    (its padding rows are never a target). Each failure is one ConfigError naming both sizes."""
    from transformers import AutoTokenizer

    key = "distillation.teacher_models.teacher_model.model_path"
    config = read_model_config(path, key, trust_remote_code)
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # no tokenizer files
        raise ConfigError(f"{key}={path!r}: cannot read the teacher's tokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}). Give a local model directory with one.") from None
    mine, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
        raise ConfigError(
            f"{key}={path!r} has a different tokenizer: {len(teacher_tokenizer)} tokens against the actor's "
            f"{len(tokenizer)}, and {len(differ)} tokens differ in id (e.g. {differ[0]!r}: teacher "
            f"{theirs.get(differ[0])}, actor {mine.get(differ[0])}). Distillation compares the two models' "
            f"log-probs of the same token ids: use a teacher of the actor's family (the same tokenizer).")
    if config.vocab_size < student_vocab_rows:
        raise ConfigError(
            f"{key}={path!r} has vocab_size={config.vocab_size} embedding rows, fewer than the actor's "
            f"{student_vocab_rows}: the student could sample an id the teacher cannot score. Use a teacher whose "
            f"embedding holds at least the actor's rows (padding past the {len(tokenizer)} tokens is fine).")
    return len(tokenizer)


def check_tensor_parallel(config: Any, tp: int, path: str) -> None:
    """What vLLM refuses (or asserts on) when it shards the model over `tp` ranks, minutes into a run:
    query heads that tp does not divide, KV heads that neither divide tp nor divide by it, an MLP width
    that tp does not divide. The error lists the TP degrees that work."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = mlp_widths(config)  # a MoE's expert width (and shared expert's), not the dense intermediate_size

    def fits(t: int) -> bool:
        return ulysses.heads_split(heads, kv_heads, t) and all(w % t == 0 for w in widths.values())

    if not fits(tp):
        valid = [t for t in range(1, 65) if fits(t)]
        shown = " and ".join(f"{k}={w}" for k, w in widths.items()) or "no MLP width"
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} cannot shard {path!r} in vLLM: it splits "
            f"num_attention_heads={heads}, num_key_value_heads={kv_heads} (a multiple or a divisor of TP) and "
            f"{shown} over the TP ranks. Valid values up to 64: {', '.join(map(str, valid))}.")


def check_sequence_parallel_heads(path: str, sp: int, trust_remote_code: bool, key: str) -> None:
    """Ulysses splits attention heads over the sp ranks: refuse, before anything loads, a model whose head
    counts sp cannot split (ulysses.check_heads), naming the model's key."""
    if sp == 1:
        return
    config = read_model_config(path, key, trust_remote_code)
    heads = config.num_attention_heads
    try:
        ulysses.check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, sp)
    except ValueError as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
