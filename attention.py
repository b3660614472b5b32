"""Attention over packed rows without an N x N mask.

A packed micro batch (models._pack) is one row of several sequences, each with its own position ids
from 0 and no attention mask. transformers' "sdpa" finds the sequences from the position-id restarts
and builds the row's block-diagonal (N, N) boolean mask, and sdpa then computes every query against
every key of the row, most of them masked out: for a row of k sequences of length L that is k times
the attention work of the sequences alone, and N^2 bytes of mask per forward.

"packed_sdpa" runs sdpa once per sequence with is_causal instead (the same numbers: each sequence
attends only to its own past either way). It is plugged in through transformers' attention
registry, like ulysses.py, so no model file changes:

    name = register_packed_attention()                       # in every process, before loading
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

Anything that is not a packed row (a padded batch with its attention mask, a KV-cache decode, a
sliding-window layer) goes to transformers' sdpa unchanged, so the model behaves exactly as "sdpa"
there. The sequence bounds come from the position_ids transformers' decoders (Llama, Qwen2,
Mistral, ...) hand their attention; a packed row reaching an attention without them is an error,
never a silent full-row causal attention.
"""

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


_last_bounds: tuple[torch.Tensor, int, int, list[int]] | None = None  # (position_ids, version, length, bounds)


def _row_bounds(position_ids: torch.Tensor, length: int) -> list[int]:
    """sequence_bounds of the row's last `length` positions, computed once per forward: every layer
    gets the same position_ids tensor, and on an accelerator each computation is a host sync. The
    cache holds the tensor itself, so its memory cannot be reused by another while it is cached."""
    global _last_bounds
    key = (position_ids._version, length)
    if _last_bounds is not None and _last_bounds[0] is position_ids and _last_bounds[1:3] == key:
        return _last_bounds[3]
    bounds = sequence_bounds(position_ids.reshape(-1)[-length:])
    _last_bounds = (position_ids, *key, bounds)
    return bounds


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
    bounds = _row_bounds(position_ids, length)
    if len(bounds) == 2:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    outputs = [
        sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                               dropout=dropout, scaling=scaling, **kwargs)[0]
        for start, end in zip(bounds[:-1], bounds[1:], strict=False)
    ]
    return torch.cat(outputs, dim=1), None


def register_packed_attention() -> str:
    """Register the attention and its mask builder under ATTENTION_NAME; returns the name for
    attn_implementation. The registry is per process: call it on every rank before loading. Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, packed_mask)
    return ATTENTION_NAME
