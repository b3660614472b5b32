"""Attention over packed rows without an N x N mask.

A packed micro batch (models._pack) is one row of several sequences, each with its own position ids
from 0 and no attention mask. transformers' "sdpa" finds the sequences from the position-id restarts
and builds the row's block-diagonal (N, N) boolean mask, and sdpa then computes every query against
every key of the row, most of them masked out: for a row of k sequences of length L that is k times
the attention work of the sequences alone, and N^2 bytes of mask per forward.

"packed_sdpa" keeps each sequence to itself without a mask: it cuts the row at the position-id
restarts and runs sdpa with is_causal on each sequence (up to PER_SEQUENCE_MAX of them) or, for
rows of more, right-pads the sequences into small batches of similar lengths (a bucket holds the
sequences longer than half its longest) and runs sdpa on each batch. Right padding
needs no mask under a causal attention (a real token never sees a later pad), the pads' outputs are
dropped, and the numbers are those of each sequence run alone. One sdpa call per bucket (a handful
per layer), not one per sequence, keeps the attention batched like a padded batch's. It is plugged
in through transformers' attention registry, like ulysses.py, so no model file changes:

    name = register_packed_attention()                       # in every process, before loading
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

Anything that is not a packed row (a padded batch with its attention mask, a KV-cache decode, a
sliding-window layer) goes to transformers' sdpa unchanged, so the model behaves exactly as "sdpa"
there. The sequence bounds come from the position_ids transformers' decoders (Llama, Qwen2,
Mistral, ...) hand their attention; a packed row reaching an attention without them is an error,
never a silent full-row causal attention.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "packed_sdpa"


def sequence_bounds(position_ids: torch.Tensor) -> list[int]:
    """position_ids (N,) of one packed row -> [0, s1, ..., N]: where each sequence starts (a position
    that does not follow its predecessor by one, transformers' rule for packed rows) and the end."""
    restarts = torch.nonzero(position_ids[1:] - position_ids[:-1] != 1).flatten() + 1
    return [0, *restarts.tolist(), position_ids.numel()]


# Up to this many sequences in a row, sdpa runs once per sequence on slices of the row: the buckets'
# gather and index copies cost more than their fewer calls save (CPU, 30m Qwen2: 7% slower forward +
# backward at 4 and 8 sequences, 6% faster at 32).
PER_SEQUENCE_MAX = 8


@dataclass
class RowPlan:
    """How packed_sdpa batches one row of N positions: per bucket, the row positions gathered into its
    (n, width) right-padded batch (pads repeat their sequence's last position), and `take`, where each
    row position's output sits in the buckets' flattened outputs, concatenated."""

    buckets: list[tuple[torch.Tensor, int, int]]  # (gather index (n * width,), n, width)
    take: torch.Tensor  # (N,)
    bounds: list[int]  # sequence_bounds of the row


def plan_row(bounds: list[int], device: torch.device) -> RowPlan:
    """Sequences sorted by length, longest first; a bucket takes them while they are longer than half
    its first (so padding at most doubles a bucket's tokens)."""
    starts, lengths = bounds[:-1], [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    take = [0] * bounds[-1]
    buckets, offset, first = [], 0, 0
    while first < len(order):
        width = lengths[order[first]]
        last = first
        while last + 1 < len(order) and 2 * lengths[order[last + 1]] > width:
            last += 1
        gather = []
        for slot, i in enumerate(order[first:last + 1]):
            start, length = starts[i], lengths[i]
            gather += [start + min(j, length - 1) for j in range(width)]
            for j in range(length):
                take[start + j] = offset + slot * width + j
        n = last - first + 1
        buckets.append((torch.tensor(gather, device=device), n, width))
        offset += n * width
        first = last + 1
    return RowPlan(buckets, torch.tensor(take, device=device), bounds)


_last_plan: tuple[torch.Tensor, int, int, RowPlan] | None = None  # (position_ids, version, length, plan)


def _row_plan(position_ids: torch.Tensor, length: int, device: torch.device) -> RowPlan | None:
    """plan_row of the row's last `length` positions (None for a single sequence), computed once per
    forward: every layer gets the same position_ids tensor, and on an accelerator each computation is
    a host sync. The cache holds the tensor itself, so its memory cannot be reused by another while it
    is cached."""
    global _last_plan
    key = (position_ids._version, length)
    if _last_plan is not None and _last_plan[0] is position_ids and _last_plan[1:3] == key:
        return _last_plan[3]
    bounds = sequence_bounds(position_ids.reshape(-1)[-length:])
    if len(bounds) == 2:
        plan = None
    elif len(bounds) - 1 <= PER_SEQUENCE_MAX:  # run per sequence: no buckets to build
        plan = RowPlan([], torch.empty(0, dtype=torch.long, device=device), bounds)
    else:
        plan = plan_row(bounds, device)
    _last_plan = (position_ids, *key, plan)
    return plan


def packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """The mask builder registered with the attention: no mask for a row without an attention mask,
    cache offset or sliding window (the attention splits it by position ids), else sdpa's own."""
    plain = (kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
             and kwargs.get("batch_size") == 1 and kwargs.get("q_length") == kwargs.get("kv_length")
             and not kwargs.get("q_offset") and not kwargs.get("kv_offset"))
    return None if plain else sdpa_mask(**kwargs)


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, T, D), key/value (B, KV, T', D) ->
    ((B, T, H, D), None). A single row with no mask and T == T' runs sdpa per sequence of the row."""
    batch, _, length, _ = query.shape
    if attention_mask is not None or batch != 1 or key.shape[2] != length or length == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    if position_ids is None:
        raise ValueError(
            f"{type(module).__name__} calls attention '{ATTENTION_NAME}' without position_ids, so a packed row's "
            f"sequences cannot be told apart. Load this architecture with attn_implementation='sdpa' instead."
        )
    plan = _row_plan(position_ids, length, query.device)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    if not plan.buckets:  # a row of few sequences (_row_plan): sdpa on each one's slice
        bounds = plan.bounds
        outputs = [
            sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                                   dropout=dropout, scaling=scaling, **kwargs)[0]
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(outputs, dim=1), None  # (1, N, heads, D)
    outputs = []
    for gather, n, width in plan.buckets:
        # (1, heads, N, D) -> (n, heads, width, D): the bucket's sequences, right-padded
        q, k, v = (x[0][:, gather].unflatten(1, (n, width)).transpose(0, 1) for x in (query, key, value))
        out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)
        outputs.append(out.flatten(0, 1))  # (n * width, heads, D)
    return torch.cat(outputs).index_select(0, plan.take)[None], None  # (1, N, heads, D)


def register_packed_attention() -> str:
    """Register the attention and its mask builder under ATTENTION_NAME; returns the name for
    attn_implementation. The registry is per process: call it on every rank before loading. Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, packed_mask)
    return ATTENTION_NAME
