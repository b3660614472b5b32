"""PPO / GRPO core math: masked statistics, advantages, policy/value losses, KL, loss aggregation, and
log-probs / entropy from logits (full, or under the engine's top-k / top-p cut).

Functions of padded tensors of shape (B, T): B responses, T = response length. `response_mask` is 1
on real response tokens and 0 on the padding after EOS (or on tool/observation tokens in multi-turn
rollouts). Not all pure: given a process group, masked_mean_var, masked_whiten and the estimators
that whiten all-reduce over it (every rank must call), as global_num_tokens_and_seqs does whenever
one is initialised; the KL controllers hold their coefficient; clip_cov draws from `generator`.
Names and meanings follow verl's `verl/trainer/ppo/core_algos.py`, so config keys carry over:
algorithm.adv_estimator, algorithm.kl_penalty, actor.policy_loss.loss_mode, actor.loss_agg_mode,
actor.clip_ratio_low / clip_ratio_high / clip_ratio_c, critic.cliprange_value.

Loss scaling under micro-batching and data parallelism
------------------------------------------------------
One optimizer step consumes a mini-batch spread over `dp_size` ranks, each cutting its share into
micro-batches. The step must see the same gradient however the mini-batch is cut. So each micro-batch
loss is the *sum* of its per-token (or per-sequence) losses divided by the count over the WHOLE
mini-batch, all ranks together, times `dp_size`, because FSDP (like DDP) *averages* gradients over ranks.
The training loop, on every rank, per mini-batch:

    num_tokens, num_seqs = global_num_tokens_and_seqs([mb["response_mask"] for mb in micro_batches])
    for mb in micro_batches:                         # this rank's share, any sizes
        pg_loss, *_ = compute_policy_loss(..., loss_agg_mode=mode, global_num_tokens=num_tokens,
                                          global_num_seqs=num_seqs, dp_size=dp_world_size)
        pg_loss.backward()                           # do NOT divide by len(micro_batches)
    optimizer.step()                                 # FSDP's mean over ranks gives the full-batch grad

Use the same counts for every term added to the loss (entropy bonus, KL loss, value loss). A logged
micro-batch loss is that micro-batch's share: sum it over micro-batches, then average over ranks, to
get the mini-batch loss. Without global counts (dp_size must then be 1) agg_loss averages over the
micro-batch alone, verl's legacy behaviour: tokens in short micro-batches then weigh more.
"""

import heapq
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

LOG_RATIO_BOUND = 20.0  # log-ratios are clamped to +-this before exp (e^20 ~ 5e8), as verl does

# --- masked statistics ---------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Sum of `values` where the 0/1 `mask` is set; padding is dropped, so NaN/inf there cannot leak."""
    return torch.where(mask.bool(), values, 0.0).sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set; 0 (not NaN) where the mask is empty."""
    count = mask.to(values.dtype).sum(dim=axis).clamp_min(1e-8)  # exact for >= 1 element, safe for 0
    return masked_sum(values, mask, axis) / count


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `values` over all masked entries (Bessel-corrected by default, like verl)."""
    mean = masked_mean(values, mask)  # ()
    var = masked_mean((values - mean) ** 2, mask)  # ()
    if unbiased:
        n = int(mask.bool().sum().item())
        if n < 2:
            raise ValueError(f"masked_var: unbiased variance needs >= 2 unmasked elements, got {n}")
        var = var * n / (n - 1)
    return var


def masked_mean_var(values: Tensor, mask: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """Mean and Bessel-corrected variance over the masked entries of every rank in `group` (each
    rank holds a different share of one batch; all must call). Two all_reduces of float64 sums:
    the mean first, then the squared deviations from it, which is as exact as the one-rank two-pass."""
    def global_sum(*terms: Tensor) -> Tensor:
        total = torch.stack([t.to(torch.float64) for t in terms])  # (k,)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    total, count = global_sum(masked_sum(values.to(torch.float64), mask), mask.bool().sum())
    n = int(count.item())
    if n < 2:
        raise ValueError(f"masked_mean_var: unbiased variance needs >= 2 unmasked elements over the group, got {n}")
    mean = total / n  # () float64
    (squares,) = global_sum(masked_sum((values.to(torch.float64) - mean) ** 2, mask))
    return mean.to(values.dtype), (squares / (n - 1)).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True,
                  group: dist.ProcessGroup | None = None) -> Tensor:
    """Normalise to unit variance over the mask; zero mean too unless shift_mean=False.

    With a process group the statistics are those of the whole batch that the group's ranks hold
    between them (verl whitens the full batch on its driver), not of this rank's share.
    """
    if group is None:
        mean, var = masked_mean(values, mask), masked_var(values, mask)  # (), ()
    else:
        mean, var = masked_mean_var(values, mask, group)  # (), ()
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)  # (B, T)
    return whitened if shift_mean else whitened + mean


# --- advantage estimators ------------------------------------------------------------------------
# algorithm.adv_estimator -> implementation and traits. Every estimator names the keyword arguments it
# reads; compute_advantage passes each the ones it names, so the trainer calls them all alike, and refuses a
# keyword no estimator names (a misspelling is an error, not ignored). To add one: write it below
# under @register_adv_estimator("name", ...) with literal arguments (config.py reads them from this
# file's text, so the planner knows the names and traits without importing torch), and test it.


@dataclass(frozen=True)
class AdvEstimator:
    name: str  # algorithm.adv_estimator
    fn: Callable[..., tuple[Tensor, Tensor]]  # (advantages, returns), (B, T) each
    needs_critic: bool  # reads `values`: the trainer loads and trains a value model
    # compares the samples of one prompt (`index`): needs rollout.n >= 2, and the trainer computes it
    # on the step's whole batch, gathered from every dp rank
    compares_group: bool
    # "greedy": one more rollout per prompt, its score passed as `reward_baselines` (ReMax); None: none
    baseline_rollout: str | None


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str, *, needs_critic: bool = False, compares_group: bool = False,
                           baseline_rollout: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: file the function under algorithm.adv_estimator=`name`, with its traits."""
    def register(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADV_ESTIMATORS[name] = AdvEstimator(name, fn, needs_critic, compares_group, baseline_rollout)
        return fn
    return register


@register_adv_estimator("gae", needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float,
    whiten_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016). Returns (advantages whitened over the mask, returns = adv + V).
    With whiten_group, the whitening statistics span the batch all of the group's ranks hold.

    Masked steps are skipped: the recursion carries V and the GAE sum of the next real token back
    over them, so rewards or values in the padding never reach a real token. Padding outputs are 0.
    """
    mask = response_mask.bool()  # (B, T)
    next_value = torch.zeros_like(values[:, 0])  # (B,) V(s_{t+1}); 0 past the last real token
    last_gae = torch.zeros_like(values[:, 0])  # (B,) GAE of the next real token
    advantages = []
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]  # (B,) TD error
        gae = delta + gamma * lam * last_gae  # (B,)
        advantages.append(gae)
        next_value = torch.where(mask[:, t], values[:, t], next_value)  # (B,)
        last_gae = torch.where(mask[:, t], gae, last_gae)  # (B,)
    advantages = torch.stack(advantages[::-1], dim=1)  # (B, T)
    returns = torch.where(mask, advantages + values, 0.0)  # (B, T) value-function targets
    advantages = torch.where(mask, masked_whiten(advantages, mask, group=whiten_group), 0.0)  # (B, T)
    return advantages, returns


