"""Rollout correction: the engine's log-probs against the actor's (verl's algorithm.rollout_correction).

The engine that samples a batch (vLLM: other kernels, bf16 on GPUs, maybe older weights) does not
sample from exactly the actor's distribution. Three policies meet in a PPO step: pi_rollout (the
engine, which sampled), pi_old (the actor before the update, the PPO ratio's anchor) and pi_theta
(being trained). In verl's *decoupled* mode the correction compares pi_old with pi_rollout once per
step: truncated importance weights w = pi_old / pi_rollout multiply the per-token policy loss
(`rollout_is`: one weight per token, or the product over the sequence), and rejection sampling
(`rollout_rs`) drops tokens or whole sequences whose ratio is too far off from every loss. In
*bypass* mode the engine's log-probs serve as pi_old (one forward less per step) and the same
quantities compare pi_theta with pi_rollout inside the loss, per micro batch.

Exact under top-k / top-p: the engine returns the log-probs of the distribution it sampled from
(rollout.py asks for logprobs_mode="processed_logprobs"): logits / temperature, cut to the top-k /
top-p set, renormalised. Full-vocabulary log-probs of the same weights are lower by the log of the
kept mass on every token, so weights computed against them are below 1 where nothing is off. The
actor's side of the correction is therefore computed under the same cut
(ppo_core.truncated_log_probs), from the logits of the old-log-prob forward: with identical weights
the weights are 1.

Tensors in, tensors and floats out, no state. A function given a `group` is a collective over it
(every rank of it must call): `is_weights` all-reduces its batch normalisation, `correct_batch`
all-gathers the batch. Names, thresholds and metrics follow verl 0.9.1's rollout_corr_helper, metric
names without the "rollout_corr/" prefix that `correct_batch` / `correct_micro_batch` add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from collectives import gather_rows, my_rows
from config import parse_is_threshold, parse_rs_thresholds
from ppo_core import LOG_RATIO_BOUND, masked_mean, masked_sum


@dataclass(frozen=True)
class Correction:
    """algorithm.rollout_correction with its thresholds parsed, once (Correction.from_config)."""

    is_level: str | None = None  # rollout_is: "token" | "sequence"; None: no IS weights
    is_upper: float = math.inf  # rollout_is_threshold: TIS clamps the weights to it; IcePop's upper bound
    is_lower: float | None = None  # IcePop's lower bound (rollout_is_threshold "lower_upper"); None: TIS
    is_batch_normalize: bool = False  # rollout_is_batch_normalize
    # rollout_rs's options and their (lower, upper) bounds (rollout_rs_threshold); empty: no rejection
    rs_bounds: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    loss_type: str = "ppo_clip"  # bypass mode's policy loss: "ppo_clip" | "reinforce"

    @classmethod
    def from_config(cls, rc_cfg: Any) -> Correction:
        """Reads the keys the set options use (the config's unread-key report names the others)."""
        spec: dict[str, Any] = {}
        if rc_cfg.rollout_is is not None:
            upper, lower = parse_is_threshold(rc_cfg.rollout_is_threshold)
            spec.update(is_level=rc_cfg.rollout_is, is_upper=upper, is_lower=lower,
                        is_batch_normalize=rc_cfg.rollout_is_batch_normalize)
        if rc_cfg.rollout_rs is not None:
            spec["rs_bounds"] = parse_rs_thresholds(rc_cfg.rollout_rs, rc_cfg.rollout_rs_threshold)
        if rc_cfg.bypass_mode:
            spec["loss_type"] = rc_cfg.loss_type
        return cls(**spec)


# --- importance weights --------------------------------------------------------------------------


def _masked_max(values: Tensor, mask: Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("-inf")).max().item()


def _masked_min(values: Tensor, mask: Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("inf")).min().item()


def _global_mean(total: Tensor, count: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """total / count, both summed over `group` first when one is given (a collective then)."""
    both = torch.stack([total.to(torch.float64), count.to(torch.float64)])  # (2,)
    if group is not None:
        dist.all_reduce(both, group=group)
    return (both[0] / both[1].clamp_min(1e-8)).to(total.dtype)


def is_weights(log_ratio: Tensor, mask: Tensor, level: str, upper: float, lower: float | None = None,
               batch_normalize: bool = False, group: dist.ProcessGroup | None = None) -> tuple[Tensor, dict[str, float]]:
    """Importance weights pi_actor / pi_engine from log_ratio = log pi_actor - log pi_engine, (B, T).

    level "token": w_t = exp(log_ratio_t); "sequence": every token of a sequence gets exp(sum of its
    log-ratios). lower None: TIS, w = min(w, upper); else IcePop, w = 0 outside [lower, upper]
    (config.parse_is_threshold reads both from rollout_is_threshold). batch_normalize divides by the mean
    weight (over tokens, or over sequences) of the batch every rank of `group` holds. Returns (weights
    (B, T), 0 on padding, detached; metrics).
    """
    mask_f = mask.to(log_ratio.dtype)  # (B, T)
    if level == "token":
        log_w = log_ratio  # (B, T)
        raw = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp() * mask_f  # (B, T)
    elif level == "sequence":
        log_w = masked_sum(log_ratio, mask, axis=-1)[:, None]  # (B, 1) log of the product over the sequence
        raw = log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp() * mask_f  # (B, T) broadcast over the tokens
    else:
        raise ValueError(f"rollout_is={level!r}; valid: token, sequence")
    if lower is None:
        weights = raw.clamp(max=upper)  # (B, T) TIS
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)  # (B, T) IcePop
    metrics = is_metrics(weights, raw, log_w, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = _global_mean(masked_sum(weights, mask), mask.sum(), group)
        else:
            valid = mask.sum(-1) > 0  # (B,)
            mean = _global_mean(masked_mean(weights, mask, axis=-1)[valid].sum(), valid.sum(), group)
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
    return weights, metrics


def is_metrics(weights: Tensor, raw: Tensor, log_w: Tensor, mask: Tensor, level: str, upper: float,
               lower: float | None) -> dict[str, float]:
    """verl's rollout_is_* statistics of the applied weights (and the raw ones, for the fractions
    beyond the bounds; lower defaults to 1 / upper there). log_w: (B, T) token or (B, 1) sequence
    log-weights, before clamping."""
    lower = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(log_w.max().item(), LOG_RATIO_BOUND))
        out["rollout_is_min"] = math.exp(log_w.min().item())
        out["rollout_is_ratio_fraction_high"] = (log_w > math.log(upper)).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (log_w < math.log(lower)).float().mean().item()
    else:
        out["rollout_is_max"], out["rollout_is_min"] = _masked_max(weights, mask), _masked_min(weights, mask)
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask).item()
    bounded = weights.clamp(0.0, upper)  # (B, T)
    mean = masked_mean(bounded, mask)  # ()
    variance = masked_mean(bounded.square(), mask) - mean.square()
    out["rollout_is_std"] = variance.clamp_min(0).sqrt().item() if mask.sum() > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (mean + 1e-8)).square(), mask).item()
    seq_weights = masked_mean(weights, mask, axis=-1)  # (B,) 0 for empty rows, as verl
    raw_seq_weights = masked_mean(raw, mask, axis=-1)  # (B,)
    out["rollout_is_seq_mean"] = seq_weights.mean().item()
    out["rollout_is_seq_std"] = seq_weights.std().item() if len(seq_weights) > 1 else 0.0
    out["rollout_is_seq_max"], out["rollout_is_seq_min"] = seq_weights.max().item(), seq_weights.min().item()
    out["rollout_is_seq_max_deviation"] = (seq_weights - 1.0).abs().max().item()
    out["rollout_is_seq_fraction_high"] = (raw_seq_weights > upper).float().mean().item()
    out["rollout_is_seq_fraction_low"] = (raw_seq_weights < lower).float().mean().item()
    return out


