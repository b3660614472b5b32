"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509): the ranks of one `sp` group hold
the same samples and each runs the model on its own 1/sp slice of every sequence.

Everything outside attention (embeddings, MLPs, norms, heads) is per token, so it runs on the slice
unchanged. Attention needs the whole sequence: an all-to-all on the sp group trades the sequence
slice for a slice of the heads (every rank then sees every position for H/sp heads), transformers'
own sdpa attention runs on that, and a second all-to-all trades back. It is plugged in through
transformers' attention registry, so no model file is edited:

    name = register_ulysses_attention()                     # in every process, before loading
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    # batch: input_ids, attention_mask, position_ids (B, T) padded, or (1, total) packed with
    # attention_mask=None and per-sequence position_ids; every rank of sp_group holds the same batch
    log_probs, _ = sequence_parallel_log_probs(model, batch, temperature=1.0, sp_group=sp_group)  # (B, T)
    values = sequence_parallel_values(critic, batch, sp_group=sp_group)                             # (B, T)

Both return the full (B, T) result on every rank of the group. Gradients: when every rank of the
group computes the same loss L from that result (the same samples, the same code), each rank's
parameters get sp x its slice's part of dL/dparams, so the *mean* over the sp group is the unsplit
model's gradient. That is what FSDP's average over a mesh holding the sp ranks computes, so the loss
normalisation needs no sp factor (verl's gather scales the gradient by sp for the same reason).

A model loaded with this attention and run without sp_group behaves exactly as "packed_sdpa"
(attention.py: sdpa, run per sequence on a packed row).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask

import ppo_core as core
from attention import packed_mask, packed_sdpa_attention

ATTENTION_NAME = "ulysses_sdpa"


# ---------------------------------------------------------------------------------------------
# Differentiable collectives on the sp group


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
    """Cut x into sp chunks along scatter_dim, send chunk i to group rank i, and concatenate what
    arrives along gather_dim in group-rank order."""
    sp = dist.get_world_size(group)
    send = torch.stack(x.chunk(sp, dim=scatter_dim)).contiguous()  # (sp, ..., shape/sp along scatter_dim, ...)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The transpose of an all-to-all is the all-to-all the other way: the gradient of what this rank
    sent comes back from the ranks it went to."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1. Backward sums the gradient over the group before taking this rank's
    slice: each rank's loss may read every rank's slice (the sp ranks of a step compute the same loss
    from the gathered tensor), so a slice's gradient is the sum of what every rank's loss sends it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        sp, ctx.rank, ctx.length, ctx.group = dist.get_world_size(group), dist.get_rank(group), x.shape[1], group
        pieces = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # per-token scalars (B, T): small next to the activations
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.length
        return grad[:, start:start + ctx.length].contiguous(), None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, H, T/sp, D) sequence slice of all heads -> (B, H/sp, T, D) all positions of this rank's heads."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, T, H/sp, D) attention output of this rank's heads -> (B, T/sp, H, D) this rank's positions."""
    return _AllToAll.apply(x, 1, 2, group)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, length: int) -> torch.Tensor:
    """(B, T_pad/sp, ...) per-token outputs of this rank's slice -> (B, length, ...) on every rank, the
    divisibility padding removed."""
    return _GatherSequence.apply(x, group)[:, :length]