def _group_ids(index: Sequence[Any] | Tensor, device: torch.device) -> Tensor:
    """Map per-sample group keys (prompt uids: ints or strings) to 0..G-1."""
    keys = index.tolist() if hasattr(index, "tolist") else list(index)  # tensor / numpy / list
    first_seen: dict[Any, int] = {}
    return torch.tensor([first_seen.setdefault(k, len(first_seen)) for k in keys], device=device)


def _group_stats(scores: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group mean, unbiased group std), gathered back to (B,)."""
    num_groups = int(group.max()) + 1
    zeros = scores.new_zeros(num_groups)  # (G,)
    size = zeros.index_add(0, group, torch.ones_like(scores))  # (G,)
    mean = zeros.index_add(0, group, scores) / size  # (G,)
    sq_dev = zeros.index_add(0, group, (scores - mean[group]) ** 2)  # (G,)
    std = (sq_dev / (size - 1).clamp_min(1)).sqrt()  # (G,) Bessel-corrected, as torch.std
    return size[group], mean[group], std[group]  # (B,) each


@register_adv_estimator("grpo", compares_group=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: (outcome - group mean) / (group std + eps), broadcast over the response tokens.

    `index[i]` is the group (prompt uid) of sample i. norm_adv_by_std_in_grpo=False gives Dr.GRPO.
    A group of size 1 has no baseline, so its advantage is 0 (verl would pass its raw score through).
    Returns (advantages, returns), both (B, T) and equal, like verl.
    """
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,) outcome reward
    size, mean, std = _group_stats(scores, _group_ids(index, scores.device))  # (B,) each
    adv = scores - mean  # (B,)
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)  # all-equal group: 0 / eps = 0, no NaN
    adv = torch.where(size > 1, adv, 0.0)  # (B,)
    adv = torch.where(response_mask.bool(), adv.unsqueeze(-1), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("gdpo", compares_group=True)
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    response_mask: Tensor, index: Sequence[Any] | Tensor, reward_components: Tensor,
    reward_weights: Sequence[float] | None = None, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GDPO (Liu et al. 2026, verl 0.9.1): each reward component (the reward function's extras named by
    algorithm.gdpo_reward_keys, reward_components (B, K)) normalised within its prompt group as GRPO does,
    so that no component drowns the others; their sum weighted by reward_weights (K,) (default all 1),
    then whitened over the whole batch. The summed score (token_level_rewards) is not read, as in verl.
    Returns (advantages, returns), both (B, T) and equal."""
    mask = response_mask.to(reward_components.dtype)  # (B, T)
    last = mask.bool() & (mask.cumsum(-1) == mask.sum(-1, keepdim=True))  # (B, T) each response's last token
    weights = [1.0] * reward_components.shape[1] if reward_weights is None else list(reward_weights)
    total = torch.zeros_like(mask)  # (B, T)
    for k, weight in enumerate(weights):
        component = reward_components[:, k].unsqueeze(-1) * last  # (B, T) the score on the last token
        adv, _ = compute_grpo_outcome_advantage(component, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
        total = total + weight * adv  # (B, T)
    advantages = masked_whiten(total, mask.bool()) * mask  # (B, T)
    return advantages, advantages


@register_adv_estimator("rloo", compares_group=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): outcome minus the mean outcome of the OTHER samples of its group.

    Size-1 groups get 0 (verl keeps the raw score there). Returns (advantages, returns), equal.
    """
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
    size, mean, _ = _group_stats(scores, _group_ids(index, scores.device))  # (B,) each
    # s - (n * mean - s) / (n - 1) == n / (n - 1) * (s - mean)
    adv = size / (size - 1).clamp_min(1) * (scores - mean)  # (B,)
    adv = torch.where(size > 1, adv, 0.0)  # (B,)
    adv = torch.where(response_mask.bool(), adv.unsqueeze(-1), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float, whiten_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the whole batch
    (over every rank's share with whiten_group)."""
    mask = response_mask.bool()  # (B, T)
    running = torch.zeros_like(token_level_rewards[:, 0])  # (B,)
    returns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        # masked steps (padding, a multi-turn rollout's tool replies) carry the return past them unchanged,
        # as verl 0.9 does; what they hold never enters it
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, running)  # (B,)
        returns.append(running)
    returns = torch.where(mask, torch.stack(returns[::-1], dim=1), 0.0)  # (B, T)
    advantages = torch.where(mask, masked_whiten(returns, mask, group=whiten_group), 0.0)  # (B, T)
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline", compares_group=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor,
    whiten_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): outcome minus its group's mean, broadcast over the response and
    whitened over every token of the batch (so longer responses weigh more in the statistics).
    A size-1 group keeps its raw outcome before whitening, as in verl. Returns (advantages, returns), equal."""
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
    size, mean, _ = _group_stats(scores, _group_ids(index, scores.device))  # (B,) each
    centred = torch.where(size > 1, scores - mean, scores)  # (B,)
    mask = response_mask.bool()  # (B, T)
    tiled = torch.where(mask, centred.unsqueeze(-1), 0.0)  # (B, T)
    adv = torch.where(mask, masked_whiten(tiled, mask, group=whiten_group), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("opo", compares_group=True)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor
) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025): outcome minus the length-weighted mean outcome of its group,
    sum(len_j * s_j) / sum(len_j), the baseline that minimises the gradient's variance for equal-length
    token sums. A size-1 group has baseline 0, as in verl. Returns (advantages, returns), equal."""
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
    lengths = response_mask.to(scores.dtype).sum(-1)  # (B,)
    group = _group_ids(index, scores.device)  # (B,)
    zeros = scores.new_zeros(int(group.max()) + 1)  # (G,)
    weighted = zeros.index_add(0, group, lengths * scores)  # (G,) sum of len * score
    total_len = zeros.index_add(0, group, lengths)  # (G,)
    size = zeros.index_add(0, group, torch.ones_like(scores))  # (G,)
    baseline = torch.where(size > 1, weighted / total_len.clamp_min(1e-8), 0.0)[group]  # (B,)
    adv = torch.where(response_mask.bool(), (scores - baseline).unsqueeze(-1), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("gpg", compares_group=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor, f_norm: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025): alpha * (outcome - group mean) / f_norm, where alpha = B / (samples with a
    non-zero outcome) rescales for the batch's samples that carry no signal. A size-1 group has mean 0,
    as in verl. Returns (advantages, returns), equal."""
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
    size, mean, _ = _group_stats(scores, _group_ids(index, scores.device))  # (B,) each
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)  # a Python float: exact in any dtype
    adv = alpha * (scores - torch.where(size > 1, mean, 0.0)) / f_norm  # (B,)
    adv = torch.where(response_mask.bool(), adv.unsqueeze(-1), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("grpo_passk", compares_group=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor, epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """Pass@k training (Chen et al. 2025): only the best sample of each group learns, with advantage
    best outcome - second best (divided by the group's std + eps with norm_adv_by_std_in_grpo); every
    other sample gets 0. Groups need >= 2 samples. Returns (advantages, returns), equal."""
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)  # (B,)
    group = _group_ids(index, scores.device)  # (B,)
    adv = torch.zeros_like(scores)  # (B,)
    for g in range(int(group.max()) + 1):
        members = (group == g).nonzero().squeeze(-1)  # (n,)
        if len(members) < 2:
            raise ValueError(f"grpo_passk needs >= 2 samples per prompt (actor_rollout_ref.rollout.n), "
                             f"got {len(members)} for group {index[int(members[0])]!r}")
        top, where = torch.topk(scores[members], 2)  # (2,) best and second best
        gap = top[0] - top[1]
        adv[members[where[0]]] = gap / (scores[members].std() + epsilon) if norm_adv_by_std_in_grpo else gap
    adv = torch.where(response_mask.bool(), adv.unsqueeze(-1), 0.0)  # (B, T)
    return adv, adv


@register_adv_estimator("optimal_token_baseline", compares_group=True)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor, old_log_probs: Tensor,
    sum_pi_squared: Tensor, rollout_is_weights: Tensor | None = None, handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline (verl 0.9.1): a baseline per prompt group and position t, the group's
    returns-to-go G_t weighted by each sample's cumulative score-norm proxy W_t = sum_{j<=t} w_j, with
    w_j = 1 - 2 pi(y_j) + sum_v pi(v)^2 of the old policy (times the rollout IS weight squared, given
    rollout_is_weights): B_t = sum_i G_t W_t / (sum_i W_t + epsilon) over the group's samples still
    running at t. A group of one keeps its return (no baseline). handle_zero_tail: where one sample is
    strictly the longest of its group, its baseline past the second longest's end is 0.
    old_log_probs, sum_pi_squared (and the weights) (B, T). Returns (advantages G_t - B_t, returns G_t)."""
    mask = response_mask.to(token_level_rewards.dtype)  # (B, T)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
    cum_w = _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights) * mask  # (B, T) 0 past the end
    group = _group_ids(index, returns.device)  # (B,)
    baselines = _token_baselines(returns, cum_w, mask.sum(-1), group, torch.ones_like(group, dtype=torch.bool),
                                 handle_zero_tail, epsilon)  # (B, T)
    return (returns - baselines) * mask, returns


def _path_variance(old_log_probs: Tensor, sum_pi_squared: Tensor, mask: Tensor,
                   rollout_is_weights: Tensor | None) -> Tensor:
    """W_t = sum_{j<=t} w_j, w_j = 1 - 2 pi(y_j) + sum_v pi(v)^2 (times the IS weight squared), over valid tokens. (B, T)"""
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared  # (B, T) per-token score-norm proxy
    if rollout_is_weights is not None:
        w = w * rollout_is_weights ** 2
    return (w * mask).cumsum(-1)  # (B, T)


def _token_baselines(returns: Tensor, cum_w: Tensor, lengths: Tensor, group: Tensor, counted: Tensor,
                     handle_zero_tail: bool, epsilon: float) -> Tensor:
    """The optimal token baselines B_t = sum_i G_t W_t / (sum_i W_t + epsilon) over each group's `counted`
    samples (B,) bool, by position t; 0 for a group of one counted sample; handle_zero_tail: 0 past the second
    longest's end for a group's one strictly longest sample. returns, cum_w (B, T), lengths (B,). (B, T)"""
    num_groups = int(group.max()) + 1
    zeros = returns.new_zeros(num_groups, returns.shape[1])  # (G, T)
    weight = cum_w * counted.unsqueeze(-1)  # (B, T)
    numerator = zeros.index_add(0, group, returns * weight)  # (G, T)
    denominator = zeros.index_add(0, group, weight) + epsilon  # (G, T)
    size = torch.bincount(group[counted], minlength=num_groups)  # (G,)
    baselines = torch.where((size > 1)[group].unsqueeze(-1), (numerator / denominator)[group], 0.0)  # (B, T)
    if handle_zero_tail:
        for g in range(num_groups):
            members = ((group == g) & counted).nonzero().squeeze(-1)  # (n,)
            if len(members) < 2:
                continue
            top = torch.topk(lengths[members], 2).values  # (2,) longest, second longest
            longest = members[lengths[members] == top[0]]
            if len(longest) == 1 and top[0] > top[1]:  # one sample runs past every other
                baselines[longest[0], int(top[1]):] = 0.0
    return baselines


@register_adv_estimator("tir_optimal_token_baseline", compares_group=True)
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any] | Tensor, old_log_probs: Tensor,
    sum_pi_squared: Tensor, rollout_is_weights: Tensor | None = None, handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """The optimal token baseline for tool-integrated (multi-turn) responses (verl 0.9.1): as
    optimal_token_baseline, with t counting each sample's own valid tokens, so that a tool's reply (masked
    out) does not shift the positions that are compared across the group: the k-th generated token of
    every sample shares one baseline. Samples with no valid token are left out of their group. For
    responses without holes (one turn) it equals optimal_token_baseline. (B, T) in, (advantages, returns)."""
    mask = response_mask.bool()  # (B, T)
    maskf = mask.to(token_level_rewards.dtype)  # (B, T)
    returns = (token_level_rewards * maskf).flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
    cum_w = _path_variance(old_log_probs, sum_pi_squared, maskf, rollout_is_weights)  # (B, T)
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each the valid tokens, row by row
    k = (mask.long().cumsum(-1) - 1)[rows, cols]  # (N,) a token's place among its sample's valid tokens
    packed_returns, packed_w = torch.zeros_like(returns), torch.zeros_like(cum_w)  # (B, T) valid tokens moved left
    packed_returns[rows, k], packed_w[rows, k] = returns[rows, cols], cum_w[rows, cols]
    lengths = mask.sum(-1)  # (B,)
    group = _group_ids(index, returns.device)  # (B,)
    baselines = _token_baselines(packed_returns, packed_w, lengths, group, lengths > 0, handle_zero_tail, epsilon)
    advantages = torch.zeros_like(returns)  # (B, T)
    advantages[rows, cols] = (packed_returns - baselines)[rows, k]
    return advantages, returns


@register_adv_estimator("remax", baseline_rollout="greedy")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): the return-to-go minus the reward of the greedy response to the same
    prompt (reward_baselines, (B,)). Returns (advantages, returns); not whitened, as in verl."""
    mask = response_mask.bool()  # (B, T)
    returns = torch.where(mask, token_level_rewards, 0.0).flip(-1).cumsum(-1).flip(-1)  # (B, T) reward-to-go
    advantages = torch.where(mask, returns - reward_baselines.unsqueeze(-1), 0.0)  # (B, T)
    return advantages, returns


def _parameters(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def compute_advantage(adv_estimator: str, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Dispatch on algorithm.adv_estimator. kwargs: token_level_rewards, response_mask and whatever
    any estimator needs (values, index, gamma, lam, norm_adv_by_std_in_grpo, whiten_group, reward_baselines,
    ...); each estimator gets the ones it names. A keyword no estimator names is an error (a misspelling)."""
    if adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"unknown algorithm.adv_estimator={adv_estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}"
        )
    unknown = set(kwargs) - set().union(*(_parameters(e.fn) for e in ADV_ESTIMATORS.values()))
    if unknown:
        raise TypeError(f"compute_advantage: no advantage estimator takes {sorted(unknown)}")
    fn = ADV_ESTIMATORS[adv_estimator].fn
    named = _parameters(fn)
    return fn(**{key: value for key, value in kwargs.items() if key in named})


