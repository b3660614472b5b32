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

from config import ConfigError


def is_moe(config: Any) -> bool:
    """Does this transformers config describe a mixture-of-experts model (routed experts per layer)?"""
    return (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0) > 0


def mlp_widths(config: Any) -> dict[str, int]:
    """The MLP widths vLLM shards over tensor-parallel ranks, by config key: a dense model's
    intermediate_size; a MoE's expert width (moe_intermediate_size; Mixtral's intermediate_size), its shared
    expert's (Qwen2-MoE) and the dense MLP's of any layer without experts (mlp_only_layers, decoder_sparse_step)."""
    dense = {"intermediate_size": config.intermediate_size} if hasattr(config, "intermediate_size") else {}
    if not is_moe(config):
        return dense
    if not hasattr(config, "moe_intermediate_size"):  # Mixtral: intermediate_size is each expert's width
        return dense
    widths = {"moe_intermediate_size": config.moe_intermediate_size}
    if getattr(config, "shared_expert_intermediate_size", 0):
        widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) > 1:
        widths.update(dense)
    return widths


def expert_width(config: Any) -> int | None:
    """Each routed expert's MLP width (moe_intermediate_size; Mixtral's intermediate_size); None if dense."""
    if not is_moe(config):
        return None
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


# vLLM's CPU engine pads an expert width per TP rank up to a multiple of this when it loads the model; its
# reload (the weight sync) then fails on the padded tensors (docs/moe.md)
CPU_ENGINE_EXPERT_ALIGN = 32