def gather_rows(batch: dict[str, torch.Tensor], group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Every rank's rows, concatenated in group-rank order, on every rank of the group: how the ranks of
    an sp group, each handed its own samples, come to hold the same ones. Every rank must hold the
    same number of rows."""
    gathered = {}
    for key, tensor in batch.items():
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        gathered[key] = torch.cat(pieces)
    return gathered


# ---------------------------------------------------------------------------------------------
# The attention function


def heads_split(num_heads: int, num_kv_heads: int, ranks: int) -> bool:
    """Whether `ranks` ranks can split attention by heads: the query heads divide by it, and the KV heads
    divide by it or divide it (each then replicated ranks / num_kv_heads times). Ulysses' rule, and
    vLLM's for tensor parallelism."""
    return num_heads % ranks == 0 and (num_kv_heads % ranks == 0 or ranks % num_kv_heads == 0)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Heads are what the group splits: query heads must divide by sp, and KV heads must either divide
    by sp or divide sp (then each is replicated sp / num_kv_heads times)."""
    if not heads_split(num_heads, num_kv_heads, sp):
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} must divide the model's num_attention_heads={num_heads}, "
            f"and num_key_value_heads={num_kv_heads} must be a multiple or a divisor of sp (each sp rank "
            f"computes attention for num_attention_heads / sp heads). Set "
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size (and critic.ulysses_sequence_parallel_size) "
            f"to a divisor of {num_heads}."
        )


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sp_group: ProcessGroup | None = None,
    position_ids: torch.Tensor | None = None,
    packed_position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query (B, H, T/sp, D), key/value (B, KV, T/sp, D):
    this rank's slice of the sequence. Returns (B, T/sp, H, D). With no sp_group (or a group of one)
    this is attention.packed_sdpa_attention. attention_mask must be the full sequence's, or None with
    packed_position_ids, the whole packed row's (see shard_batch)."""
    if sp_group is None or dist.get_world_size(sp_group) == 1:
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     position_ids=position_ids, **kwargs)
    sp = dist.get_world_size(sp_group)
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    check_heads(num_heads, num_kv_heads, sp)
    if num_kv_heads < sp:
        # Fewer KV heads than ranks: give every rank a copy of the KV head its query heads read.
        # Heads are grouped contiguously (query head h reads KV head h // (H / KV)), and so are the
        # replicas, so rank r's query heads and KV replica r line up.
        key, value = repeat_kv(key, sp // num_kv_heads), repeat_kv(value, sp // num_kv_heads)
    query, key, value = (seq_to_heads(x, sp_group) for x in (query, key, value))  # (B, heads/sp, T, D)
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        raise ValueError(
            f"the attention mask covers {attention_mask.shape[-1]} positions but the gathered sequence has "
            f"{key.shape[2]}: under sequence parallelism the model needs the full sequence's 4D mask "
            f"(build the inputs with ulysses.shard_batch)."
        )
    # sdpa_attention_forward reads the query/KV ratio from the module; after the split it is the
    # ratio of the local heads, which replication may have changed, so hand it a stand-in.
    local = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1],
                            is_causal=getattr(module, "is_causal", True), layer_idx=getattr(module, "layer_idx", None))
    if attention_mask is None and packed_position_ids is not None:  # one sdpa per packed sequence
        out, _ = packed_sdpa_attention(local, query, key, value, None, dropout=dropout, scaling=scaling,
                                       position_ids=packed_position_ids, **kwargs)  # (B, T, H/sp, D)
    else:
        out, _ = sdpa_attention_forward(local, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)  # (B, T, H/sp, D)
    return heads_to_seq(out, sp_group), None  # (B, T/sp, H, D)


def register_ulysses_attention() -> str:
    """Register the attention under ATTENTION_NAME (and packed_sdpa's mask builder, so that without sp
    the model masks exactly as "packed_sdpa" does); returns the name for attn_implementation. The
    registry is per process: call it on every rank before loading. Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, packed_mask)
    return ATTENTION_NAME


# ---------------------------------------------------------------------------------------------
# Splitting a batch and running the model on the slice


@dataclass
class ShardedBatch:
    input_ids: torch.Tensor  # (B, T_pad/sp) this rank's slice
    position_ids: torch.Tensor  # (B, T_pad/sp) the full sequence's positions of that slice (rotary)
    attention_mask: torch.Tensor | None  # (B, 1, T_pad, T_pad) bool, or None: causal (per sequence if packed)
    packed_position_ids: torch.Tensor | None  # (1, T_pad) the whole packed row's positions, else None
    labels: torch.Tensor  # (B, T_pad/sp) the next token of each position of the slice
    length: int  # T, before padding to a multiple of sp


def pad_to_multiple(x: torch.Tensor, multiple: int, value: int) -> torch.Tensor:
    """Pad dim 1 on the right to a multiple of `multiple`."""
    return F.pad(x, (0, -x.shape[1] % multiple), value=value)


def shard_sequence(x: torch.Tensor, rank: int, sp: int) -> torch.Tensor:
    """This rank's contiguous slice of dim 1 (whose length sp divides)."""
    return x.chunk(sp, dim=1)[rank].contiguous()