# --- DAPO: overlong reward shaping, dynamic sampling ---------------------------------------------


def overlong_penalty(response_lengths: Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment, (B,) -> (B,) <= 0: nothing up to max_response_length - buffer_len
    tokens, then falling linearly to -penalty_factor at max_response_length."""
    excess = response_lengths.float() - (max_response_length - buffer_len)  # (B,) tokens into the buffer
    return (-excess / buffer_len * penalty_factor).clamp(max=0.0)


def group_has_spread(values: Tensor, index: Sequence[Any] | Tensor) -> Tensor:
    """(B,) bool: whether sample i's group (same index) holds differing values, or is a single sample.
    DAPO's dynamic sampling keeps those groups: a group with one value has zero group-relative advantages."""
    group = _group_ids(index, values.device)  # (B,)
    empty = values.new_zeros(int(group.max()) + 1)  # (G,)
    highest = empty.scatter_reduce(0, group, values, "amax", include_self=False)  # (G,) exact, unlike a std
    lowest = empty.scatter_reduce(0, group, values, "amin", include_self=False)  # (G,)
    size = empty.index_add(0, group, torch.ones_like(values))  # (G,)
    return ((highest > lowest) | (size == 1))[group]


# --- loss aggregation ----------------------------------------------------------------------------

# actor.loss_agg_mode / critic.loss_agg_mode (agg_loss below implements each)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce a micro-batch's (b, T) loss matrix to the scalar to call .backward() on.

    token-mean:              sum of token losses / global_num_tokens
    token-sum:               sum of token losses, divided by nothing (the mini batch's gradient is that of
                             the sum over all its tokens, however it is cut)
    seq-mean-token-sum:      sum over sequences of their token sum / global_num_seqs
    seq-mean-token-mean:     sum over sequences of their token mean / global_num_seqs
    seq-mean-token-sum-norm: like seq-mean-token-sum, each token sum first divided by the constant
                             loss_scale_factor (default T; set it to max_response_length) (Dr.GRPO)
    The result is multiplied by dp_size to cancel FSDP's gradient averaging. global_num_tokens /
    global_num_seqs are the valid tokens / non-empty sequences of the whole mini-batch over all dp
    ranks (see global_num_tokens_and_seqs); verl calls them batch_num_tokens / global_batch_size.
    If the needed one is None, this micro-batch's own count is used (legacy local mean, dp_size=1).
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"invalid loss_agg_mode={loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    mask = loss_mask.bool()  # (b, T)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size  # FSDP's mean over ranks makes it the sum over all
    if loss_agg_mode == "token-mean":
        total = masked_sum(loss_mat, mask)  # ()
        count, local_count = global_num_tokens, mask.sum()
    else:
        num_tokens = mask.sum(-1)  # (b,)
        seq_losses = masked_sum(loss_mat, mask, axis=-1)  # (b,) token-sum; 0 for empty rows
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / num_tokens.clamp_min(1)  # (b,)
        elif loss_agg_mode == "seq-mean-token-sum-norm":
            seq_losses = seq_losses / (loss_scale_factor or loss_mask.shape[-1])  # (b,)
        total = seq_losses.sum()  # ()
        count, local_count = global_num_seqs, (num_tokens > 0).sum()
    if count is None:
        if dp_size != 1:
            raise ValueError(
                f"agg_loss({loss_agg_mode!r}) with dp_size={dp_size} needs the global count "
                "(global_num_tokens / global_num_seqs) of the whole mini-batch over all ranks"
            )
        count = local_count
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp_min(1)  # ()
    return total / count * dp_size


@dataclass(frozen=True)
class LossScale:
    """How one micro batch's loss is scaled (the module docstring): the valid tokens and non-empty sequences
    of the whole mini batch over the dp group (global_num_tokens_and_seqs), the group's size, and
    seq-mean-token-sum-norm's constant. LossScale() takes the micro batch's own counts (dp_size 1)."""

    num_tokens: int | Tensor | None = None
    num_seqs: int | Tensor | None = None
    dp_size: int = 1
    scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor (data.max_response_length)

    def agg(self, loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
        """agg_loss under this scale."""
        return agg_loss(loss_mat, loss_mask, loss_agg_mode, self.num_tokens, self.num_seqs, self.dp_size,
                        self.scale_factor)

    def counts(self) -> dict[str, Any]:
        """The scale as verl's keyword arguments (compute_policy_loss, compute_value_loss)."""
        return dict(global_num_tokens=self.num_tokens, global_num_seqs=self.num_seqs, dp_size=self.dp_size,
                    loss_scale_factor=self.scale_factor)


def global_num_tokens_and_seqs(
    response_masks: Sequence[Tensor], group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """(valid tokens, non-empty sequences) in this rank's micro-batches, summed over the dp group.

    Call once per mini-batch with the masks of all this rank's micro-batches; it all_reduces when a
    process group is initialised (masks must then live on the backend's device) and is local otherwise.
    """
    counts = torch.stack(
        [torch.stack([m.bool().sum(), (m.bool().sum(-1) > 0).sum()]) for m in response_masks]
    ).sum(0)  # (2,) int64
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    num_tokens, num_seqs = counts.tolist()
    return num_tokens, num_seqs


# --- policy and value losses ---------------------------------------------------------------------


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Clipped PPO surrogate with dual-clip (Ye et al. 2020). All inputs (B, T).

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower); the last three are local metrics.
    rollout_is_weights (rollout_correction.py) multiply the per-token losses before aggregation; the
    other keyword-only arguments go to agg_loss (see the module docstring).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1.0 for dual-clip, got {clip_ratio_c}")
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T) clamp so exp cannot overflow
    ratio = log_ratio.exp()  # (B, T) pi / pi_old
    ppo_kl = masked_mean(-log_ratio, response_mask)  # () k1 estimate of KL(pi_old || pi)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # (B, T) pessimistic of the two
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), response_mask)  # ()
    # dual-clip: with A < 0 the PPO loss grows without bound in the ratio; cap it at -A * c
    loss_cap = -advantages * clip_ratio_c  # (B, T)
    negative = advantages < 0  # (B, T)
    pg_losses = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)  # (B, T)
    pg_clipfrac_lower = masked_mean(((loss_ppo > loss_cap) & negative).to(ratio.dtype), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights  # (B, T) detached truncated IS weights
    pg_loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor
    )
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# --- policy losses by actor.policy_loss.loss_mode -----------------------------------------------
# Each takes (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode) and keyword arguments:
# `scale` (a LossScale) and rollout_is_weights, which every loss applies to its per-token losses
# through _agg; the clip ratios and its own policy_loss.* keys; it ignores the other losses' keys,
# and returns (pg_loss, {metric name: local value}), so the trainer calls them all alike.
# To add one: write it below under @register_policy_loss("name", keys=(...)) with literal arguments
# (config.py reads them from this file's text), `keys` naming the actor.policy_loss.* config keys it
# reads (declare them in config.SCHEMA; the trainer passes exactly those), and test it.