# --- rejection sampling --------------------------------------------------------------------------


def rejection_mask(log_ratio: Tensor, mask: Tensor, bounds: dict[str, tuple[float | None, float]]
                   ) -> tuple[Tensor, dict[str, float]]:
    """verl's rollout_rs: the response mask with rejected tokens set to 0, and metrics. bounds: {option:
    (lower, upper)} (config.parse_rs_thresholds of rollout_rs and rollout_rs_threshold).

    Per token, k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (r = pi_actor / pi_engine, log r
    clamped to +-20). token_k*: the token's own value; seq_sum / seq_mean / seq_max: that of its
    sequence (empty sequences count 0 for seq_max). k1 options keep log(lower) <= value <= log(upper);
    k2 / k3 keep value <= upper. A token stays only if every listed option keeps it.
    """
    if log_ratio.shape[0] == 0:
        return mask, {}
    log_r = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    per_token = {"k1": -log_r, "k2": 0.5 * log_r.square(), "k3": log_r.exp() - 1.0 - log_r}  # (B, T) each
    valid_token, valid_seq = mask.bool(), mask.sum(-1) > 0  # (B, T), (B,)
    keep_all = torch.ones_like(valid_token)  # (B, T)
    metrics: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        scope, estimator = option.rsplit("_", 1)  # "token" | "seq_sum" | "seq_mean" | "seq_max", "k1" | ...
        values = per_token[estimator]  # (B, T)
        seq_values = None
        if scope == "seq_sum":
            seq_values = masked_sum(values, mask, axis=-1)  # (B,)
        elif scope == "seq_mean":
            seq_values = masked_mean(values, mask, axis=-1)  # (B,)
        elif scope == "seq_max":
            seq_values = values.masked_fill(~valid_token, float("-inf")).max(-1).values  # (B,)
            seq_values = torch.where(valid_seq, seq_values, 0.0)
        stat = values if seq_values is None else seq_values[:, None].expand_as(values)  # (B, T)
        high = math.log(upper) if lower is not None else upper  # k1 bounds are on the log-ratio scale
        low = math.log(lower) if lower is not None else None
        keep = stat <= high if low is None else (stat >= low) & (stat <= high)  # (B, T)
        keep_all &= keep
        metrics.update(rs_metrics(option, stat, seq_values, mask, high, low))
        rejected = ~keep & valid_token  # (B, T)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(rejected.float(), mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            rejected.any(-1)[valid_seq].float().mean().item() if valid_seq.any() else 0.0)
    rejected = ~keep_all & valid_token  # (B, T)
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(-1).float().mean().item()
    return mask * keep_all.to(mask.dtype), metrics