def check_cpu_engine_expert_width(config: Any, tp: int, path: str) -> None:
    """Refuse, before anything loads, a MoE whose expert width per TP rank vLLM's CPU engine would pad."""
    width = expert_width(config)
    if width is None or (width % tp == 0 and (width // tp) % CPU_ENGINE_EXPERT_ALIGN == 0):
        return
    valid = [t for t in range(1, 65) if width % t == 0 and (width // t) % CPU_ENGINE_EXPERT_ALIGN == 0]
    raise ConfigError(
        f"actor_rollout_ref.model.path={path!r} has experts {width} wide, {width / tp:g} per rank at "
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: vLLM's CPU engine pads an expert width per "
        f"rank that is not a multiple of {CPU_ENGINE_EXPERT_ALIGN} when it loads the model, and its weight sync "
        f"(reload_weights) then fails on the padded tensors. Use a TP where it is (valid here: "
        f"{', '.join(map(str, valid)) or 'none'}), a model whose expert width is, or a GPU.")


def active_mlp_width(config: Any) -> int:
    """The MLP width one token runs through in a layer: a dense model's intermediate_size; a MoE's top_k x
    the expert width, plus its shared expert's (what its activations scale with, not the dense width)."""
    if not is_moe(config):
        return config.intermediate_size
    return config.num_experts_per_tok * expert_width(config) + (getattr(config, "shared_expert_intermediate_size", 0) or 0)


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


# ---------------------------------------------------------------------------------------------
# Routing: the routers of a transformers MoE, and replaying recorded routes through them


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (`mlp.gate` of Qwen2-MoE, Qwen3-MoE and Mixtral): modules that
    map hidden states (N, H) to (router logits (N, E), top-k weights (N, k), top-k expert ids (N, k))."""
    found = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
    if not found and is_moe(model.config):
        raise ValueError(f"{type(model).__name__} is a MoE model, but no router (a `mlp.gate` with top_k) was found")
    return found


def _replayed(router: nn.Module, logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's output with `experts` (N, k) chosen: their weights gathered from the dense softmax of
    this forward's logits (so the router keeps its gradient), renormalised where the router does so."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    chosen = probs.gather(-1, experts)  # (N, k)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return logits, chosen.to(weights.dtype), experts


class RouterReplay:
    """Records the experts each router chose, or forces recorded ones, in the forwards run inside it.

        with RouterReplay(model, "record") as rec:   # the old-log-prob forward (R2)
            model(**inputs)
        routes = rec.routes                          # (layers, N, k) int64, N = tokens of the forward
        with RouterReplay(model, "replay", routes):  # the update's forward: the same experts
            loss = ...; loss.backward()              # the router still gets gradients

    Routes are in the order the routers see tokens: the forward's flattened (batch x sequence) layout.
    Each router must be called once per forward; the forward's tokens must be the recorded ones. A replay
    may change its routes between forwards (`force`); an expert id < 0 leaves that token's route to the
    router. The hooks stay while the block lasts: a backward that recomputes the forward (activation
    checkpointing) inside it replays the same routes.
    """

    def __init__(self, model: nn.Module, mode: str, routes: torch.Tensor | None = None) -> None:
        if mode not in ("record", "replay"):
            raise ValueError(f"RouterReplay mode {mode!r}: use 'record' or 'replay'")
        if mode == "record" and routes is not None:
            raise ValueError("RouterReplay: routes are given to 'replay', and only to it")
        self.routers = routers(model)
        self.mode, self.given = mode, None
        if routes is not None:
            self.force(routes)
        self.recorded: list[torch.Tensor | None] = [None] * len(self.routers)
        self.handles: list = []

    def force(self, routes: torch.Tensor) -> None:
        """The routes (layers, N, k) the next forwards replay."""
        if routes.shape[0] != len(self.routers):
            raise ValueError(f"routes for {routes.shape[0]} MoE layers; the model has {len(self.routers)}")
        self.given = routes

    def _hook(self, layer: int):
        def hook(router: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, weights, experts = output
            if self.mode == "record":
                self.recorded[layer] = experts.detach().clone()
                return output
            if self.given is None:
                raise RuntimeError("RouterReplay('replay'): a forward ran before any routes were given (force)")
            forced = self.given[layer].to(experts.device)
            if forced.shape != experts.shape:
                raise ValueError(f"router of MoE layer {layer}: recorded routes {tuple(forced.shape)} for a forward "
                                 f"of {tuple(experts.shape)} (tokens x top_k); replay needs the recorded tokens")
            forced = torch.where(forced < 0, experts, forced.to(experts.dtype))  # unrecorded tokens route freely
            return _replayed(router, logits, weights, forced)
        return hook

    def __enter__(self) -> RouterReplay:
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def routes(self) -> torch.Tensor:
        """(layers, N, k): the recorded experts of each MoE layer, in the last forward."""
        if any(r is None for r in self.recorded):
            raise RuntimeError("RouterReplay.routes: not every router ran inside the 'record' block")
        return torch.stack(self.recorded)


# Routes per row (verl's batch key `routed_experts`): (B, P+R, layers, top_k), the experts of every token
# of every sample, whatever layout (padded, packed, micro batch) the forward that chose them ran in.
# int16 (expert ids up to 32767), -1 where the forward did not run the position (padding).


def routes_to_rows(routes: torch.Tensor, ran: torch.Tensor) -> torch.Tensor:
    """A forward's recorded routes (layers, N, k) -> (b, T, layers, k) rows, -1 where it ran no token.
    ran: (b, T) bool, the positions the forward ran, N of them, in its (row-major) order."""
    rows = torch.full((*ran.shape, *routes.shape[::2]), -1, dtype=torch.int16, device=routes.device)
    rows[ran.to(routes.device)] = routes.transpose(0, 1).to(torch.int16)  # (N, layers, k)
    return rows


def routes_from_rows(rows: torch.Tensor, ran: torch.Tensor) -> torch.Tensor:
    """(b, T, layers, k) rows -> the routes (layers, N, k) of a forward over the positions `ran` (b, T)."""
    return rows[ran.to(rows.device)].transpose(0, 1).long()  # (layers, N, k)


def check_router_replay(model: nn.Module, mode: str) -> None:
    """actor.router_replay.mode R2 needs routers to record and replay."""
    if mode != "disabled" and not routers(model):
        raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode={mode}: {type(model).__name__} has no MoE "
                          "router to record or replay. Set it to disabled (routes exist only in MoE models).")


# ---------------------------------------------------------------------------------------------
# The routers' load-balancing loss, as a metric


class RouterLogits:
    """Keeps each router's logits (N, E) of the forwards run inside it, detached: `with RouterLogits(model) as
    seen: model(...)`, then load_balancing_loss(seen.logits, ...). Without routers (a dense model) it keeps
    nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        self.logits: list[torch.Tensor] = []
        self.handles: list = []

    def __enter__(self) -> RouterLogits:
        def hook(router: nn.Module, args: tuple, output: tuple) -> None:
            self.logits.append(output[0].detach())

        self.handles = [r.register_forward_hook(hook) for r in self.routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss that transformers' MoE models add with output_router_logits
    (router_aux_loss_coef x this), over every token of every layer given: E x sum_e f_e x P_e, where f_e is
    the picks of expert e per token (summed over the top_k slots) and P_e its mean router probability.
    top_k for balanced routing, more the more the likely experts are also the ones picked most (E
    at most). logits: one (N, E) tensor per layer."""
    probs = torch.softmax(torch.cat(logits).float(), dim=-1)  # (layers x N, E)
    num_experts = probs.shape[-1]
    picks = nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).float()  # (L x N, k, E)
    share = picks.mean(0)  # (k, E): per slot, the fraction of tokens sent to each expert
    return (share * probs.mean(0)).sum() * num_experts