@dataclass(frozen=True)
class PolicyLoss:
    name: str  # actor.policy_loss.loss_mode
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    keys: tuple[str, ...]  # the actor.policy_loss.* keys it reads, passed as keyword arguments of the same name


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, keys: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: file the function under actor.policy_loss.loss_mode=`name`, with the keys it reads."""
    def register(fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(name, fn, tuple(keys))
        return fn
    return register


def _agg(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str, scale: LossScale,
         rollout_is_weights: Tensor | None) -> Tensor:
    """scale.agg of the per-token losses, after multiplying them by rollout_is_weights (rollout correction's
    detached weights, (B, T)) when given."""
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights  # (B, T)
    return scale.agg(loss_mat, mask, loss_agg_mode)


@register_policy_loss("vanilla")
def policy_loss_vanilla(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 3.0, scale: LossScale = LossScale(),
    rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with dual-clip: compute_policy_loss."""
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
        loss_agg_mode, **scale.counts(), rollout_is_weights=rollout_is_weights)
    return pg_loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": clipfrac_lower}


@register_policy_loss("gspo")
def policy_loss_gspo(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean", *, clip_ratio_low: float, clip_ratio_high: float,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clip on the sequence's ratio s = (pi / pi_old)^(1/|y|), the
    geometric mean of its token ratios, shared by all its tokens. Token t's factor is
    sg[s] * pi_t / sg[pi_t]: its value is s, its gradient flows through log pi_t alone. The paper uses
    seq-mean-token-mean and clip ranges of 3e-4 / 4e-4 (the ratio of a whole sequence moves little)."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, axis=-1)  # (B,) log s
    log_s = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)  # (B, T)
    ratio = log_s.exp()  # (B, T) value s, per-token gradient
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(ratio.dtype), mask)  # ()
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {
        "actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("cispo")
def policy_loss_cispo(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, stop-gradient ratio,
    -sg[clip(r, 1 - low, 1 + high)] * A * log pi. Unlike PPO no token's gradient is dropped: a clipped
    ratio only caps its weight."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()  # (B, T)
    pg_losses = -weight * advantages * log_prob  # (B, T)
    pg_clipfrac = masked_mean((ratio != weight).to(ratio.dtype), mask)  # ()
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {
        "actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": masked_mean(-log_ratio, mask)}


def _centred_product(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """(A - mean A) * (log pi - mean log pi) per token, the means over this micro batch's valid tokens:
    each token's share of the covariance that drives the entropy down (Cui et al. 2025)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))  # (B, T)


@register_policy_loss("clip_cov", keys=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def policy_loss_clip_cov(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float, clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0, generator: torch.Generator | None = None,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped surrogate, and the gradient of a few tokens cut: up to
    max(1, clip_cov_ratio x valid tokens) drawn at random (with `generator`) among those PPO did not clip
    whose covariance term lies in (clip_cov_lb, clip_cov_ub). Per micro batch, as in verl.
    pg_clipfrac is the fraction cut."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    cov = _centred_product(advantages, log_prob, mask)  # (B, T)
    candidates = mask & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)  # (B, T)
    candidate_idx = candidates.flatten().nonzero().squeeze(-1)  # (C,) flat positions
    num_cut = min(max(int(clip_cov_ratio * int(mask.sum())), 1), len(candidate_idx))
    order = torch.randperm(len(candidate_idx), generator=generator).to(candidate_idx.device)  # (C,)
    keep = torch.ones(mask.numel(), dtype=ratio.dtype, device=ratio.device)  # (B*T,)
    keep[candidate_idx[order[:num_cut]]] = 0.0
    keep = keep.view_as(ratio)  # (B, T) 0 where the gradient is cut
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep  # (B, T)
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {
        "actor/pg_clipfrac": masked_mean(1.0 - keep, mask), "actor/ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("kl_cov", keys=("kl_cov_ratio", "ppo_kl_coef"))
def policy_loss_kl_cov(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A * r, plus ppo_kl_coef * |log r| on the
    max(1, kl_cov_ratio x valid tokens) tokens with the largest covariance term. Per micro batch, as in
    verl; actor/ppo_kl is the mean |log r|."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    pg_losses = -advantages * log_ratio.exp()  # (B, T)
    # rank the valid tokens alone, in their flat order, on the CPU, as verl does: among equal covariances
    # torch.topk's pick depends on the list it ranks, so ranking the padded grid chose other tokens
    valid_idx = mask.flatten().nonzero().squeeze(-1)  # (N,) flat positions of the valid tokens
    valid_adv = advantages.flatten()[valid_idx].detach().cpu()  # (N,)
    valid_log_prob = log_prob.flatten()[valid_idx].detach().cpu()  # (N,)
    cov = (valid_adv - valid_adv.mean()) * (valid_log_prob - valid_log_prob.mean())  # (N,) verl's arithmetic
    penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)  # (B*T,)
    if len(valid_idx) > 0:
        top = torch.topk(cov, max(1, int(len(valid_idx) * kl_cov_ratio))).indices  # (k,) into the valid list
        penalised[valid_idx[top.to(valid_idx.device)]] = True
    penalty = ppo_kl_coef * log_ratio.abs()  # (B, T)
    pg_losses = torch.where(penalised.view_as(mask), pg_losses + penalty, pg_losses)  # (B, T)
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {"actor/ppo_kl": masked_mean(log_ratio.abs(), mask)}


@register_policy_loss("gpg")
def policy_loss_gpg(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): plain policy gradient -A * log pi, no ratio and no clipping (pair it with
    algorithm.adv_estimator=gpg). Also REINFORCE, bypass mode's algorithm.rollout_correction.loss_type=reinforce
    (verl's compute_policy_loss_reinforce, the same maths), where old_log_prob is the engine's and
    rollout_is_weights the correction's."""
    mask = response_mask.bool()  # (B, T)
    return _agg(-advantages * log_prob, mask, loss_agg_mode, scale, rollout_is_weights), {
        "actor/ppo_kl": masked_mean(old_log_prob - log_prob.detach(), mask)}


@register_policy_loss("sapo", keys=("tau_pos", "tau_neg"))
def policy_loss_sapo(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean", *, tau_pos: float = 1.0, tau_neg: float = 1.05,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025): a smooth gate instead of PPO's hard clip, -A * (4 / tau) * sigmoid(tau (r - 1)),
    tau = tau_pos where A > 0, else tau_neg (actor.tau_pos / actor.tau_neg). At r = 1 its gradient is
    PPO's; it fades as r leaves 1 rather than dropping to 0. The paper (and verl) aggregate with
    seq-mean-token-mean."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_ratio.dtype)  # (B, T)
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)  # (B, T)
    return _agg(-gate * advantages, mask, loss_agg_mode, scale, rollout_is_weights), {"actor/ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("geo_mean")
def policy_loss_geo_mean(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025): the sequence's loss is -mean_t(A) x the geometric mean of its token ratios,
    each token's log-ratio first clipped to [-clip_ratio_low, clip_ratio_high] on the side its
    advantage's sign pushes (the log-space PPO clip). One loss per sequence, averaged over the mini
    batch's sequences whatever loss_agg_mode says (as verl; the mode still aggregates the entropy and
    KL terms). Rollout-correction weights enter as their geometric mean over the sequence."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    sign = torch.sign(advantages)  # (B, T)
    clipped_log_ratio = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)  # (B, T)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)  # (B, T)
    length = mask.sum(-1).to(log_ratio.dtype) + 1e-8  # (B,)
    seq_ratio = (masked_sum(pessimistic, mask, axis=-1) / length).exp()  # (B,) geometric mean
    seq_adv = masked_sum(advantages, mask, axis=-1) / length  # (B,)
    seq_losses = -seq_adv * seq_ratio  # (B,)
    if rollout_is_weights is not None:
        seq_losses = seq_losses * (masked_sum(torch.log(rollout_is_weights + 1e-10), mask, axis=-1) / length).exp()  # (B,)
    # each valid token holds its sequence's loss: seq-mean-token-mean is then the mean over sequences
    pg_loss = scale.agg(seq_losses.unsqueeze(-1).expand_as(log_ratio), mask, "seq-mean-token-mean")
    clipped = (log_ratio != clipped_log_ratio).to(log_ratio.dtype)  # (B, T)
    return pg_loss, {"actor/pg_clipfrac": masked_mean(clipped * (advantages > 0), mask),
                     "actor/pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), mask),
                     "actor/ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("dro", keys=("dro_beta",))
def policy_loss_dro(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, dro_beta: float | None = None, scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024, verl 0.9.1): the policy gradient -A log pi with a quadratic penalty on the
    log-ratio instead of PPO's clip, -(A log pi - dro_beta / 2 (log pi - log pi_old)^2) per token. dro_beta
    (actor.policy_loss.dro_beta) must be > 0; verl has no default either."""
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"actor.policy_loss.dro_beta={dro_beta} must be > 0 with loss_mode=dro")
    mask = response_mask.bool()  # (B, T)
    log_ratio = log_prob - old_log_prob  # (B, T) squared, not exponentiated: no clamp needed
    pg_losses = -(advantages * log_prob - 0.5 * dro_beta * log_ratio.square())  # (B, T)
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {"actor/ppo_kl": masked_mean(-log_ratio, mask)}


def _dppo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str,
          trusted: Tensor, clip_ratio_c: float, scale: LossScale,
          rollout_is_weights: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's loss given its trust region `trusted` (B, T) bool: -A * sg[min(r, clip_ratio_c)] * log pi on
    the tokens inside it, no gradient outside. pg_clipfrac: the share outside; pg_clipfrac_lower: the
    share inside whose ratio the truncation at clip_ratio_c cut."""
    mask = response_mask.bool()  # (B, T)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    weight = ratio.clamp(max=clip_ratio_c).detach()  # (B, T) truncated IS ratio
    inside = trusted.detach().to(ratio.dtype)  # (B, T)
    pg_losses = -advantages * weight * log_prob * inside  # (B, T)
    return _agg(pg_losses, mask, loss_agg_mode, scale, rollout_is_weights), {
        "actor/pg_clipfrac": masked_mean(1.0 - inside, mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(ratio.dtype) * inside, mask),
        "actor/ppo_kl": masked_mean(-log_ratio, mask)}


@register_policy_loss("dppo_tv")
def policy_loss_dppo_tv(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 3.0,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (Qi et al. 2026): the trust region is on the sampled token's probability itself,
    not its ratio: a token keeps its gradient unless it moved past the threshold the way its advantage
    pushes, pi - pi_old > clip_ratio_high (A > 0) or < -clip_ratio_low (A <= 0). The clip ratios are
    here the TV thresholds (the paper: 0.15); clip_ratio_c truncates the IS ratio (no dual-clip)."""
    change = log_prob.exp() - old_log_prob.exp()  # (B, T)
    trusted = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)  # (B, T)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, trusted, clip_ratio_c, scale,
                 rollout_is_weights)


@register_policy_loss("dppo_kl")
def policy_loss_dppo_kl(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean",
    *, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 3.0,
    scale: LossScale = LossScale(), rollout_is_weights: Tensor | None = None, **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (Qi et al. 2026): as dppo_tv with the KL of the two Bernoulli distributions (the
    sampled token or not) under pi_old and pi, p log(p / q) + (1 - p) log((1 - p) / (1 - q)), as the
    divergence; a token leaves the region when it exceeds clip_ratio_high having moved up with A > 0, or
    clip_ratio_low having moved down with A <= 0 (the paper: 0.05)."""
    p_old, p = old_log_prob.exp(), log_prob.exp()  # (B, T)
    binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    trusted = torch.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                          (binary_kl <= clip_ratio_low) | (p >= p_old))  # (B, T)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, trusted, clip_ratio_c, scale,
                 rollout_is_weights)


def policy_loss(loss_mode: str, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                loss_agg_mode: str = "token-mean", **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Dispatch on actor.policy_loss.loss_mode. Returns (pg_loss, {'actor/...': local metric})."""
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(f"unknown actor.policy_loss.loss_mode={loss_mode!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[loss_mode].fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, **kwargs)


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2). Returns (vf_loss, vf_clipfrac)."""
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # (B, T)
    loss_unclipped = (vpreds - returns) ** 2  # (B, T)
    loss_clipped = (vpreds_clipped - returns) ** 2  # (B, T)
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    vf_loss = 0.5 * agg_loss(
        vf_losses, response_mask, loss_agg_mode, global_num_tokens, global_num_seqs, dp_size, loss_scale_factor
    )
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask)  # ()
    return vf_loss, vf_clipfrac


# --- KL penalty ----------------------------------------------------------------------------------


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio  # unbiased, high variance, can be negative


def _kl_abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _kl_k3(log_ratio: Tensor) -> Tensor:
    # k3 = r - log r - 1 with r = pi_ref / pi: unbiased and >= 0; clamps guard exp blow-ups
    log_r = (-log_ratio).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)


def _straight_through(forward: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """k1+ / k3+ / abs+: the value of k1 / k3 / |log r|, the gradient of k2. k1 and k3 estimate KL without
    bias, but their gradients are not the gradient of KL; k2's is (Schulman's note), so as a loss it steers
    right. k2+ (mse+) is k2 itself: value and gradient both k2's."""

    def estimator(log_ratio: Tensor) -> Tensor:
        backward = _kl_k2(log_ratio)
        return backward - backward.detach() + forward(log_ratio).detach()

    return estimator


# algorithm.kl_penalty / actor.kl_loss_type -> estimator of the log-ratio. A plain literal dict: config.py
# reads its keys from this file's text (to add one, add its entry here)
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "kl": _kl_k1, "k1": _kl_k1, "abs": _kl_abs, "mse": _kl_k2, "k2": _kl_k2, "low_var_kl": _kl_k3, "k3": _kl_k3,
    "k1+": _straight_through(_kl_k1), "k3+": _straight_through(_kl_k3),
    "kl+": _straight_through(_kl_k1), "low_var_kl+": _straight_through(_kl_k3),
    "abs+": _straight_through(_kl_abs), "k2+": _straight_through(_kl_k2), "mse+": _straight_through(_kl_k2),
}


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3)."""
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' needs full-vocabulary logits of both models, which this toolkit does not "
            "keep; use 'low_var_kl' (k3), 'kl' (k1), 'mse' (k2) or 'abs'"
        )
    if kl_penalty not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_penalty={kl_penalty!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kl_penalty](logprob - ref_logprob)  # (B, T) from log pi / pi_ref


_kl_penalty = kl_penalty  # apply_kl_penalty's argument, named like verl's, shadows the function


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl_value: float,
    kl_penalty: str = "kl",
) -> tuple[Tensor, float]:
    """In-reward KL: rewards = scores - beta * KL per token. Returns (token_level_rewards, current_kl).

    current_kl is the per-sequence masked mean KL averaged over the batch: feed it to the
    controller's update(current_kl, n_steps=batch_size).
    """
    mask = response_mask.bool()  # (B, T)
    kld = torch.where(mask, _kl_penalty(old_log_prob, ref_log_prob, kl_penalty), 0.0)  # (B, T)
    token_level_rewards = token_level_scores - kl_ctrl_value * kld  # (B, T)
    current_kl = masked_mean(kld, mask, axis=-1).mean()  # ()
    return token_level_rewards, float(current_kl)


class FixedKLController:
    """Constant KL coefficient (algorithm.kl_ctrl.type=fixed)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """Plain floats, for the training checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient saved by state_dict()."""
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019: steer the coefficient so the measured KL tracks target_kl."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(KL / target - 1, +-0.2) * n_steps / horizon."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # proportional error, clipped
        self.value *= 1.0 + error * n_steps / self.horizon