def rs_metrics(option: str, stat: Tensor, seq_values: Tensor | None, mask: Tensor, high: float,
               low: float | None) -> dict[str, float]:
    """verl's rollout_rs_<option>_* statistics. stat: the (B, T) value each token is judged by;
    seq_values: the per-sequence value for sequence options (token options: per-sequence means)."""
    prefix = f"rollout_rs_{option}"
    valid_seq = mask.sum(-1) > 0  # (B,)
    per_seq = (masked_mean(stat, mask, axis=-1) if seq_values is None else seq_values)[valid_seq]  # (S,)
    judged = stat if seq_values is None or len(per_seq) == 0 else None  # tokens, or sequences
    out = {f"{prefix}_mean": masked_mean(stat, mask).item()}
    if judged is None:
        out[f"{prefix}_max"], out[f"{prefix}_min"] = per_seq.max().item(), per_seq.min().item()
        out[f"{prefix}_fraction_high"] = (per_seq > high).float().mean().item()
        out[f"{prefix}_fraction_low"] = (per_seq < low).float().mean().item() if low is not None else 0.0
    else:
        out[f"{prefix}_max"], out[f"{prefix}_min"] = _masked_max(stat, mask), _masked_min(stat, mask)
        out[f"{prefix}_fraction_high"] = masked_mean((stat > high).float(), mask).item()
        out[f"{prefix}_fraction_low"] = masked_mean((stat < low).float(), mask).item() if low is not None else 0.0
    bounded = stat.clamp(low if low is not None else 0.0, high)  # (B, T)
    variance = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
    out[f"{prefix}_std"] = variance.clamp_min(0).sqrt().item() if mask.sum() > 1 else 0.0
    if len(per_seq) > 0:
        out[f"{prefix}_seq_mean"] = per_seq.mean().item()
        out[f"{prefix}_seq_std"] = per_seq.std().item() if len(per_seq) > 1 else 0.0
        out[f"{prefix}_seq_max"], out[f"{prefix}_seq_min"] = per_seq.max().item(), per_seq.min().item()
        out[f"{prefix}_seq_max_deviation"] = per_seq.abs().max().item()
        out[f"{prefix}_seq_fraction_high"] = (per_seq > high).float().mean().item()
        if low is not None:
            out[f"{prefix}_seq_fraction_low"] = (per_seq < low).float().mean().item()
    else:
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                     "seq_fraction_low"):
            out[f"{prefix}_{name}"] = 0.0
    return out


