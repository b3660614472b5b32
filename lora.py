"""LoRA with `peft`: the actor as a frozen base model plus a small trainable adapter.

    spec = LoraSpec.from_config(cfg.actor_rollout_ref.model)     # None when lora_rank=0 and no adapter path
    actor = models.load_causal_lm(path, fsdp_mesh, wrap=spec.add_adapter, ...)   # FSDP2 as before
    with actor.disable_adapter():                                # the reference model: the base weights
        ref_log_probs = models.compute_log_probs(actor, batch, ...).log_probs
    modules = sync_modules(actor, rollout.packed_modules(llm))
    rollout.sync_weights(llm, iter_sync_params(actor, dtype))             # first sync: every weight
    rollout.sync_weights(llm, iter_sync_params(actor, dtype, modules))    # then only what LoRA changes

The adapter goes onto the model while its weights are still on the meta device (before FSDP shards
it), and onto rank 0's loaded copy, whose state, adapter included, is then broadcast into the
shards as for a full model (models._load_weights_from_rank0). Every rank therefore starts from the
same adapter: rank 0's initialisation (B = 0, so the model is the base model) or the one read from
actor_rollout_ref.model.lora_adapter_path.

The engine is sent merged weights, W + scale * B @ A, for the LoRA target modules and the modules vLLM
fuses with them (q/k/v into qkv_proj: its layer reloads only once all its parts arrive), computed on
each rank's rows of W and B (FSDP shards both along the output dim alike), so only merged rows are
gathered. Weights the adapter does not touch are sent once, at the first sync.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from config import ConfigError
from models import gather_full_tensors
from moe import is_moe

ADAPTER = "default"  # peft's name for the one adapter
_PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's names


@dataclass(frozen=True)
class LoraSpec:
    """The adapter to put on the actor (verl's keys under actor_rollout_ref.model)."""

    rank: int  # lora_rank
    alpha: float  # lora_alpha: the update is (alpha / rank) * B @ A
    target_modules: str | tuple[str, ...]  # "all-linear" or module names ("q_proj", ...)
    adapter_path: str | None  # lora_adapter_path: start from this saved adapter (its own r/alpha/targets)
    base_model: str  # the base model's path or hub id, recorded in the adapter's config

    @classmethod
    def from_config(cls, model_cfg: Mapping[str, Any]) -> LoraSpec | None:
        """None when LoRA is off (lora_rank=0 and no lora_adapter_path). Reads every LoRA key."""
        rank, alpha = model_cfg["lora_rank"], model_cfg["lora_alpha"]
        targets, adapter_path, path = model_cfg["target_modules"], model_cfg["lora_adapter_path"], model_cfg["path"]
        if rank < 0:
            raise ConfigError(f"actor_rollout_ref.model.lora_rank={rank}: use 0 (LoRA off) or a rank >= 1, e.g. 32.")
        if rank == 0 and adapter_path is None:
            return None
        if not targets or (isinstance(targets, str) and targets != "all-linear"):
            raise ConfigError(f"actor_rollout_ref.model.target_modules={targets!r}: give 'all-linear' or a list of "
                              "module names, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj].")
        if adapter_path is not None:
            from peft import LoraConfig

            try:
                saved = LoraConfig.from_pretrained(adapter_path)
            except Exception as e:  # missing directory, no adapter_config.json
                raise ConfigError(f"actor_rollout_ref.model.lora_adapter_path={adapter_path!r}: cannot read a peft "
                                  f"LoRA adapter there ({type(e).__name__}); give a directory with "
                                  "adapter_config.json (export_hf.py --adapter-only writes one).") from None
            if rank not in (0, saved.r):
                raise ConfigError(f"actor_rollout_ref.model.lora_rank={rank} but the adapter at lora_adapter_path "
                                  f"has rank {saved.r}; set lora_rank=0 (take the adapter's) or {saved.r}.")
            rank, alpha = saved.r, saved.lora_alpha
            targets = saved.target_modules if isinstance(saved.target_modules, str) else sorted(saved.target_modules)
        if alpha <= 0:
            raise ConfigError(f"actor_rollout_ref.model.lora_alpha={alpha}: must be > 0 (verl's examples use "
                              "alpha = rank, e.g. lora_alpha=32 with lora_rank=32).")
        base = os.path.abspath(path) if os.path.isdir(path) else path
        return cls(rank, float(alpha), targets if isinstance(targets, str) else tuple(targets), adapter_path, base)

    def lora_config(self) -> Any:
        """peft's LoraConfig for this spec, or the saved adapter's, with no dropout: the PPO ratio compares
        log-probs of the update's forward with those of the no-grad forward, which must agree."""
        from peft import LoraConfig

        if self.adapter_path is not None:
            saved = LoraConfig.from_pretrained(self.adapter_path)
            saved.lora_dropout, saved.inference_mode = 0.0, False
            return saved
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")

    def add_adapter(self, model: nn.Module) -> nn.Module:
        """`model` (real or on the meta device) as a peft model whose only trainable parameters are
        the adapter's. With adapter_path the adapter's weights are read from it (the meta model's
        stay on the meta device: they are filled by the broadcast from rank 0)."""
        from peft import PeftModel, get_peft_model
        from peft.tuners.lora import Linear as LoraLinear

        if is_moe(model.config):
            raise ConfigError(
                f"actor_rollout_ref.model.lora_rank={self.rank}: LoRA on a mixture-of-experts model "
                f"({type(model).__name__}) is not supported: its routed experts are fused 3-D tensors, which "
                "LoRA's linear layers do not cover, and the sync of merged weights is not tested on MoE. Train "
                "the full model (lora_rank=0), or use a dense model for LoRA.")
        on_meta = any(p.is_meta for p in model.parameters())
        head = model.get_output_embeddings()
        if self.adapter_path is not None and not on_meta:
            peft_model = PeftModel.from_pretrained(model, self.adapter_path, config=self.lora_config(),
                                                   is_trainable=True)
        else:
            peft_model = get_peft_model(model, self.lora_config())
        peft_model.peft_config[ADAPTER].base_model_name_or_path = self.base_model  # export_hf.py reads it
        layers = [(n, type(m).__name__) for n, m in lora_layers(peft_model).items()
                  if not isinstance(m, LoraLinear) or m.base_layer is head]
        if layers:
            raise ConfigError(f"actor_rollout_ref.model.target_modules: LoRA is supported on the blocks' linear "
                              f"layers only (not embeddings or the LM head); {layers[:3]} are not. List linear "
                              "modules (q_proj, ...) or use all-linear.")
        if not lora_layers(peft_model):
            raise ConfigError(f"actor_rollout_ref.model.target_modules={self.target_modules}: no module of "
                              f"{type(model).__name__} matched; name its linear layers, e.g. [q_proj, v_proj].")
        return peft_model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers of `model`, by their HF module names (model.layers.0.self_attn.q_proj)."""
    from peft.tuners.lora import LoraLayer

    return {hf_name(name): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def hf_name(peft_name: str) -> str:
    """A peft model's parameter or module name -> the base model's (the checkpoint's, the engine's)."""
    return peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")


def is_lora(model: nn.Module) -> bool:
    """Does the model carry a peft adapter."""
    return hasattr(model, "peft_config")


def sync_modules(model: nn.Module, packed_modules: Mapping[str, Sequence[str]]) -> set[str]:
    """The HF modules every sync after the first must send: LoRA's targets, and the modules the engine
    fuses with any of them (packed_modules: {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), as
    a fused layer whose parts do not all arrive is rebuilt from uninitialised memory."""
    modules = set(lora_layers(model))
    all_modules = {hf_name(name) for name, _ in model.named_modules()}
    for name in list(modules):
        parent, _, leaf = name.rpartition(".")
        for parts in packed_modules.values():
            if leaf in parts:
                modules.update(f"{parent}.{part}" for part in parts if f"{parent}.{part}" in all_modules)
    return modules


def _merged_shard(weight: torch.Tensor, lora_b: torch.Tensor, lora_a_full: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """This rank's rows of W + scale * B @ A, with W's layout. W (out, in) and B (out, r) are sharded
    alike along the output dim (FSDP's Shard(0) of the same length on the same mesh); A (r, in) is whole."""
    if not isinstance(weight, DTensor):
        return weight + scale * lora_b @ lora_a_full
    if weight.placements != lora_b.placements or weight.device_mesh != lora_b.device_mesh:
        raise RuntimeError(f"LoRA merge: W's layout {weight.placements} differs from B's {lora_b.placements}")
    local = weight.to_local() + scale * lora_b.to_local() @ lora_a_full.to(weight.to_local().device)  # (rows, in)
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


@torch.no_grad()
def iter_sync_params(model: nn.Module, dtype: torch.dtype | None = None,
                     modules: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for the engine, like models.iter_full_params, with every LoRA layer's weight
    merged (W + scale * B @ A, in the master weights' precision, then cast to `dtype`) and the adapter's
    own tensors left out. `modules`: only the parameters of these HF modules (sync_modules); None: all.
    A collective: every rank of the FSDP mesh must consume it in step."""
    layers = lora_layers(model)
    # A (r, in) of every layer, gathered whole: small (rank x the layers' input widths)
    lora_a = dict(gather_full_tensors((name, m.lora_A[ADAPTER].weight.detach()) for name, m in layers.items()))

    def merged_shards() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters(remove_duplicate=False):
            if ".lora_A." in name or ".lora_B." in name:
                continue
            name = hf_name(name)
            module, _, leaf = name.rpartition(".")
            if modules is not None and module not in modules:
                continue
            tensor = param.detach()
            if module in layers and leaf == "weight":
                layer = layers[module]
                tensor = _merged_shard(tensor, layer.lora_B[ADAPTER].weight.detach(), lora_a[module],
                                       layer.scaling[ADAPTER])
            yield name, tensor

    yield from gather_full_tensors(merged_shards(), dtype)


def lora_config(model: nn.Module) -> list[Any]:
    """[the adapter's peft config] for a LoRA model, [] otherwise: what a checkpoint's hf/ directory
    holds beside the model config (adapter_config.json, naming the base model), for export_hf.py."""
    return [model.peft_config[ADAPTER]] if is_lora(model) else []