# --- on-policy distillation (verl's distillation.distillation_loss) ------------------------------
# A frozen teacher scores the student's own samples; its log-probs give a per-token divergence that
# the actor's loss adds (verl 0.9's trainer/distillation/losses.py). Two kinds of loss_mode:
#   a KL estimator of the sampled token (verl's names, KL_ESTIMATORS' forms of log pi_s - log pi_t):
#     the reverse KL(student || teacher) estimated from the token the student sampled;
#   forward_kl_topk: sum over the teacher's top-k tokens of p_t (log p_t - log p_s), the forward KL
#     restricted to the teacher's k most likely tokens (its gradient reaches the student's whole head).
# A plain literal tuple: config.py reads it from this file's text.
DISTILLATION_LOSS_MODES = ("forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def distillation_token_losses(loss_mode: str, student_log_probs: Tensor, teacher_log_probs: Tensor | None = None, *,
                              student_topk_log_probs: Tensor | None = None,
                              teacher_topk_log_probs: Tensor | None = None,
                              log_prob_min_clamp: float | None = None) -> Tensor:
    """Per-token divergence of the student from the teacher, (B, T).

    KL estimators: kl_penalty(student_log_probs, teacher_log_probs, loss_mode), both (B, T) log-probs of
    the sampled tokens. forward_kl_topk: student_topk_log_probs and teacher_topk_log_probs (B, T, k) are
    both models' log-probs of the teacher's top-k tokens; each is first clamped below at
    log_prob_min_clamp (when set), and the sum, which can dip below 0 because k tokens do not hold the
    whole mass, is clamped at 0 (verl's rule)."""
    if loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"unknown distillation loss_mode={loss_mode!r}; valid: {', '.join(DISTILLATION_LOSS_MODES)}")
    if loss_mode != "forward_kl_topk":
        return kl_penalty(student_log_probs, teacher_log_probs, loss_mode)  # (B, T)
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()  # (B, T, k)
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    return (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)  # (B, T)