# --- how far apart the two policies are ---------------------------------------------------------


def offpolicy_metrics(actor_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics of the sampled tokens: perplexities of both policies (the batch
    mean of each sequence's), KL(engine || actor) by k1 (`kl`) and k3 (`k3_kl`), the log-perplexity
    gap, and the chi-square divergences E[r^2] - 1 per token and per sequence (r = actor / engine)."""
    actor_mean = masked_mean(actor_log_probs, mask, axis=-1)  # (B,) mean log-prob per sequence
    rollout_mean = masked_mean(rollout_log_probs, mask, axis=-1)  # (B,)
    log_ratio = actor_log_probs - rollout_log_probs  # (B, T)
    log_ppl_diff = rollout_mean - actor_mean  # (B,) log(actor ppl / engine ppl)
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B,)
    return {
        "training_ppl": (-actor_mean).exp().mean().item(),
        "training_log_ppl": (-actor_mean).mean().item(),
        "kl": masked_mean(-log_ratio, mask).item(),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1.0, mask).item(),
        "rollout_ppl": (-rollout_mean).exp().mean().item(),
        "rollout_log_ppl": (-rollout_mean).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": log_ppl_diff.exp().mean().item(),
        "chi2_token": (masked_mean(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp().square(), mask) - 1.0).item(),
        "chi2_seq": ((2.0 * seq_log_ratio).exp().mean() - 1.0).item(),
    }


# --- the whole correction ------------------------------------------------------------------------


def rollout_correction(actor_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, spec: Correction,
                       group: dist.ProcessGroup | None = None) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """IS weights (None unless rollout_is), the response mask after rejection (rollout_rs), and every
    metric as rollout_corr/<name>. `group` only reaches the batch normalisation. (B, T) tensors;
    actor_log_probs is the actor's side, under the engine's truncation."""
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token; the response mask is empty")
    log_ratio = (actor_log_probs - rollout_log_probs).detach()  # (B, T) log pi_actor / pi_engine
    weights, metrics = None, {}
    if spec.is_level is not None:
        weights, metrics = is_weights(log_ratio, mask, spec.is_level, spec.is_upper, spec.is_lower,
                                      spec.is_batch_normalize, group)
    kept = mask
    if spec.rs_bounds:
        kept, rs = rejection_mask(log_ratio, mask, spec.rs_bounds)
        metrics.update(rs)
    metrics.update(offpolicy_metrics(actor_log_probs.detach(), rollout_log_probs, mask))
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def correct_batch(actor_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, spec: Correction,
                  group: dist.ProcessGroup) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """Decoupled mode, once per step: rollout_correction over the step's whole batch, which the ranks
    of `group` hold between them in equal, distinct (B, T) shares (verl's driver holds it all), so the metrics
    and the batch normalisation are those of the whole batch on every rank. Returns this rank's rows.
    Collective."""
    weights, kept, metrics = rollout_correction(gather_rows(actor_log_probs, group), gather_rows(rollout_log_probs, group),
                                                gather_rows(mask, group), spec)
    return None if weights is None else my_rows(weights, group), my_rows(kept, group), metrics


def correct_micro_batch(log_prob: Tensor, rollout_log_probs: Tensor, mask: Tensor, spec: Correction,
                        group: dist.ProcessGroup | None = None) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """Bypass mode, in the loss: pi_theta (detached) against the engine on one micro batch, as verl's
    bypass_mode loss does; the batch normalisation spans that micro batch on every rank of `group`
    (the ranks holding distinct samples; all of them run as many micro batches). Metrics come back
    as tensors, for run_updates to average over micro batches."""
    weights, kept, metrics = rollout_correction(log_prob.detach(), rollout_log_probs, mask, spec, group)
    return weights, kept, {k: torch.tensor(v) for k, v in metrics.items()}
