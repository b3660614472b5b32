"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral): what differs from a dense model.

    if is_moe(actor.config):
        weights = engine_names(actor, iter_full_params(actor))   # checkpoint names the engine loads

transformers 5 holds a MoE layer's experts as two fused 3-D tensors (`mlp.experts.gate_up_proj`
(E, 2I, H), gate rows first, and `mlp.experts.down_proj` (E, H, I)) and renamed some layers (Mixtral's
`block_sparse_moe` is `mlp`). vLLM loads the names of the checkpoints on the hub, which
`save_pretrained` writes through transformers' reverse conversion; the sync sends those names too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


def is_moe(config: Any) -> bool:
    """Does this transformers config describe a mixture-of-experts model (routed experts per layer)?"""
    return (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0) > 0


def engine_names(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for each (HF parameter name, full tensor): the names and layout a
    checkpoint of this model has on disk (transformers' own reverse conversion, one tensor at a time, so
    models.iter_full_params' buckets stream through), e.g. Mixtral's `model.layers.0.mlp.experts.down_proj`
    (E, H, I) becomes E tensors `model.layers.0.block_sparse_moe.experts.{e}.w2.weight` (H, I), views of
    it. Dense models pass through unchanged."""
    if not is_moe(model.config):
        yield from named_tensors
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named_tensors:
        yield from revert_weight_conversion(model, {name: tensor}).items()