def distillation_loss(token_losses: Tensor, old_log_prob: Tensor, log_prob: Tensor, response_mask: Tensor,
                      loss_agg_mode: str = "token-mean", *, use_policy_gradient: bool,
                      loss_max_clamp: float | None = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                      rollout_is_weights: Tensor | None = None,
                      scale: LossScale = LossScale()) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation term of the actor's loss from distillation_token_losses' (B, T), with its metrics.

    The token losses are first clamped to [-loss_max_clamp, loss_max_clamp] (when set). Then either
    use_policy_gradient: minus them, detached, are the advantages of PPO's clipped surrogate (the
    vanilla loss, the ratio against old_log_prob; the teacher's signal as a per-token reward); or they
    are the loss itself, aggregated by loss_agg_mode, and back-propagated through the student's
    log-probs. `scale`: the micro batch's LossScale (the module docstring's scaling)."""
    # a share of the mini batch's mean, as the losses are (the module docstring): summed over micro batches
    metrics = {"distillation/abs_loss": agg_loss(token_losses.detach().abs(), response_mask, "token-mean",
                                                 global_num_tokens=scale.num_tokens, dp_size=scale.dp_size)}
    if loss_max_clamp is not None:
        token_losses = token_losses.clamp(-loss_max_clamp, loss_max_clamp)  # (B, T); k1 can be negative
    if not use_policy_gradient:
        return scale.agg(token_losses, response_mask, loss_agg_mode), metrics
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob, log_prob, -token_losses.detach(), response_mask, clip_ratio_low, clip_ratio_high, 3.0,
        loss_agg_mode, **scale.counts(), rollout_is_weights=rollout_is_weights)
    metrics.update({"distillation/pg_clipfrac": clipfrac, "distillation/ppo_kl": ppo_kl,
                    "distillation/pg_clipfrac_lower": clipfrac_lower})
    return loss, metrics


# --- entropy and log-probs from logits (full, or under the engine's top-k / top-p) -----------------


def _rowwise(logits: Tensor, fn: Callable[..., Tensor], chunk_size: int, *per_row: Tensor) -> Tensor:
    """Apply fn to (rows, V) chunks upcast to >= fp32, so temporaries are chunk_size x V, not N x V.
    Each of `per_row` (shape (...), e.g. the labels) is cut into the same rows and passed after the chunk."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V), a view when contiguous
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logsumexp is too coarse
    rows = [t.reshape(-1).split(chunk_size) for t in per_row]  # each (N,) in chunks
    out = torch.cat([fn(chunk.to(dtype), *extra)
                     for chunk, *extra in zip(flat.split(chunk_size), *rows, strict=True)])  # (N,)
    return out.view(logits.shape[:-1])