def shard_batch(config: Any, batch: dict[str, torch.Tensor], sp_group: ProcessGroup) -> ShardedBatch:
    """Pad the sequence dim to a multiple of sp, build the full sequence's attention mask, and take
    this rank's slice of input_ids, position_ids and next-token labels.

    batch: input_ids and position_ids (B, T), and attention_mask (B, T), or None / absent for packed
    rows. A packed row (B = 1) keeps no mask: its whole position_ids go to the attention, which runs
    sdpa per sequence where they restart (attention.py). The padding is a run of masked tokens
    (padded layout) or a sequence of its own (packed layout) at the end, which no real token attends
    to because attention is causal.
    """
    sp, rank = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    attention_mask = batch.get("attention_mask")
    batch_size, length = input_ids.shape
    pad = -length % sp
    pad_positions = torch.arange(pad, device=position_ids.device).expand(batch_size, pad)
    position_ids = torch.cat([position_ids, pad_positions], dim=1)  # (B, T_pad)
    if attention_mask is not None:
        attention_mask = pad_to_multiple(attention_mask, sp, 0)  # (B, T_pad)
    # Position t predicts token t + 1; the last position has no next token (label 0, dropped later).
    labels = pad_to_multiple(F.pad(input_ids[:, 1:], (0, 1)), sp, 0)  # (B, T_pad)
    input_ids = pad_to_multiple(input_ids, sp, 0)
    # The mask transformers would build for the whole sequence; the model's own builder only sees
    # the slice. inputs_embeds is read for its batch size, length, dtype and device alone.
    if attention_mask is None and batch_size == 1:
        full_mask, packed_position_ids = None, position_ids
    else:
        shape_only = torch.empty(batch_size, input_ids.shape[1], 0, device=input_ids.device)
        full_mask = create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=attention_mask,
                                       past_key_values=None, position_ids=position_ids)  # (B, 1, T_pad, T_pad) | None
        packed_position_ids = None
    return ShardedBatch(shard_sequence(input_ids, rank, sp), shard_sequence(position_ids, rank, sp), full_mask,
                        packed_position_ids, shard_sequence(labels, rank, sp), length)


def _sliced_forward(model: nn.Module, sharded: ShardedBatch, sp_group: ProcessGroup) -> torch.Tensor:
    """The model's output logits on this rank's slice, (B, T_pad/sp, V or 1)."""
    if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or []):
        raise ValueError("sequence parallelism here supports full-attention layers only; this model has "
                         f"{sorted(set(model.config.layer_types))}.")
    return model(input_ids=sharded.input_ids, position_ids=sharded.position_ids,
                 attention_mask=sharded.attention_mask, use_cache=False, sp_group=sp_group,
                 packed_position_ids=sharded.packed_position_ids).logits


def sequence_parallel_logits(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                             sp_group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor,
                                                              Callable[[torch.Tensor], torch.Tensor]]:
    """This rank's slice of every sequence through the model: its logits / temperature (B, T_pad/sp, V),
    each position's label (the next token, B, T_pad/sp), and `gather`, which takes a per-position result
    of the slice (B, T_pad/sp, ...) to the whole (B, T, ...) on every rank of sp_group (gather_sequence)."""
    sharded = shard_batch(model.config, batch, sp_group)
    logits = _sliced_forward(model, sharded, sp_group).div_(temperature)  # (B, T_pad/sp, V)
    return logits, sharded.labels, functools.partial(gather_sequence, group=sp_group, length=sharded.length)


def sequence_parallel_log_probs(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                                sp_group: ProcessGroup, calc_entropy: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position t, log p(token t+1) under logits / temperature, (B, T) on every rank of sp_group
    (the last position's is meaningless), and the entropies (B, T) if asked, else None. For a padded
    batch of prompts then R responses, the response log-probs are [:, -R-1:-1]. Grad flows if enabled.
    Other heads of the same logits: sequence_parallel_logits (models.compute_log_probs reads them there)."""
    logits, labels, gather = sequence_parallel_logits(model, batch, temperature, sp_group)
    token_log_probs, token_entropy = core.logprobs_and_entropy(logits, labels, calc_entropy)  # (B, T_pad/sp) each
    return gather(token_log_probs), gather(token_entropy) if calc_entropy else None


def sequence_parallel_values(critic: nn.Module, batch: dict[str, torch.Tensor], sp_group: ProcessGroup) -> torch.Tensor:
    """The critic's scalar output at every position, (B, T) on every rank of sp_group; for a padded
    batch of prompts then R responses, V(s_t) of the response tokens is [:, -R-1:-1]."""
    sharded = shard_batch(critic.config, batch, sp_group)
    values = _sliced_forward(critic, sharded, sp_group)[..., 0].float()  # (B, T_pad/sp)
    return gather_sequence(values, sp_group, sharded.length)
