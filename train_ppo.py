"""PPO / GRPO post-training of an LLM: one SPMD program, FSDP2 actor + collocated vLLM, no Ray.

Every rank runs this file top to bottom. It holds an FSDP2 shard of the actor (and critic and
reference model when the algorithm needs them) *and* a shard of a vLLM engine on its rollout
tensor-parallel group, and alternates: sync weights -> generate -> score -> recompute log-probs and
values -> advantages -> update. The device map is verl's (see `python mesh_utils.py --config X`).

    # one CPU box, the tiny embedded demo (what `make demo` runs, after building its assets)
    torchrun --standalone --nproc_per_node=2 train_ppo.py --config configs/tiny_cpu.yaml
    # 1 node x 6 GPUs, GRPO on GSM8K
    torchrun --standalone --nproc_per_node=6 train_ppo.py --config configs/gsm8k_grpo_1node_6gpu.yaml
    # 2 nodes (SLURM): sbatch launch/slurm_multinode.sbatch configs/gsm8k_grpo_2node_6gpu.yaml
    # any key can be overridden: ... actor_rollout_ref.rollout.n=8 trainer.total_training_steps=100

The step's batch is a dict of tensors, one row per sample this rank trains on; it is built in step 2
and grows through the step (B samples on this rank, P = max_prompt_length, R = max_response_length):
    prompts (B, P) left-padded; responses, response_mask, rollout_log_probs (B, R);
    input_ids, attention_mask, position_ids (B, P+R); prompt_index (B,)      <- step 2, generate
    token_level_scores (B, R); reward_baselines (B,) for ReMax               <- step 3, reward
    old_log_probs, ref_log_probs, values (B, R)                              <- step 4
    token_level_rewards, advantages, returns (B, R)                          <- step 5
    rollout_is_weights (B, R); response_mask less rejected tokens            <- step 5b (rollout correction)
The forwards of steps 4 and 6 run on each micro batch's valid tokens only when
actor_rollout_ref.model.use_remove_padding (models.compute_log_probs packs them into one row), and
cut micro batches by token count when actor.use_dynamic_bsz; the tensors above stay padded.
With Ulysses sequence parallelism (actor.ulysses_sequence_parallel_size = sp > 1) the sp ranks of a
group hold the same samples (the group's slices, gathered in step 2) and each runs 1/sp of every
packed sequence; sums over the step's batch then run over the train dp group (mesh_utils.train_dp_group)
so no sample counts twice.

Deliberate simplification: rewards are rule functions (no reward model).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import ppo_core as core
import rollout_correction as rc
import ulysses
from checkpoint import find_resume_path, load_checkpoint, save_checkpoint, step_seed
from config import (
    Config,
    ConfigError,
    check_supported,
    load_config,
    non_defaults,
    sampling_truncates,
    to_yaml,
    unread_keys,
)
from data import Prompt, PromptSampler, load_prompts
from lora import LoraSpec, iter_sync_params, lora_config, sync_modules
from memory_plan import LOADED, OffloadFlags, plan_moves
from mesh_utils import (
    build_meshes,
    check_launch,
    describe,
    gather_in_group,
    init_distributed,
    print0,
    train_dp_group,
    validate,
    write_rank_layout,
)
from models import (
    apply_moves,
    check_model,
    check_sequence_parallel_heads,
    compute_log_probs,
    compute_values,
    default_dtypes,
    iter_full_params,
    load_causal_lm,
    load_value_model,
    make_optimizer,
    optimizer_step,
    padding_fraction,
    token_budget_micro_batches,
)
from rewards import RewardFn, check_data_sources, load_reward_fn, score_batch
from tracking import (
    Tracker,
    machine,
    mean_over_ranks,
    peak_memory_gb,
    plot_metrics,
    reduce_metrics,
    route_library_logs,
    stats,
    summary,
    timed,
    truncate_metrics,
)

if TYPE_CHECKING:
    from vllm import LLM

Batch = dict[str, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="PPO / GRPO with an FSDP2 actor and a collocated vLLM engine. Launch with torchrun.",
        epilog="Plan the layout first, without GPUs: python mesh_utils.py --config CONFIG [key=value ...]. "
        "List every key: python config.py --keys.",
    )
    ap.add_argument("--config", help="YAML file under configs/ (verl key names)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor_rollout_ref.rollout.n=8")
    return ap.parse_args(argv)


# -----------------------------------------------------------------------------
# Advantages: the step a researcher edits most


def compute_advantages(batch: Batch, algo_cfg: Config, kl_ctrl: core.FixedKLController,
                       dp_group: dist.ProcessGroup, total_samples: int, samples_per_prompt: int) -> dict[str, float]:
    """Token-level rewards, advantages (and returns) of this rank's samples, written into `batch`.

    Where each sample's group lives: the ranks of dp_group (mesh_utils.train_dp_group: all ranks, or
    with Ulysses one rank of each sp group) hold the step's samples between them, each once: dp rank r
    holds slice r of them in prompt-major order (a rollout dp group generated a prompt's n samples;
    split_for_training, or dynamic sampling, gave each rank a contiguous slice), so a prompt's samples
    may span neighbouring ranks. Estimators that compare the samples of a prompt
    (compares_group in ppo_core.ADV_ESTIMATORS: GRPO, RLOO, REINFORCE++-baseline, OPO, GPG) all-gather the token rewards,
    masks and prompt indices over dp_group, compute on the step's whole batch as verl's driver does
    (some also use batch-wide statistics: whitening, GPG's scale), and keep this rank's rows. The
    others (GAE, REINFORCE++, ReMax) work per sample; GAE and REINFORCE++ whiten over the whole batch
    through dp_group. The adaptive KL controller also sees the whole batch's KL.
    """
    mask = batch["response_mask"].float()  # (B, R)
    metrics: dict[str, float] = {}
    rewards = batch["token_level_scores"]  # (B, R)
    if algo_cfg.use_kl_in_reward:
        rewards, current_kl = core.apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                                                    kl_ctrl.value, algo_cfg.kl_penalty)
        # mean of the per-sequence KLs over every rank's share, or each rank's coefficient drifts its own way
        kl_total = torch.tensor([current_kl * len(mask), len(mask)], dtype=torch.float64, device=mask.device)
        dist.all_reduce(kl_total, group=dp_group)
        current_kl = (kl_total[0] / kl_total[1]).item()
        metrics["actor/reward_kl_penalty"], metrics["actor/reward_kl_penalty_coeff"] = current_kl, kl_ctrl.value
        kl_ctrl.update(current_kl, n_steps=total_samples)  # the coefficient for the next batch
    batch["token_level_rewards"] = rewards

    estimator = algo_cfg.adv_estimator
    if core.ADV_ESTIMATORS[estimator].compares_group:
        num_rows, length = mask.shape
        all_rewards = gather_in_group(rewards.flatten(), dp_group).view(-1, length)  # (B * dp, R), dp rank order
        all_mask = gather_in_group(mask.flatten(), dp_group).view(-1, length)  # (B * dp, R)
        all_index = gather_in_group(batch["prompt_index"], dp_group)  # (B * dp,)
        # the layout generation promises, checked: a baseline from part of a group is silently wrong
        runs = all_index.view(-1, samples_per_prompt) if len(all_index) % samples_per_prompt == 0 else None
        if runs is None or not bool((runs == runs[:, :1]).all()) or len(set(all_index.tolist())) != len(runs):
            raise RuntimeError(f"{estimator} needs the step's samples in prompt-major order, rollout.n="
                               f"{samples_per_prompt} per prompt; got prompt indices {all_index.tolist()[:24]}...")
        all_adv, _ = core.compute_advantage(
            estimator, token_level_rewards=all_rewards, response_mask=all_mask, index=all_index.tolist(),
            norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo)  # (B * dp, R)
        dp_rank = dist.get_rank(dp_group)
        mine = slice(dp_rank * num_rows, (dp_rank + 1) * num_rows)
        batch["advantages"] = batch["returns"] = all_adv[mine]  # (B, R)
    else:
        batch["advantages"], batch["returns"] = core.compute_advantage(
            estimator, token_level_rewards=rewards, response_mask=mask, values=batch.get("values"),
            gamma=algo_cfg.gamma, lam=algo_cfg.lam, whiten_group=dp_group,
            reward_baselines=batch.get("reward_baselines"))  # (B, R) each
    return metrics


# -----------------------------------------------------------------------------
# Updates: ppo_epochs x mini batches x micro batches, one loop for the actor and the critic


def mini_batches(batch: Batch, *, epochs: int, mini_batch_size: int, micro_batch_size: int, shuffle: bool,
                 generator: torch.Generator, max_token_len: int | None = None) -> Iterator[list[Batch]]:
    """Each optimizer step's mini batch, as its list of micro batches: `epochs` passes over this
    rank's samples, in a fresh random order per pass when `shuffle`. Micro batches hold
    micro_batch_size samples, or, with max_token_len (use_dynamic_bsz), at most that many valid
    tokens, balanced, as many on every rank (models.token_budget_micro_batches; collective)."""
    num_samples = batch["responses"].shape[0]
    for _ in range(epochs):
        order = torch.randperm(num_samples, generator=generator) if shuffle else torch.arange(num_samples)
        for start in range(0, num_samples, mini_batch_size):
            rows = order[start:start + mini_batch_size]
            if max_token_len is None:
                cuts = [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
            else:
                cuts = [rows[part.cpu()] for part in token_budget_micro_batches(batch["attention_mask"][rows],
                                                                                 max_token_len)]
            yield [{k: v[cut] for k, v in batch.items()} for cut in cuts]


LossFn = Callable[[Batch, dict[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_updates(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn, *,
                epochs: int, mini_batch_size: int, micro_batch_size: int, shuffle: bool, generator: torch.Generator,
                grad_clip: float, prefix: str, dp_size: int, loss_scale_factor: int,
                max_token_len: int | None = None, dp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """One optimizer step per mini batch (see mini_batches), gradients accumulated over its micro batches.

    `loss_fn(micro_batch, scale)` returns (loss, terms) and passes `scale` on to ppo_core's losses:
    the mini batch's token and sequence counts summed over dp_group (the dp_size ranks holding distinct
    samples; all ranks when None), so the gradient does not depend on how the mini batch is cut
    (ppo_core's module docstring). With Ulysses, the sp ranks of a group compute the same loss on the
    same samples; FSDP's average over all ranks then averages the sp group's gradients, whose mean is
    the unsplit gradient (ulysses.py), so the scaling is the one of dp_size ranks without sp. Terms
    named `*_loss` are such shares of the mini batch's loss and are summed over micro batches; the
    others are averaged over them. Each is then averaged over the optimizer steps.
    """
    model.train()
    metrics: dict[str, float] = {}
    sums: dict[str, float] = {}
    num_steps = 0
    for micro_batches in mini_batches(batch, epochs=epochs, mini_batch_size=mini_batch_size,
                                      micro_batch_size=micro_batch_size, shuffle=shuffle, generator=generator,
                                      max_token_len=max_token_len):
        num_tokens, num_seqs = core.global_num_tokens_and_seqs([mb["response_mask"] for mb in micro_batches],
                                                                 group=dp_group)
        scale = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, dp_size=dp_size,
                     loss_scale_factor=loss_scale_factor)
        for i, mb in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once per mini batch
            loss, terms = loss_fn(mb, scale)
            # A non-finite loss still goes through backward: its NaN reaches every rank's gradient
            # through the reduce-scatter, so all ranks skip the step together (optimizer_step).
            loss.backward()
            for name, value in terms.items():
                share = value.item() if name.endswith("_loss") else value.item() / len(micro_batches)
                sums[name] = sums.get(name, 0.0) + share
        optimizer_step(model, optimizer, grad_clip, prefix, metrics)
        num_steps += 1
    metrics.update({k: v / num_steps for k, v in sums.items()})
    return metrics


def update_actor(actor: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, actor_cfg: Config, *,
                 temperature: float, mini_batch_size: int, micro_batch_size: int, dp_size: int,
                 loss_scale_factor: int, generator: torch.Generator, max_token_len: int | None = None,
                 use_remove_padding: bool = False, dp_group: dist.ProcessGroup | None = None,
                 sp_group: dist.ProcessGroup | None = None, bypass: Config | None = None,
                 on_policy: Batch | None = None, truncation: tuple[int, float] | None = None) -> dict[str, float]:
    """The policy loss of actor.policy_loss.loss_mode (ppo_core.POLICY_LOSSES), minus the entropy bonus,
    plus the KL loss to the reference model.
    max_token_len: token-budget micro batches (use_dynamic_bsz); use_remove_padding: packed forwards;
    sp_group: Ulysses forwards; dp_group: see run_updates. The batch's rollout_is_weights (decoupled
    rollout correction) weigh the policy loss; with bypass (algorithm.rollout_correction in bypass
    mode) the correction runs here, pi_theta against the engine.

    on_policy (a dict, filled here; see on_policy_shortcut): the update is one epoch of one mini batch,
    so its forward runs on the weights that sampled the batch and the old log-probs are that forward's
    own, detached (the ratio is exactly 1); the batch needs no old_log_probs. What the separate forward
    would have given comes back in on_policy, (B, R) each in batch order: old_log_probs, entropy, and
    with truncation=(top_k, top_p) sampling_log_probs, the log-probs under the engine's cut."""
    num_samples = batch["responses"].shape[0]
    if on_policy is not None and (actor_cfg.ppo_epochs != 1 or num_samples > mini_batch_size):
        raise ValueError(f"update_actor(on_policy=...) needs one epoch of one mini batch; got ppo_epochs="
                         f"{actor_cfg.ppo_epochs}, {num_samples} samples in mini batches of {mini_batch_size}")
    calc_entropy = actor_cfg.entropy_coeff != 0
    clip_low, clip_high = (actor_cfg.clip_ratio if c is None else c for c in (actor_cfg.clip_ratio_low,
                                                                              actor_cfg.clip_ratio_high))
    policy_cfg = actor_cfg.policy_loss
    # the clip ratios, the policy_loss.* keys this mode reads (its registered `keys`), and the step's
    # generator (clip_cov draws its tokens with it); each loss ignores what it does not use
    mode_keys = core.POLICY_LOSSES[policy_cfg.loss_mode].keys
    loss_params = dict(clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=actor_cfg.clip_ratio_c,
                       generator=generator, **{k: policy_cfg[k] for k in mode_keys})

    forward_outputs: list[tuple[torch.Tensor, ...]] = []  # on_policy: (rows, log-probs, entropy[, cut]) per micro batch

    def loss_fn(mb: Batch, scale: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_prob, entropy, *cut = compute_log_probs(
            actor, mb, temperature, len(mb["responses"]), calc_entropy or on_policy is not None,
            use_remove_padding=use_remove_padding, sp_group=sp_group,
            truncation=truncation if on_policy is not None else None)  # (b, R) each, one forward
        if on_policy is not None:  # this forward is the old policy's: its log-probs are the old ones
            mb = dict(mb, old_log_probs=log_prob.detach())
            forward_outputs.append((mb["row_index"], log_prob.detach(), entropy.detach(), *(c.detach() for c in cut)))
        mask = mb["response_mask"]  # (b, R)
        pg_mask, is_weights, terms = mask, mb.get("rollout_is_weights"), {}  # (b, R) each
        if bypass is not None:  # old_log_probs are the engine's: weights and rejection of pi_theta against them
            is_weights, pg_mask, terms = rc.correct_micro_batch(log_prob, mb["old_log_probs"], mask, bypass,
                                                                dp_group)
        if bypass is not None and bypass.loss_type == "reinforce":  # no clipping: the weights do the correcting
            pg_loss, ppo_kl = rc.reinforce_policy_loss(mb["old_log_probs"], log_prob, mb["advantages"], pg_mask,
                                                       is_weights, actor_cfg.loss_agg_mode, **scale)
            terms.update({"actor/pg_loss": pg_loss, "actor/ppo_kl": ppo_kl})
        else:  # in bypass mode the ratio already is pi_theta / pi_engine: no weights on top (verl's ppo_clip)
            pg_loss, pg_metrics = core.policy_loss(
                policy_cfg.loss_mode, mb["old_log_probs"], log_prob, mb["advantages"], pg_mask,
                actor_cfg.loss_agg_mode, **loss_params, **scale,
                rollout_is_weights=None if bypass is not None else is_weights)
            terms.update({"actor/pg_loss": pg_loss, **pg_metrics})
        loss = pg_loss
        if calc_entropy:
            terms["actor/entropy_loss"] = core.agg_loss(entropy, mask, actor_cfg.loss_agg_mode, **scale)
            loss = loss - actor_cfg.entropy_coeff * terms["actor/entropy_loss"]
        if actor_cfg.use_kl_loss:
            kl = core.kl_penalty(log_prob, mb["ref_log_probs"], actor_cfg.kl_loss_type)  # (b, R)
            terms["actor/kl_loss"] = core.agg_loss(kl, mask, actor_cfg.loss_agg_mode, **scale)
            loss = loss + actor_cfg.kl_loss_coef * terms["actor/kl_loss"]
        return loss, terms

    if on_policy is not None:
        batch = dict(batch, row_index=torch.arange(num_samples, device=batch["responses"].device))  # (B,)
    metrics = run_updates(actor, optimizer, batch, loss_fn, epochs=actor_cfg.ppo_epochs,
                          mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size, shuffle=actor_cfg.shuffle,
                          generator=generator, grad_clip=actor_cfg.grad_clip, prefix="actor", dp_size=dp_size,
                          loss_scale_factor=loss_scale_factor, max_token_len=max_token_len, dp_group=dp_group)
    if on_policy is not None:  # the micro batches' outputs, back in batch order
        rows = torch.cat([out[0] for out in forward_outputs])
        names = ("old_log_probs", "entropy", "sampling_log_probs")
        for i, name in enumerate(names[:len(forward_outputs[0]) - 1], start=1):
            on_policy[name] = torch.cat([out[i] for out in forward_outputs])[torch.argsort(rows)]  # (B, R)
    return metrics


def on_policy_shortcut(actor: torch.nn.Module, actor_cfg: Config, algo_cfg: Config, samples_per_rank: int,
                       mini_batch_size_per_rank: int) -> str | None:
    """None when the old log-probs can come from the actor update's own forward, else why they cannot.

    With one epoch of one mini batch the update's forward runs on the weights that sampled the batch,
    so a separate no-grad forward before it would give the same log-probs (verl and TRL take that
    forward's own, detached; the PPO ratio is then exactly 1). Exact only if nothing needs them before
    the update and the training forward equals the no-grad one: not with the KL penalty in the reward
    (the advantages need it), rollout correction's weights or rejections (they change the losses),
    bypass mode (the engine's log-probs are the old ones already), or dropout (train mode differs)."""
    rc_cfg = algo_cfg.rollout_correction
    if rc_cfg.bypass_mode:
        return "algorithm.rollout_correction.bypass_mode: the engine's log-probs are the old ones"
    if actor_cfg.ppo_epochs != 1:
        return f"actor.ppo_epochs={actor_cfg.ppo_epochs}: later epochs train on updated weights"
    if samples_per_rank > mini_batch_size_per_rank:
        return (f"{samples_per_rank} samples per rank in mini batches of {mini_batch_size_per_rank} "
                f"(actor.ppo_mini_batch_size): later mini batches train on updated weights")
    if algo_cfg.use_kl_in_reward:
        return "algorithm.use_kl_in_reward: the advantages need the old log-probs before the update"
    if rc_cfg.rollout_is is not None or rc_cfg.rollout_rs is not None:
        return "algorithm.rollout_correction.rollout_is / rollout_rs: the losses need the weights before the update"
    dropout = [m.p for m in actor.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout or getattr(getattr(actor, "config", None), "attention_dropout", 0.0):
        return "the actor has dropout: its training forward differs from a no-grad one"
    return None


def old_policy_metrics(batch: Batch, sampling_log_probs: torch.Tensor, entropy: torch.Tensor,
                       loss_agg_mode: str) -> dict[str, float]:
    """The sync check (the engine's log-probs of its samples against the actor's, under the same cut)
    and the entropy of the policy that sampled the batch, from the old-log-prob forward's outputs."""
    from rollout import logprob_diff

    diff = logprob_diff(batch["rollout_log_probs"], sampling_log_probs, batch["response_mask"])
    return {"rollout/logprob_diff_mean": diff["logprob_diff_mean"], "rollout/logprob_diff_max": diff["logprob_diff_max"],
            "actor/entropy": core.agg_loss(entropy, batch["response_mask"].float(), loss_agg_mode).item()}


def update_critic(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, critic_cfg: Config, *,
                  epochs: int, shuffle: bool, loss_agg_mode: str, mini_batch_size: int, micro_batch_size: int,
                  dp_size: int, loss_scale_factor: int, generator: torch.Generator, max_token_len: int | None = None,
                  use_remove_padding: bool = False, dp_group: dist.ProcessGroup | None = None,
                  sp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Clipped value loss against the returns; the keywords as for update_actor."""

    def loss_fn(mb: Batch, scale: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        vpreds = compute_values(critic, mb, len(mb["responses"]), use_remove_padding=use_remove_padding,
                                sp_group=sp_group)  # (b, R)
        vf_loss, vf_clipfrac = core.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                                       critic_cfg.cliprange_value, loss_agg_mode, **scale)
        return vf_loss, {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac}

    return run_updates(critic, optimizer, batch, loss_fn, epochs=epochs, mini_batch_size=mini_batch_size,
                       micro_batch_size=micro_batch_size, shuffle=shuffle, generator=generator,
                       grad_clip=critic_cfg.grad_clip, prefix="critic", dp_size=dp_size,
                       loss_scale_factor=loss_scale_factor, max_token_len=max_token_len, dp_group=dp_group)


def batch_metrics(batch: Batch, max_prompt_length: int, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """verl's per-step statistics of this rank's samples (reduce_metrics then combines the ranks).
    Collective over dp_group when the batch has values (the explained variance spans every share)."""
    mask = batch["response_mask"].bool()  # (B, R) less the tokens rollout correction rejected
    lengths = batch["attention_mask"][:, max_prompt_length:].sum(-1)  # (B,) as generated
    prompt_lengths = batch["attention_mask"][:, :max_prompt_length].sum(-1)  # (B,)
    metrics = {**stats("critic/score", batch["token_level_scores"].sum(-1)),
               **stats("critic/rewards", (batch["token_level_rewards"] * mask).sum(-1)),
               **stats("critic/advantages", batch["advantages"][mask]),
               **stats("response_length", lengths), **stats("prompt_length", prompt_lengths),
               "response_length/clip_ratio": (lengths == batch["responses"].shape[1]).float().mean().item(),
               "prompt_length/clip_ratio": (prompt_lengths == max_prompt_length).float().mean().item()}
    if "values" in batch:
        metrics.update(stats("critic/values", batch["values"][mask]))
        metrics.update(stats("critic/returns", batch["returns"][mask]))
        # 1 - Var(returns - values) / Var(returns) over the step's whole batch (every rank's share)
        _, residual_var = core.masked_mean_var(batch["returns"] - batch["values"], mask, dp_group)
        _, returns_var = core.masked_mean_var(batch["returns"], mask, dp_group)
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / (returns_var + 1e-5)).item()
    return metrics


def by_key(per_sample: list[dict[str, float]]) -> dict[str, list[float]]:
    """[{key: value} per sample] -> {key: [values of the samples that have it]}."""
    out: dict[str, list[float]] = {}
    for sample in per_sample:
        for key, value in sample.items():
            out.setdefault(key, []).append(value)
    return out


def count_batch(prompt_index: torch.Tensor, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """batch/num_prompts and batch/num_samples of the data this step trained on, over dp_group's ranks
    (each sample lives on one of them; a prompt's samples may be spread over several)."""
    indices: list[list[int]] = [[] for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather_object(indices, prompt_index.tolist(), group=dp_group)
    return {"batch/num_prompts": len({i for rank_indices in indices for i in rank_indices}),
            "batch/num_samples": sum(len(rank_indices) for rank_indices in indices)}


# -----------------------------------------------------------------------------
# Scores and DAPO's dynamic sampling


def score_samples(reward_fn: RewardFn, tokenizer: Any, share: Batch, prompts: list[Prompt], reward_cfg: Config,
                  max_response_length: int) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """A rule score per sample of `share` (responses, response_mask, prompt_index), (B,), and the reward
    function's extras. With reward_model.reward_manager=dapo, as verl's DAPO manager: each score is also
    an `acc` extra (unless the function returned one), and reward_model.overlong_buffer adds its penalty."""
    rows = [prompts[i] for i in share["prompt_index"].tolist()]
    _, scores, extras = score_batch(reward_fn, tokenizer, share["responses"], share["response_mask"], rows)
    scores = torch.tensor(scores, dtype=torch.float32)  # (B,)
    if reward_cfg.reward_manager == "dapo":
        for sample_extras, score in zip(extras, scores.tolist(), strict=True):
            sample_extras.setdefault("acc", score)
        buffer = reward_cfg.overlong_buffer
        if buffer.enable:
            penalty = core.overlong_penalty(share["response_mask"].sum(-1), max_response_length, buffer.len,
                                            buffer.penalty_factor)  # (B,) <= 0
            scores = scores + penalty
            if buffer.log:
                for sample_extras, value in zip(extras, penalty.tolist(), strict=True):
                    sample_extras.update(overlong_reward=value, overlong=float(value < 0))
    return scores, extras


SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")  # verl's names for the sample's score


def filter_metric(share: Batch, extras: list[dict[str, float]], metric: str) -> torch.Tensor:
    """algorithm.filter_groups.metric per sample, (B,): the score (SCORE_METRICS; the KL penalty comes
    later, so seq_final_reward is the score too, config.check_algorithm refuses it with KL in reward),
    or the reward function's extra output of that name (acc)."""
    if metric in SCORE_METRICS:
        return share["scores"]
    missing = [e for e in extras if metric not in e]
    if missing:
        raise ConfigError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no {metric!r} for some "
            f"samples (one returned {sorted(missing[0]) or 'no extras'}). Use metric=reward, or "
            f"reward_model.reward_manager=dapo, which records each score as `acc`.")
    return torch.tensor([e[metric] for e in extras], dtype=torch.float64)


def dynamic_sampling(generate_and_score: Callable[[int], tuple[Batch, list[dict[str, float]]]], filter_cfg: Config,
                     *, train_batch_size: int) -> tuple[Batch, list[dict[str, float]], dict[str, float]]:
    """DAPO's dynamic sampling (algorithm.filter_groups): generation batches k = 0, 1, ...
    (generate_and_score(k) returns this rank's share, scored) until train_batch_size prompts have groups
    whose metric differs (ppo_core.group_has_spread); at most max_num_gen_batches of them (<= 0: no limit).

    Every rank gathers every sample's metric, so all keep the same prompts: the first train_batch_size
    such prompts, in generation order. Their samples are then all-gathered and rank r keeps slice r in
    prompt-major order, the layout plain generation gives (whole groups when train_batch_size divides by
    the world size). Returns (this rank's share, its extras, metrics train/num_gen_batches and
    train/uniform_group_fraction, the fraction of groups generated this step that were dropped)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    taken: set[int] = set()  # prompts kept this step
    kept: list[tuple[Batch, list[dict[str, float]]]] = []  # this rank's kept rows, per generation batch
    num_groups = num_uniform = 0
    for gen_batch in itertools.count():
        if 0 < filter_cfg.max_num_gen_batches <= gen_batch:
            raise RuntimeError(
                f"dynamic sampling: {gen_batch} generation batches (algorithm.filter_groups.max_num_gen_batches) "
                f"gave {len(taken)} of the data.train_batch_size={train_batch_size} prompts whose samples differ in "
                f"{filter_cfg.metric}; {num_uniform} of {num_groups} groups were uniform. Raise max_num_gen_batches "
                f"or data.gen_batch_size (0: no limit), or use data the policy sometimes solves.")
        share, extras = generate_and_score(gen_batch)
        values = filter_metric(share, extras, filter_cfg.metric)  # (B,)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (share["prompt_index"].tolist(), values.tolist()))
        index = [i for rank_index, _ in everyone for i in rank_index]  # the generation batch, prompt-major
        spread = core.group_has_spread(torch.tensor([v for _, vs in everyone for v in vs], dtype=torch.float64), index)
        now: set[int] = set()
        for prompt, has_spread in dict(zip(index, spread.tolist(), strict=True)).items():  # each prompt once
            num_groups, num_uniform = num_groups + 1, num_uniform + (not has_spread)
            if has_spread and prompt not in taken and len(taken) < train_batch_size:
                taken.add(prompt)
                now.add(prompt)
        rows = [i for i, prompt in enumerate(share["prompt_index"].tolist()) if prompt in now]
        kept.append(({k: v[rows] for k, v in share.items()}, [extras[i] for i in rows]))
        if len(taken) == train_batch_size:
            break
    everyone = [None] * world
    dist.all_gather_object(everyone, kept)
    parts = [everyone[r][k] for k in range(len(kept)) for r in range(world)]  # prompt-major: batch by batch
    samples = {key: torch.cat([part[key] for part, _ in parts]) for key in kept[0][0]}
    all_extras = [e for _, part_extras in parts for e in part_extras]
    per_rank = len(all_extras) // world  # train_batch_size x n / world (mesh_utils.plan_batches)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    metrics = {"train/num_gen_batches": gen_batch + 1, "train/uniform_group_fraction": num_uniform / num_groups}
    return {k: v[mine] for k, v in samples.items()}, all_extras[mine], metrics


# -----------------------------------------------------------------------------
# Validation: each rollout dp group generates for its share of the held-out set


def run_validation(llm: LLM, prompts: list[Prompt], tokenizer: Any, reward_fn: RewardFn, rollout_mesh: DeviceMesh,
                   step: int, sampling: dict[str, Any], out_dir: Path, device: torch.device) -> dict[str, float]:
    """Scores on the whole held-out set (greedy unless rollout.val_kwargs.do_sample), with verl's names:
    val-core/<data_source>/reward/mean@<n> per source, val-aux/<data_source>/<extra>/mean@<n> for a
    reward function's extra outputs, and val/score over everything. Each rollout dp group generates
    for a contiguous share (sizes differ by at most one prompt); its generations go to
    <out_dir>/val_generations/step<N>_dp<g>.jsonl for a person (or a test) to read."""
    from rollout import generate

    dp, dp_rank = rollout_mesh.size(0), rollout_mesh.get_local_rank("dp")
    mine = list(range(len(prompts) * dp_rank // dp, len(prompts) * (dp_rank + 1) // dp))
    generated = generate(llm, [prompts[i].token_ids for i in mine], step=step, prompt_indices=mine, **sampling)
    rows = [prompts[i] for i in generated.prompt_index.tolist()]
    texts, scores, extras = score_batch(reward_fn, tokenizer, generated.responses, generated.response_mask, rows)
    if rollout_mesh.get_local_rank("infer_tp") == 0:
        (out_dir / "val_generations").mkdir(parents=True, exist_ok=True)
        with open(out_dir / "val_generations" / f"step{step}_dp{dp_rank}.jsonl", "w") as f:
            for prompt, text, score in zip(rows, texts, scores, strict=True):
                f.write(json.dumps({"prompt": prompt.text, "response": text, "ground_truth": prompt.ground_truth,
                                    "score": score}) + "\n")
    # Means over every rank's samples; the TP ranks of a group hold the same samples, which leaves means
    # unchanged. mean@n: the mean over all n samples of every prompt.
    n = sampling["n"]
    by_name: dict[str, list[float]] = {"val/score": scores}
    for prompt, score in zip(rows, scores, strict=True):
        by_name.setdefault(f"val-core/{prompt.data_source}/reward/mean@{n}", []).append(score)
    for prompt, sample_extras in zip(rows, extras, strict=True):
        for key, value in sample_extras.items():
            by_name.setdefault(f"val-aux/{prompt.data_source}/{key}/mean@{n}", []).append(value)
    metrics = mean_over_ranks(by_name, "", device)
    count = torch.tensor([len(scores)], dtype=torch.float64, device=device)
    dist.all_reduce(count, group=rollout_mesh.get_group("dp"))  # each group's samples once
    metrics["val/num_samples"] = count.item()
    return metrics


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    # --- config and layout: pure arithmetic, fails before anything heavy -----------------------
    cfg = load_config(args.config, args.overrides)
    data_cfg, algo_cfg, trainer_cfg = cfg.data, cfg.algorithm, cfg.trainer
    model_cfg, actor_cfg = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    rollout_cfg, ref_cfg, critic_cfg = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    rc_cfg = algo_cfg.rollout_correction
    truncated_sampling = sampling_truncates(rollout_cfg)  # the engine samples from a top-k / top-p cut
    check_supported(cfg)  # the config-only checks (nccl_timeout among them) before the process group
    env = init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    dims, plan = validate(cfg, env.world_size)
    check_launch(dims, env)
    out_dir = Path(trainer_cfg.default_local_dir)
    print0("config (keys that differ from the defaults; all of them in "
           f"{out_dir / 'config.yaml'}):\n" + "".join(f"  {k}={v}\n" for k, v in non_defaults(cfg).items()))
    print0(describe(cfg, dims, plan))
    meshes = build_meshes(dims, env.device_type, timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    rank, world, device = env.rank, env.world_size, env.device
    write_rank_layout(out_dir / "layout", rank, meshes)
    # Ulysses: the sp ranks of a group train on the same samples, each on 1/sp of every sequence; the
    # dp group holds each sample once (the whole world when sp=1): the step's sums run over it.
    sp_group = meshes.sp.get_group("sp") if meshes.sp is not None else None
    dp_group = train_dp_group(meshes)
    route_library_logs(out_dir / "logs" / f"rank{rank}.log", rank)
    print0(f"library logs: {out_dir / 'logs'}/rank<r>.log")
    random.seed(trainer_cfg.seed)
    torch.manual_seed(trainer_cfg.seed)

    # --- data and reward -------------------------------------------------------------------------
    from transformers import AutoTokenizer

    check_model(model_cfg.path, data_cfg.max_prompt_length + data_cfg.max_response_length,
                model_cfg.trust_remote_code, env.device_type)
    check_sequence_parallel_heads(model_cfg.path, dims.sp, model_cfg.trust_remote_code, "actor_rollout_ref.model.path")
    if core.ADV_ESTIMATORS[algo_cfg.adv_estimator].needs_critic and critic_cfg.model.path is not None:
        check_sequence_parallel_heads(critic_cfg.model.path, dims.sp, model_cfg.trust_remote_code, "critic.model.path")
    tokenizer = AutoTokenizer.from_pretrained(data_cfg.tokenizer or model_cfg.path,
                                              trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rule_reward = cfg.custom_reward_function.path is None  # the built-in rules need each row's ground truth
    load_kwargs = dict(prompt_key=data_cfg.prompt_key, max_prompt_length=data_cfg.max_prompt_length,
                       filter_overlong=data_cfg.filter_overlong_prompts, truncation=data_cfg.truncation,
                       require_ground_truth=rule_reward)
    train_prompts, overlong = load_prompts(data_cfg.train_files, tokenizer, key="data.train_files", **load_kwargs)
    print0(f"data: {len(train_prompts)} training prompts ({overlong} over data.max_prompt_length="
           f"{data_cfg.max_prompt_length}, {'dropped' if data_cfg.filter_overlong_prompts else 'truncated'})")
    val_prompts = []
    if data_cfg.val_files is not None:
        val_prompts, _ = load_prompts(data_cfg.val_files, tokenizer, key="data.val_files", **load_kwargs)
        val_prompts = val_prompts[:data_cfg.max_val_samples] if data_cfg.max_val_samples else val_prompts
    reward_fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    if rule_reward:  # a data source without a rule fails now, not at the first rollout
        check_data_sources(p.data_source for p in train_prompts + val_prompts)
    # a step draws data.train_batch_size prompts; under dynamic sampling, generation batches of data.gen_batch_size
    size_key = "data.train_batch_size" if data_cfg.gen_batch_size is None else "data.gen_batch_size"
    sampler = PromptSampler(len(train_prompts), data_cfg.gen_batch_size or data_cfg.train_batch_size, data_cfg.seed,
                            data_cfg.shuffle, size_key=size_key)
    epochs_in_steps = sampler.batches_per_epoch * trainer_cfg.total_epochs
    total_steps = trainer_cfg.total_training_steps if trainer_cfg.total_training_steps is not None else epochs_in_steps

    # --- models: actor (+ reference for KL, + critic for GAE), FSDP2 on the FSDP mesh ---------------
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    fsdp_kwargs = dict(device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       trust_remote_code=model_cfg.trust_remote_code)
    if sp_group is not None:  # sdpa, plus the all-to-alls when a forward is given the sp group
        fsdp_kwargs["attn_implementation"] = ulysses.register_ulysses_attention()
    # The actor and critic are plain FSDP2 modules that apply_moves offloads between phases (below);
    # only the reference model, never stepped, streams its shards from the host (CPUOffloadPolicy).
    # With LoRA the actor is the frozen model plus a peft adapter, the only thing trained (lora.py).
    lora_spec = LoraSpec.from_config(model_cfg)
    actor = load_causal_lm(model_cfg.path, meshes.fsdp,
                           reshard_after_forward=actor_cfg.fsdp_config.reshard_after_forward,
                           activation_checkpointing=model_cfg.enable_gradient_checkpointing,
                           wrap=lora_spec.add_adapter if lora_spec else None, **fsdp_kwargs)
    actor_optim, actor_sched = make_optimizer(actor, actor_cfg.optim, total_steps)
    ref, reference_mode = None, contextlib.nullcontext
    if (actor_cfg.use_kl_loss or algo_cfg.use_kl_in_reward) and lora_spec:
        ref, reference_mode = actor, actor.disable_adapter  # the base model, for free: no second copy
    elif actor_cfg.use_kl_loss or algo_cfg.use_kl_in_reward:
        ref = load_causal_lm(model_cfg.path, meshes.fsdp, cpu_offload=ref_cfg.fsdp_config.param_offload,
                             **fsdp_kwargs).eval()
    critic = critic_optim = critic_sched = None
    if core.ADV_ESTIMATORS[algo_cfg.adv_estimator].needs_critic:
        critic = load_value_model(critic_cfg.model.path or model_cfg.path, meshes.fsdp,
                                  reshard_after_forward=critic_cfg.fsdp_config.reshard_after_forward,
                                  activation_checkpointing=critic_cfg.model.enable_gradient_checkpointing,
                                  **fsdp_kwargs)
        critic_optim, critic_sched = make_optimizer(critic, critic_cfg.optim, total_steps)
    kl_ctrl = (core.AdaptiveKLController(algo_cfg.kl_ctrl.kl_coef, algo_cfg.kl_ctrl.target_kl, algo_cfg.kl_ctrl.horizon)
               if algo_cfg.kl_ctrl.type == "adaptive" else core.FixedKLController(algo_cfg.kl_ctrl.kl_coef))

    # --- resume: the latest complete checkpoint (DCP reshards it to this world size) ---------------
    ckpt_models = {"actor": (actor, actor_optim, actor_sched)}
    if critic is not None:
        ckpt_models["critic"] = (critic, critic_optim, critic_sched)
    start_step = 0
    resume_path = find_resume_path(trainer_cfg.resume_mode, out_dir, trainer_cfg.resume_from_path)
    if resume_path is not None:
        state = load_checkpoint(resume_path, ckpt_models)
        start_step = state["step"]
        sampler.load_state_dict(state["sampler"])
        kl_ctrl.load_state_dict(state["kl_ctrl"])
        print0(f"resumed from {resume_path} (step {start_step}, written by {state['world_size']} ranks)")
    if rank == 0:
        truncate_metrics(out_dir / "metrics.jsonl", start_step)

    # --- rollout engine: one vLLM shard per rank, TP over the rows of the rollout mesh ---------------
    import rollout as ro  # imported here: vLLM takes seconds to import, config errors should not wait

    max_model_len = data_cfg.max_prompt_length + data_cfg.max_response_length
    llm = ro.build_rollout_engine(
        model_cfg.path, meshes.rollout, max_model_len=max_model_len,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        dtype="bfloat16" if env.device_type == "cuda" else "float32", enforce_eager=rollout_cfg.enforce_eager,
        cpu_kv_cache_gib=rollout_cfg.cpu_kv_cache_space_gb, max_num_seqs=rollout_cfg.max_num_seqs,
        max_num_batched_tokens=max(rollout_cfg.max_num_batched_tokens, max_model_len),
        trust_remote_code=model_cfg.trust_remote_code)
    length_limits = dict(max_tokens=data_cfg.max_response_length, max_prompt_length=data_cfg.max_prompt_length,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    train_sampling = dict(n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                          top_k=rollout_cfg.top_k, seed=trainer_cfg.seed, **length_limits)
    val_cfg = rollout_cfg.val_kwargs
    val_temperature = val_cfg.temperature
    val_sampling = dict(n=val_cfg.n, temperature=val_temperature if val_cfg.do_sample else 0.0,
                        top_p=val_cfg.top_p, top_k=val_cfg.top_k, seed=trainer_cfg.seed + 7919, **length_limits)
    # A fixed prompt whose greedy log-probs fingerprint the engine's weights, and a fixed sequence (the
    # prompt's first tokens and its last few) whose log-probs under the actor say whether the actor moved.
    probe = train_prompts[0].token_ids
    probe_tail = list(probe[-4:])
    actor_probe = {k: v.to(device) for k, v in vars(ro.pad_rollout(
        [probe], [probe_tail], [[0.0] * len(probe_tail)], [0], len(probe_tail), tokenizer.pad_token_id)).items()}
    stale_check = ro.StaleWeightsCheck(ro.STALE_TOLERANCE[str(param_dtype).removeprefix("torch.")])
    tracker = Tracker(out_dir, trainer_cfg.logger, trainer_cfg.project_name, trainer_cfg.experiment_name,
                      dict(cfg), total_steps, enabled=rank == 0)
    if rank == 0:
        (out_dir / "config.yaml").write_text(to_yaml(cfg))

    # With LoRA, the first sync sends every weight (merged) and later ones only the modules LoRA changes.
    lora_modules = sync_modules(actor, ro.packed_modules(llm)) if lora_spec else None
    synced_once = False

    def sync_and_check() -> float:
        """Actor -> engine, then check that it landed (rollout.StaleWeightsCheck); returns the sync's seconds."""
        nonlocal synced_once
        if lora_spec:
            weights = iter_sync_params(actor, param_dtype, lora_modules if synced_once else None)
        else:
            weights = iter_full_params(actor, dtype=param_dtype)
        seconds = ro.sync_weights(llm, weights, partial=bool(lora_spec) and synced_once)
        synced_once = True
        actor.eval()
        with torch.no_grad():
            actor_log_probs, _ = compute_log_probs(actor, actor_probe, 1.0, 1)  # (1, 4)
        stale_check.check(ro.engine_fingerprint(llm, probe), actor_log_probs.double().cpu())
        return seconds

    def generate_and_score(step: int, gen_batch: int, metrics: dict[str, float]) -> tuple[Batch, list[dict[str, float]]]:
        """This rank's share of one generation batch, on the host: its rollout dp group's prompts, n samples
        each (ro.generate), TP rank r's slice r of them (ro.split_for_training), scored (score_samples).
        For ReMax also `reward_baselines`, the score of each prompt's greedy response, one more generate."""
        sampling = dict(train_sampling, seed=train_sampling["seed"] + 1_000_003 * gen_batch)  # fresh per gen batch
        with timed(metrics, "gen"):
            prompt_indices = sampler.next_batch()  # the same on every rank
            mine = ro.shard_for_dp(prompt_indices, meshes.rollout.get_local_rank("dp"), dims.rollout_dp)
            prompt_ids = [train_prompts[i].token_ids for i in mine]
            generated = ro.generate(llm, prompt_ids, step=step, prompt_indices=mine, **sampling)  # prompt-major
            if core.ADV_ESTIMATORS[algo_cfg.adv_estimator].baseline_rollout == "greedy":
                greedy = ro.generate(llm, prompt_ids, step=step, prompt_indices=mine,
                                     **dict(sampling, n=1, temperature=0.0))  # (prompts of the group,)
        share = dict(vars(ro.split_for_training(generated, meshes.rollout.get_local_rank("infer_tp"), dims.infer_tp)))
        with timed(metrics, "reward"):
            share["scores"], extras = score_samples(reward_fn, tokenizer, share, train_prompts, cfg.reward_model,
                                                    data_cfg.max_response_length)  # (B,)
            if core.ADV_ESTIMATORS[algo_cfg.adv_estimator].baseline_rollout == "greedy":
                greedy_scores, _ = score_samples(reward_fn, tokenizer, vars(greedy), train_prompts, cfg.reward_model,
                                                 data_cfg.max_response_length)
                baseline = dict(zip(greedy.prompt_index.tolist(), greedy_scores.tolist(), strict=True))
                share["reward_baselines"] = torch.tensor([baseline[i] for i in share["prompt_index"].tolist()])  # (B,)
        return share, extras

    def validate_now(step: int) -> dict[str, float]:
        return run_validation(llm, val_prompts, tokenizer, reward_fn, meshes.rollout, step, val_sampling, out_dir,
                              device)

    # Where everything lives in each phase (sync, generate, log_prob, update) follows from the offload
    # flags: memory_plan.placement, the README's table. enter(phase) makes the moves between phases.
    offload_flags = OffloadFlags.from_config(cfg)
    current_phase = LOADED

    def enter(phase: str) -> None:
        nonlocal current_phase
        apply_moves(plan_moves(offload_flags, current_phase, phase), {"actor": actor, "critic": critic},
                    {"actor": actor_optim, "critic": critic_optim}, device, sleep_engine=lambda: ro.sleep(llm))
        current_phase = phase

    # One epoch of one mini batch: the old log-probs are the update forward's own (on_policy_shortcut)
    truncation = (rollout_cfg.top_k, rollout_cfg.top_p) if truncated_sampling else None
    not_on_policy = on_policy_shortcut(actor, actor_cfg, algo_cfg, plan.samples_per_rank, plan.actor_update.mini_batch_size)
    on_policy = not_on_policy is None
    print0("old log-probs: " + ("from the actor update's own forward (one epoch, one mini batch; no separate forward)"
                                if on_policy else f"a separate forward ({not_on_policy})"))

    # --- the loop ----------------------------------------------------------------------------------
    enter("sync")
    consecutive_skips = 0
    for step in range(start_step + 1, total_steps + 1):
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        # Everything random in this step derives from (seed, step, rank): a resumed step repeats exactly.
        torch.manual_seed(step_seed(trainer_cfg.seed, step, rank))
        # the shuffle of the update's mini batches: the same on the sp ranks sharing the samples
        generator = torch.Generator().manual_seed(step_seed(trainer_cfg.seed, step, dist.get_rank(dp_group)))

        # 1. weight sync: the engine samples from the current actor; check the update reached it
        metrics["timing_s/sync_weights"] = sync_and_check()
        if step == start_step + 1 and trainer_cfg.val_before_train and val_prompts:  # on resume, too
            val_metrics = validate_now(start_step)
            print0(f"validation before training: val/score {val_metrics['val/score']:.3f}")
            tracker.log(start_step, val_metrics)
        enter("generate")  # param_offload: the actor's (and critic's) shards to the host for the engine

        # 2-3. generate and score: each rollout dp group samples n responses for its share of the prompts,
        # each rank keeps its slice and scores it (generate_and_score). With algorithm.filter_groups
        # (DAPO's dynamic sampling) generation batches repeat until train_batch_size prompts have groups
        # whose metric differs, and the step trains on exactly those.
        if algo_cfg.filter_groups.enable:
            share, reward_extras, sampling_metrics = dynamic_sampling(
                functools.partial(generate_and_score, step, metrics=metrics), algo_cfg.filter_groups,
                train_batch_size=data_cfg.train_batch_size)
            metrics.update(sampling_metrics)
        else:
            share, reward_extras = generate_and_score(step, 0, metrics)
        enter("log_prob")  # free_cache_engine: the engine sleeps; param_offload: the shards come back
        batch = {k: v.to(device) for k, v in share.items()}
        if sp_group is not None:  # Ulysses: every rank of an sp group trains on the group's slices
            batch = ulysses.gather_rows(batch, sp_group)
        mask = batch["response_mask"].float()  # (B, R)
        lengths = batch["response_mask"].sum(-1)  # (B,)
        scores = batch.pop("scores")  # (B,)
        batch["token_level_scores"] = torch.zeros_like(mask)  # (B, R): the score at each response's last token
        batch["token_level_scores"][torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores

        # 4. old log-probs (and the sync check), reference log-probs, values: no-grad forwards
        actor.eval()
        if rc_cfg.bypass_mode:  # the engine's log-probs are the old ones: one forward less
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif not on_policy:  # (on policy, the actor update's own forward gives them: step 6)
            # The engine's log-probs are of its top-k / top-p cut of the distribution; the actor's of the
            # same cut come from the same forward (sampling_log_probs) for the comparisons with them.
            with timed(metrics, "old_log_prob"), torch.no_grad():
                batch["old_log_probs"], entropy, *cut = compute_log_probs(
                    actor, batch, rollout_cfg.temperature, plan.old_log_prob.micro_batch_size, calc_entropy=True,
                    max_token_len=plan.old_log_prob.max_token_len, use_remove_padding=plan.old_log_prob.use_remove_padding,
                    sp_group=sp_group, truncation=truncation)
            sampling_log_probs = cut[0] if truncated_sampling else batch["old_log_probs"]  # (B, R)
            metrics.update(old_policy_metrics(batch, sampling_log_probs, entropy, actor_cfg.loss_agg_mode))
        if ref is not None:
            with timed(metrics, "ref"), torch.no_grad(), reference_mode():
                batch["ref_log_probs"], _ = compute_log_probs(
                    ref, batch, rollout_cfg.temperature, plan.ref_log_prob.micro_batch_size,
                    max_token_len=plan.ref_log_prob.max_token_len,
                    use_remove_padding=plan.ref_log_prob.use_remove_padding, sp_group=sp_group)
        if critic is not None:
            critic.eval()
            with timed(metrics, "values"), torch.no_grad():
                batch["values"] = compute_values(
                    critic, batch, plan.values.micro_batch_size, max_token_len=plan.values.max_token_len,
                    use_remove_padding=plan.values.use_remove_padding, sp_group=sp_group)

        # 5. advantages
        with timed(metrics, "adv"):
            metrics.update(compute_advantages(batch, algo_cfg, kl_ctrl, dp_group, plan.total_samples, rollout_cfg.n))

        # 5b. rollout correction (decoupled mode): the old actor against the engine over the whole step
        # batch; IS weights for the policy loss, rejected tokens out of every loss (rollout_correction.py)
        if not rc_cfg.bypass_mode and not on_policy:
            with timed(metrics, "rollout_corr"):
                is_weights, batch["response_mask"], rc_metrics = rc.correct_batch(
                    sampling_log_probs, batch["rollout_log_probs"], batch["response_mask"], rc_cfg, dp_group)
            metrics.update(rc_metrics)
            if is_weights is not None:
                batch["rollout_is_weights"] = is_weights  # (B, R)

        # 6. updates: critic first (verl's order), then the actor; Adam's moments may live on the host between
        enter("update")  # optimizer_offload: Adam's state to the device for the steps
        if critic is not None:
            with timed(metrics, "update_critic"):
                metrics.update(update_critic(
                    critic, critic_optim, batch, critic_cfg, epochs=plan.critic_update.epochs,
                    shuffle=plan.critic_update.shuffle, loss_agg_mode=plan.critic_update.loss_agg_mode,
                    mini_batch_size=plan.critic_update.mini_batch_size,
                    micro_batch_size=plan.critic_update.micro_batch_size, dp_size=dims.train_dp,
                    loss_scale_factor=data_cfg.max_response_length, generator=generator,
                    max_token_len=plan.critic_update.max_token_len,
                    use_remove_padding=plan.critic_update.use_remove_padding, dp_group=dp_group, sp_group=sp_group))
            critic_sched.step()
        forward_outputs = {} if on_policy else None  # filled by the update's forward (on_policy_shortcut)
        with timed(metrics, "update_actor"):
            actor_metrics = update_actor(
                actor, actor_optim, batch, actor_cfg, temperature=rollout_cfg.temperature,
                mini_batch_size=plan.actor_update.mini_batch_size, micro_batch_size=plan.actor_update.micro_batch_size,
                dp_size=dims.train_dp, loss_scale_factor=data_cfg.max_response_length, generator=generator,
                max_token_len=plan.actor_update.max_token_len, use_remove_padding=plan.actor_update.use_remove_padding,
                dp_group=dp_group, sp_group=sp_group, bypass=rc_cfg if rc_cfg.bypass_mode else None,
                on_policy=forward_outputs, truncation=truncation)
        if on_policy:  # step 4's checks and 5b's diagnostics (nothing to correct), from the update's forward
            batch["old_log_probs"] = forward_outputs["old_log_probs"]
            sampling_log_probs = forward_outputs.get("sampling_log_probs", batch["old_log_probs"])  # (B, R)
            metrics.update(old_policy_metrics(batch, sampling_log_probs, forward_outputs["entropy"],
                                              actor_cfg.loss_agg_mode))
            with timed(metrics, "rollout_corr"):
                metrics.update(rc.correct_batch(sampling_log_probs, batch["rollout_log_probs"],
                                                batch["response_mask"], rc_cfg, dp_group)[2])
        metrics["actor/on_policy_shortcut"] = float(on_policy)
        enter("sync")  # optimizer_offload: Adam's state back to the host; ready for validation and the next sync
        metrics.update(actor_metrics)
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        actor_sched.step()
        skipped = actor_metrics.get("actor/skipped_steps", 0)
        consecutive_skips = consecutive_skips + 1 if skipped else 0

        # 7. metrics (verl's names), reduced over ranks, and validation
        metrics["timing_s/step"] = time.perf_counter() - step_start
        metrics.update(batch_metrics(batch, data_cfg.max_prompt_length, dp_group))
        # tokens per second per rank: an sp group shares its samples' tokens
        metrics["perf/throughput"] = batch["attention_mask"].sum().item() / dims.sp / metrics["timing_s/step"]
        metrics["perf/max_memory_gb"] = peak_memory_gb(device)
        # of the actor's and reference model's forwards (the critic's follow critic.model.use_remove_padding)
        metrics["perf/padding_fraction"] = padding_fraction(batch["attention_mask"], model_cfg.use_remove_padding)
        metrics.setdefault("actor/skipped_steps", 0)
        metrics = reduce_metrics(metrics, device)
        metrics.update(mean_over_ranks(by_key(reward_extras), "reward_extra/", device))  # a reward fn's extras
        metrics.update(count_batch(batch["prompt_index"], dp_group))
        metrics["batch/ppo_mini_batch_size_per_rank"] = plan.actor_update.mini_batch_size
        metrics["training/epoch"] = sampler.epoch
        if consecutive_skips >= trainer_cfg.max_consecutive_skipped_steps:
            raise RuntimeError(
                f"{consecutive_skips} steps in a row had non-finite actor losses or gradients "
                f"(trainer.max_consecutive_skipped_steps={trainer_cfg.max_consecutive_skipped_steps}); stopping. "
                f"Lower actor_rollout_ref.actor.optim.lr or check the reward function's values."
            )
        if val_prompts and trainer_cfg.test_freq > 0 and (step % trainer_cfg.test_freq == 0 or step == total_steps):
            # validate the weights just trained, not the ones this step sampled from
            sync_and_check()
            with timed(metrics, "testing"):
                metrics.update(validate_now(step))
        tracker.log(step, metrics)

        # 8. checkpoint: sharded, atomic, old ones pruned only after the new one is complete
        if trainer_cfg.save_freq > 0 and (step % trainer_cfg.save_freq == 0 or step == total_steps):
            start = time.perf_counter()
            path = save_checkpoint(out_dir, step, ckpt_models,
                                   {"sampler": sampler.state_dict(), "kl_ctrl": kl_ctrl.state_dict()},
                                   hf_source=(actor.config, tokenizer, *lora_config(actor)),
                                   keep=trainer_cfg.max_actor_ckpt_to_keep)
            print0(f"saved {path} in {time.perf_counter() - start:.1f}s")

    tracker.close()
    if rank == 0:  # every key should have done something; say which did not (a typo'd intent, a dead key)
        unread = unread_keys(cfg)
        (out_dir / "config_unread.json").write_text(json.dumps(unread, indent=1))
        ignored = sorted(set(unread) & set(non_defaults(cfg)))
        if ignored:
            print0(f"warning: this run never read these keys you set: {', '.join(ignored)}")
    if rank == 0 and (out_dir / "metrics.jsonl").is_file():  # the run's summary, also in summary.txt
        png = plot_metrics(out_dir / "metrics.jsonl", out_dir / "metrics.png")
        text = f"{summary(out_dir / 'metrics.jsonl')}\n{machine(device, world)}\n"
        (out_dir / "summary.txt").write_text(text)
        print0(text + f"metrics: {out_dir / 'metrics.jsonl'}, plot: {png}, summary: {out_dir / 'summary.txt'}")
    ro.shutdown(llm)  # stops the engine, then the process group, in the order vLLM needs


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a config the user must change: one clear line, no traceback
        print(f"[rank {os.environ.get('RANK', 0)}] config error: {e}", flush=True)
        raise SystemExit(2) from None