def sum_pi_squared_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """sum_v softmax(logits)_v^2 per position, (..., V) -> (...), as exp(logsumexp(2x) - 2 logsumexp(x))
    (the optimal token baseline's input)."""

    def sum_sq(x: Tensor) -> Tensor:
        return torch.exp(torch.logsumexp(2 * x, dim=-1) - 2 * torch.logsumexp(x, dim=-1))  # (rows,)

    return _rowwise(logits, sum_sq, chunk_size)


class _LogProbEntropy(torch.autograd.Function):
    """log softmax(logits)[label] and, if asked, the entropy, per row of (N, V) logits, chunk by chunk.
    Backward keeps only the logits (in their own dtype: bf16 on GPU) and three numbers per row (label,
    logsumexp, entropy), and recomputes each chunk's softmax: autograd through the same maths would
    save an fp32 copy of every chunk (x3 with the entropy) for the whole backward."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, calc_entropy: bool,
                chunk_size: int) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logsumexp is too coarse
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(dtype)  # (N,)
        lse, entropy = [], []
        for chunk in logits.split(chunk_size):
            x = chunk.to(dtype)  # (n, V): the only fp32 copy, one chunk at a time
            lse.append(torch.logsumexp(x, dim=-1))  # (n,)
            if calc_entropy:  # logsumexp - E_p[logit]
                entropy.append(lse[-1] - (torch.softmax(x, dim=-1) * x).sum(-1))  # (n,)
        lse_rows = torch.cat(lse)  # (N,)
        entropy_rows = torch.cat(entropy) if calc_entropy else lse_rows.new_empty(0)  # (N,) or (0,)
        ctx.save_for_backward(logits, labels, lse_rows, entropy_rows)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an unused output (the entropy when entropy_coeff=0) gets None
        if not calc_entropy:
            ctx.mark_non_differentiable(entropy_rows)
        return picked - lse_rows, entropy_rows

    @staticmethod
    def backward(ctx: Any, grad_log_prob: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None, None
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype, as autograd's would be
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # two float32 chunks at a time, worked in place (memory_plan.logprob_chunk_bytes counts them)
            log_p = logits[rows] - lse[rows, None]  # (n, V) float32
            chunk_grad = log_p.exp()  # (n, V) p
            if grad_entropy is not None:  # dH / dx = -p (log p + H)
                log_p.add_(entropy[rows, None]).mul_(chunk_grad).mul_(grad_entropy[rows, None])
            if grad_log_prob is not None:  # d log p(label) / dx = onehot(label) - p
                g = grad_log_prob[rows]  # (n,)
                chunk_grad.mul_(-g[:, None]).scatter_add_(-1, labels[rows, None], g[:, None])
            else:
                chunk_grad.zero_()
            if grad_entropy is not None:
                chunk_grad.sub_(log_p)
            grad[rows] = chunk_grad
        return grad, None, None, None


def logprobs_and_entropy(logits: Tensor, labels: Tensor, calc_entropy: bool = False,
                         chunk_size: int = 1024) -> tuple[Tensor, Tensor | None]:
    """(log softmax(logits)[label], entropy of softmax(logits) or None), (..., V), (...) -> (...) each, in
    >= fp32. No full log_softmax copy is made: one chunk of rows is upcast at a time, forward and
    backward (_LogProbEntropy). The entropy's backward runs only if a loss uses it (entropy_coeff != 0);
    otherwise it is a by-product of the forward and no graph holds anything for it."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V), a view when contiguous
    log_prob, entropy = _LogProbEntropy.apply(flat, labels.reshape(-1), calc_entropy, chunk_size)  # (N,) each
    return log_prob.view(logits.shape[:-1]), entropy.view(logits.shape[:-1]) if calc_entropy else None


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per position, (..., V) -> (...), as logsumexp - E_p[logit]."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)  # unused
    return logprobs_and_entropy(logits, labels, calc_entropy=True, chunk_size=chunk_size)[1]


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_size: int = 1024) -> Tensor:
    """log softmax(logits)[label], (..., V), (...) -> (...): gather the label's logit, subtract logsumexp."""
    return logprobs_and_entropy(logits, labels, chunk_size=chunk_size)[0]


def truncation_mask(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Which tokens vLLM's sampler keeps, (N, V) -> (N, V) bool, from logits already divided by the
    temperature. vLLM 0.32's rule (v1/sample/ops/topk_topp_sampler.py): top-k keeps the logits >= the
    k-th largest; then, over those, sorted ascending, top-p drops the tokens whose cumulative
    probability is <= 1 - top_p, and always keeps the largest. top_k <= 0 (or >= V) and top_p >= 1
    switch each off."""
    vocab = logits.shape[-1]
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    if not (use_k or use_p):
        return torch.ones_like(logits, dtype=torch.bool)
    ascending, order = logits.sort(dim=-1)  # (N, V)
    keep = torch.ones_like(ascending, dtype=torch.bool)  # (N, V) in sorted order
    if use_k:
        keep &= ascending >= ascending[:, vocab - top_k:vocab - top_k + 1]  # the k-th largest, ties kept
    if use_p:
        probs = ascending.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # (N, V) over the top-k set
        keep &= probs.cumsum(dim=-1) > 1.0 - top_p
        keep[:, -1] = True  # at least one
    return torch.empty_like(keep).scatter_(-1, order, keep)  # back to vocabulary order


@torch.no_grad()
def truncated_log_probs(logits: Tensor, labels: Tensor, top_k: int, top_p: float, chunk_size: int = 128) -> Tensor:
    """log p(label) under the engine's sampling distribution (vLLM's top-k / top-p cut, see
    rollout_correction.py): softmax over the top-k / top-p set of `logits` (already / temperature),
    (..., V), (...) -> (...). -inf where the label is outside the set. Rows go through in chunks
    upcast to >= fp32, so the sort's temporaries are chunk_size x V. Without gradient: these are data
    (correction weights, the sync check), never a loss, so no graph keeps a chunk for a backward."""

    def kept_log_prob(chunk: Tensor, chunk_labels: Tensor) -> Tensor:
        kept = chunk.masked_fill(~truncation_mask(chunk, top_k, top_p), float("-inf"))  # (n, V)
        return kept.gather(-1, chunk_labels[:, None])[:, 0] - kept.logsumexp(dim=-1)  # (n,)

    return _rowwise(logits, kept_log_prob, chunk_size, labels)


def topk_log_probs(logits: Tensor, k: int, vocab_limit: int | None = None,
                   chunk_size: int = 1024) -> tuple[Tensor, Tensor]:
    """The k largest log softmax(logits) and their token ids, (..., V) -> (..., k) each. The softmax is
    over all V, the top-k over the first vocab_limit ids only (None: all): a model whose embedding is
    padded past its tokenizer never names a padding row. Rows are upcast one chunk at a time."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    values, ids = [], []
    for chunk in flat.split(chunk_size):
        log_p = torch.log_softmax(chunk.to(dtype), dim=-1)[:, :vocab_limit]  # (n, V')
        top = log_p.topk(k, dim=-1)  # (n, k) each
        values.append(top.values)
        ids.append(top.indices)
    shape = (*logits.shape[:-1], k)
    return torch.cat(values).view(shape), torch.cat(ids).view(shape)


def gather_log_probs(logits: Tensor, ids: Tensor, chunk_size: int = 1024) -> Tensor:
    """log softmax(logits) at the given token ids, (..., V), (..., k) -> (..., k), as logprobs_from_logits
    does for one label: the ids' logits less each row's logsumexp, one chunk of rows upcast at a time."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    picked = logits.gather(-1, ids).to(dtype)  # (..., k)
    return picked - _rowwise(logits, lambda x: torch.logsumexp(x, dim=-1), chunk_size)[..., None]  # (..., k)


# --- token-budget micro batches ------------------------------------------------------------------


def token_budget_partitions(seq_lens: Sequence[int], max_token_len: int, min_parts: int = 1) -> list[list[int]]:
    """Row indices of each micro batch: at least `min_parts` of them, none over `max_token_len` tokens,
    their token counts balanced (verl's use_dynamic_bsz; seq_lens are each sample's valid tokens).

    Longest first, each sample goes to the micro batch with the fewest tokens so far (the LPT rule:
    within 4/3 of the best balance). When the lightest cannot take a sample, one more micro batch is
    opened and the packing restarts. Rows within a micro batch keep their batch order.
    """
    if not seq_lens:
        return []
    longest = max(seq_lens)
    if longest > max_token_len:
        raise ValueError(f"a sample has {longest} tokens, more than the micro batch budget {max_token_len}")
    # more micro batches than samples would leave some empty (callers keep min_parts <= len(seq_lens))
    num_parts = min(len(seq_lens), max(min_parts, -(-sum(seq_lens) // max_token_len)))
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    while True:
        parts: list[list[int]] = [[] for _ in range(num_parts)]
        loads = [0] * num_parts
        for i in order:
            lightest = min(range(num_parts), key=loads.__getitem__)
            if loads[lightest] + seq_lens[i] > max_token_len:
                break
            parts[lightest].append(i)
            loads[lightest] += seq_lens[i]
        else:
            return [sorted(p) for p in parts]
        num_parts += 1


def balanced_partitions(seq_lens: Sequence[int], k: int) -> list[list[int]]:
    """Row indices of k parts of equal size (len(seq_lens) / k rows each) whose token sums are as even as
    the Karmarkar-Karp differencing method makes them (verl's get_seqlen_balanced_partitions with
    equal_size=True, which trainer.balance_batch uses to give each data-parallel rank as many tokens).

    Longest first, the rows are cut into runs of k, each run a k-part partial solution with one row per
    part. The two partial solutions whose sums spread most are merged, the heaviest part of one with the
    lightest of the other, until one is left. A merge never spreads more than the wider of its two, so the
    heaviest part is at most the lightest plus (longest - shortest row). Deterministic: ties go by row,
    then by the order the partial solutions were made. Each part's rows are in batch order.
    """
    if k < 1 or len(seq_lens) % k:
        raise ValueError(f"{len(seq_lens)} rows cannot be cut into {k} parts of equal size")
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    # a partial solution: its parts as (tokens, rows), heaviest first
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []  # (-spread, made, parts)
    for made, start in enumerate(range(0, len(order), k)):
        parts = [(seq_lens[i], [i]) for i in order[start:start + k]]  # already heaviest first
        heap.append((parts[-1][0] - parts[0][0], made, parts))
    heapq.heapify(heap)
    made = len(heap)
    while len(heap) > 1:
        _, _, wide = heapq.heappop(heap)
        _, _, other = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(wide, reversed(other), strict=True)]
        merged.sort(key=lambda part: (-part[0], min(part[1])))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], made, merged))
        made += 1
    return [sorted(rows) for _, rows in heap[0][2]] if heap else [[] for _ in range(k)]
