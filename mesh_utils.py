"""Parallel layout: process-group init, the device map, batch-size normalisation, and a planner.

One SPMD program, three computation domains over the same ranks (verl's fsdp_workers.py):

  FSDP domain     the actor/critic shards. fsdp_size=-1: one group of all ranks, mesh ('fsdp',).
                  fsdp_size=k: HSDP, mesh ('ddp','fsdp') = (world/k, k), k consecutive ranks a group.
  rollout domain  vLLM, mesh ('dp','infer_tp') = (world/tp, tp): rows are TP groups of consecutive
                  ranks, so for 6 ranks and tp=2: [[0,1],[2,3],[4,5]].
  Ulysses domain  only when sp>1, mesh ('dp','sp') = (world/sp, sp).

A separate rollout pool (actor_rollout_ref.hybrid_engine=false, rollout.nnodes > 0; placement.py runs it) takes
ranks of its own after the trainers': the FSDP and Ulysses domains then cover the trainers only, the rollout
domain the pool only (every rank still builds an engine: vLLM's groups span the job; the trainers' stay idle).

All three are views of one world DeviceMesh (`build_meshes`), and all the arithmetic behind them is
pure (`ParallelDims`, `plan_device_map`, `plan_batches`), so that the planner

    python mesh_utils.py --config configs/gsm8k_grpo_1node_6gpu.yaml [key=value ...]

prints the device map and the batch flow of a config, and refuses a bad one, with no process group,
no GPU and no torch import (the launch scripts run it before srun / torchrun); `python memory_plan.py`
adds the memory plan. `validate` is config.check_supported plus this arithmetic; the trainer runs it
too, and checks more (the launch, the data, the models) as it starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from config import Config, ConfigError, adv_estimator_traits, check_supported, describe_verl_keys, load_config

# -----------------------------------------------------------------------------
# Parallel degrees


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every domain; `fsdp` is resolved (-1 -> world). `world_size` counts the ranks that train
    (all of them, collocated); a separate rollout pool (hybrid_engine=false) adds `rollout_ranks` after them."""

    world_size: int
    nnodes: int
    n_gpus_per_node: int
    fsdp: int  # ranks per FSDP group
    infer_tp: int  # ranks per vLLM tensor-parallel group
    sp: int  # ranks per Ulysses sequence-parallel group
    rollout_nnodes: int = 0  # the separate pool's nodes (actor_rollout_ref.rollout.nnodes); 0: collocated
    rollout_per_node: int = 0  # its ranks per node (actor_rollout_ref.rollout.n_gpus_per_node)

    @property
    def rollout_ranks(self) -> int:  # the separate pool's size; 0: the engine is collocated on every rank
        return self.rollout_nnodes * self.rollout_per_node

    @property
    def split(self) -> bool:  # trainers and the rollout pool on different ranks
        return self.rollout_ranks > 0

    @property
    def launched(self) -> int:  # every process of the job: the trainers, then the pool
        return self.world_size + self.rollout_ranks

    @property
    def ddp(self) -> int:  # FSDP replicas (HSDP's outer dimension)
        return self.world_size // self.fsdp

    @property
    def rollout_dp(self) -> int:  # vLLM engines that generate, each for its own prompts
        return (self.rollout_ranks or self.world_size) // self.infer_tp

    @property
    def train_dp(self) -> int:  # ranks holding distinct training samples
        return self.world_size // self.sp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest_multiples(value: int, step: int) -> str:
    lo = max(step, value // step * step)
    hi = lo + step if lo >= value else lo
    return f"{lo}" if lo == hi or lo == value else f"{lo} or {hi}"


def _uses_critic(cfg: Config) -> bool:  # a value model, trained beside the actor
    return adv_estimator_traits(cfg.algorithm.adv_estimator).needs_critic


def _uses_reference(cfg: Config) -> bool:  # a reference model, for a KL term (loss or reward)
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def parallel_dims(cfg: Config, world_size: int | None = None) -> ParallelDims:
    """Check the degrees against the world and the node size; `world_size=None` plans for the config's."""
    t = cfg.trainer
    actor_rollout_ref = cfg.actor_rollout_ref
    nnodes, per_node = t.nnodes, t.n_gpus_per_node
    if nnodes < 1 or per_node < 1:
        raise ConfigError(
            f"trainer.nnodes={nnodes} and trainer.n_gpus_per_node={per_node} must both be >= 1."
        )
    tp = actor_rollout_ref.rollout.tensor_model_parallel_size
    pool_nodes, pool_per_node = rollout_pool(cfg)
    expected = nnodes * per_node + pool_nodes * pool_per_node
    launched = expected if world_size is None else world_size
    if launched != expected:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", launched))  # processes per node, under torchrun
        if pool_nodes:
            raise ConfigError(
                f"torchrun launched {launched} processes but the trainers (trainer.nnodes x trainer.n_gpus_per_node = "
                f"{nnodes} x {per_node}) and the rollout pool (actor_rollout_ref.rollout.nnodes x n_gpus_per_node = "
                f"{pool_nodes} x {pool_per_node}) are {expected}. Launch {expected} processes (--nnodes="
                f"{nnodes + pool_nodes} --nproc_per_node={per_node}, or one machine: --nproc_per_node={expected}), "
                f"or change those keys.")
        raise ConfigError(
            f"torchrun launched {launched} processes but trainer.nnodes x trainer.n_gpus_per_node = "
            f"{nnodes} x {per_node} = {expected}. Launch with --nnodes={nnodes} --nproc_per_node={per_node}, "
            f"or set trainer.nnodes / trainer.n_gpus_per_node to match the launch "
            f"(e.g. trainer.nnodes={launched // local} trainer.n_gpus_per_node={local})."
        )
    world = nnodes * per_node  # the ranks that train
    if pool_nodes:
        check_rollout_pool_layout(world, pool_per_node, tp)
    elif tp < 1 or per_node % tp != 0:
        if tp < 1:
            why = "it must be >= 1"
        elif tp > per_node and nnodes == 1:
            why = f"there would be {world} // {tp} = 0 rollout dp groups"
        elif nnodes == 1:
            why = f"{world} ranks cannot be cut into whole TP groups of {tp}"
        else:
            why = "a TP group would span two nodes (TP traffic must stay on one node's fast links)"
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must divide "
            f"trainer.n_gpus_per_node={per_node}: {why}. Valid values: "
            f"{', '.join(map(str, _divisors(per_node)))}."
        )

    fsdp_size = actor_rollout_ref.actor.fsdp_config.fsdp_size
    if fsdp_size == -1:
        fsdp = world
    elif fsdp_size < 1 or fsdp_size > world or world % fsdp_size != 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} must be -1 (one FSDP group of all "
            f"{world} ranks) or a divisor of the world size {world} (HSDP groups of that many ranks). "
            f"Valid values: -1, {', '.join(map(str, _divisors(world)))}."
        )
    else:
        fsdp = fsdp_size

    sp = actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp < 1 or world % sp != 0 or per_node % sp != 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} must divide both the world size "
            f"{world} and trainer.n_gpus_per_node={per_node} (an sp group shares every activation, so it "
            f"must stay inside one node). Valid values: "
            f"{', '.join(str(d) for d in _divisors(math.gcd(world, per_node)))}."
        )
    critic_sp = cfg.critic.ulysses_sequence_parallel_size
    if _uses_critic(cfg) and critic_sp != sp:
        raise ConfigError(
            f"critic.ulysses_sequence_parallel_size={critic_sp} differs from the actor's "
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}; both train on the same data "
            f"layout, so set them equal (critic.ulysses_sequence_parallel_size={sp})."
        )
    ref_sp = actor_rollout_ref.ref.ulysses_sequence_parallel_size if _uses_reference(cfg) else None
    if ref_sp is not None and ref_sp != sp:
        raise ConfigError(
            f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref_sp} differs from the actor's "
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}: the reference model runs on the "
            f"actor's data layout. Set it to {sp}, or null (the actor's)."
        )
    if sp > 1:  # the sp forward splits packed rows (verl's rule too)
        packing = {"actor_rollout_ref.model.use_remove_padding": actor_rollout_ref.model.use_remove_padding}
        if _uses_critic(cfg):
            packing["critic.model.use_remove_padding"] = cfg.critic.model.use_remove_padding
        for key, value in packing.items():
            if not value:
                raise ConfigError(
                    f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} shards packed sequences, "
                    f"but {key}=false. Set {key}=true, or ulysses_sequence_parallel_size=1."
                )
    return ParallelDims(world, nnodes, per_node, fsdp, tp, sp, pool_nodes, pool_per_node)


def rollout_pool(cfg: Config) -> tuple[int, int]:
    """(nodes, ranks per node) of the separate rollout pool (verl's actor_rollout_ref.rollout.nnodes and
    n_gpus_per_node, null: trainer.n_gpus_per_node's); (0, 0) when the engine is collocated (hybrid_engine)."""
    rollout = cfg.actor_rollout_ref.rollout
    per_node = rollout.n_gpus_per_node if rollout.n_gpus_per_node is not None else cfg.trainer.n_gpus_per_node
    return (rollout.nnodes, per_node) if not cfg.actor_rollout_ref.hybrid_engine else (0, 0)


def check_rollout_pool_layout(trainers: int, pool_per_node: int, tp: int) -> None:
    """The separate pool's TP groups: inside one of its nodes, and (vLLM's external launcher numbers TP groups
    of consecutive ranks over the whole job, and every rank builds an engine) none across the two roles."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp < 1 or pool_per_node % tp != 0:
        raise ConfigError(
            f"{key}={tp} must divide actor_rollout_ref.rollout.n_gpus_per_node={pool_per_node}: "
            f"{'it must be >= 1' if tp < 1 else 'the rollout pool would not cut into whole TP groups, or a TP group would span two of its nodes'}. "
            f"Valid values: {', '.join(map(str, _divisors(pool_per_node)))}; or set rollout.n_gpus_per_node to a "
            f"multiple of {max(tp, 1)}.")
    if trainers % tp != 0:
        raise ConfigError(
            f"{key}={tp} must divide the {trainers} trainer ranks (trainer.nnodes x trainer.n_gpus_per_node): vLLM "
            f"builds its TP groups over the whole job, consecutive ranks, so a group would hold trainer and rollout "
            f"ranks at once. Valid values: {', '.join(str(d) for d in _divisors(math.gcd(trainers, pool_per_node)))}; "
            f"or make the trainer ranks a multiple of {tp}.")


# -----------------------------------------------------------------------------
# Batch-size normalisation (verl: ppo_mini_batch_size *= rollout.n; //= world // sp)


@dataclass(frozen=True)
class ForwardSpec:  # one no-grad forward: old log-probs, reference log-probs, values
    micro_batch_size: int  # samples per micro batch
    max_token_len: int | None  # use_dynamic_bsz: valid tokens per micro batch (budget x sp); None: fixed-size
    use_remove_padding: bool


@dataclass(frozen=True)
class UpdateSpec:  # one model's update, verl's fallbacks to the actor's settings applied
    epochs: int
    mini_batch_size: int  # samples per optimizer step per rank
    micro_batch_size: int  # samples per micro batch (ignored when max_token_len is set)
    max_token_len: int | None
    shuffle: bool
    loss_agg_mode: str
    use_remove_padding: bool
    grad_clip: float
    # fsdp_config.accumulate_unsharded_grads: reduce-scatter once per mini batch, holding the full
    # unsharded gradient between micro batches (False: after every micro batch)
    accumulate_unsharded_grads: bool = False


@dataclass(frozen=True)
class BatchPlan:
    """How one step's prompts become samples, and how each role's forward and update cuts them. Every
    verl "null means the actor's value" is resolved here, once."""

    train_batch_size: int  # prompts per step
    n: int  # samples per prompt
    prompts_per_rollout_group: int
    samples_per_rollout_group: int
    total_samples: int
    samples_per_rank: int  # each training-dp rank's share of the step's samples
    old_log_prob: ForwardSpec  # the actor's (rollout.log_prob_*)
    ref_log_prob: ForwardSpec | None  # ref.log_prob_*; None: no reference model (no KL loss, no KL in reward)
    values: ForwardSpec | None  # the critic's (critic.forward_*); None: no critic
    actor_update: UpdateSpec
    critic_update: UpdateSpec | None  # None: no critic
    # distillation.enabled: the teacher's forward, cut as the reference model's (ref.log_prob_*); None: no teacher
    teacher_log_prob: ForwardSpec | None = None


def _token_budget(key: str, budget: int, sequence_len: int, micro: int, sp: int) -> int:
    """The valid tokens of one micro batch: the per-gpu budget times sp (verl's meaning: the ranks of an
    sp group share each micro batch's tokens). It must hold the longest possible sample."""
    if budget * sp < sequence_len:
        per_sp = f" x ulysses sp {sp}" if sp > 1 else ""
        least = -(-sequence_len // sp)
        raise ConfigError(
            f"{key}={budget}{per_sp} is smaller than one sample can be: data.max_prompt_length + "
            f"data.max_response_length = {sequence_len} tokens, so such a sample fits no micro batch. "
            f"Use at least {least}, e.g. {-(-micro * sequence_len // sp)} (the tokens of {micro} full samples)."
        )
    return budget * sp


def _mini_micro(
    prefix: str, mini: int, micro: int | None, tbs: int, n: int, dims: ParallelDims
) -> tuple[int, int]:
    """One model's mini batch (prompts) as samples per rank, and its micro batch (null: the mini batch), checked."""
    if mini < 1 or mini > tbs or tbs % mini != 0:
        ok = [d for d in _divisors(tbs) if (d * n) % dims.train_dp == 0]
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size={mini} must divide data.train_batch_size={tbs} so every "
            f"optimizer step sees the same number of prompts. Valid values: {', '.join(map(str, ok))}."
        )
    if (mini * n) % dims.train_dp != 0:
        ok = [d for d in _divisors(tbs) if (d * n) % dims.train_dp == 0]
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} = {mini * n} samples "
            f"cannot be split evenly over {dims.train_dp} training ranks (world {dims.world_size} / "
            f"ulysses sp {dims.sp}). Valid values: {', '.join(map(str, ok)) or 'none; change rollout.n'}."
        )
    per_rank = mini * n // dims.train_dp
    micro = per_rank if micro is None else micro
    if micro < 1 or per_rank % micro != 0:
        raise ConfigError(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro} must divide the per-rank mini batch "
            f"{per_rank} (= ppo_mini_batch_size {mini} x n {n} / {dims.train_dp} ranks) so every "
            f"gradient-accumulation step is full. Valid values: {', '.join(map(str, _divisors(per_rank)))}."
        )
    return per_rank, micro



def check_validation_share(num_prompts: int, dims: ParallelDims, max_val_samples: int | None) -> None:
    """Each rollout dp group generates a contiguous share of the validation prompts: every group needs one."""
    if num_prompts < dims.rollout_dp:
        raise ConfigError(
            f"data.val_files: {num_prompts} validation prompt(s) (data.max_val_samples={max_val_samples}) cannot be "
            f"shared by the {dims.rollout_dp} rollout dp groups; use at least {dims.rollout_dp} "
            f"(data.max_val_samples >= {dims.rollout_dp}), or data.val_files=null.")


def plan_batches(cfg: Config, dims: ParallelDims) -> BatchPlan:
    """The seed's arithmetic: 60 prompts -> 3 groups x 20 -> x12 = 720 samples -> 120 per rank."""
    tbs = cfg.data.train_batch_size
    actor_rollout_ref = cfg.actor_rollout_ref
    n = actor_rollout_ref.rollout.n
    if n < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n={n} must be >= 1 (samples per prompt).")
    if adv_estimator_traits(cfg.algorithm.adv_estimator).compares_group and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of the same prompt, "
            f"so actor_rollout_ref.rollout.n={n} must be >= 2 (e.g. rollout.n=8), or use adv_estimator=gae."
        )
    if tbs < 1 or tbs % dims.rollout_dp != 0:
        pool = (f"rollout pool {dims.rollout_ranks}, actor_rollout_ref.rollout.nnodes x n_gpus_per_node" if dims.split
                else f"world {dims.world_size}")
        raise ConfigError(
            f"data.train_batch_size={tbs} must be a positive multiple of the {dims.rollout_dp} rollout dp "
            f"groups ({pool} / actor_rollout_ref.rollout.tensor_model_parallel_size "
            f"{dims.infer_tp}), so every vLLM engine gets the same number of prompts. "
            f"Nearest valid: {_nearest_multiples(tbs, dims.rollout_dp)}."
        )
    total = tbs * n
    # Every rank first takes an equal share of its rollout group's samples (each TP rank a slice), and
    # Ulysses then gathers its sp group's shares: so the samples split over all ranks, not only train_dp.
    if total % dims.world_size != 0:
        step = dims.world_size // math.gcd(n, dims.world_size)
        step = step * dims.rollout_dp // math.gcd(step, dims.rollout_dp)
        where = (f"{dims.world_size} ranks" if dims.sp == 1 else
                 f"{dims.world_size} ranks (each of the {dims.train_dp} training ranks gathers ulysses sp {dims.sp} "
                 f"shares)")
        raise ConfigError(
            f"data.train_batch_size={tbs} x actor_rollout_ref.rollout.n={n} = {total} samples cannot be "
            f"split evenly over {where}. Nearest valid data.train_batch_size: {_nearest_multiples(tbs, step)}."
        )
    per_rank = total // dims.train_dp
    gen = cfg.data.gen_batch_size  # dynamic sampling's generation batch: the same rules as train_batch_size
    if cfg.algorithm.filter_groups.enable and gen is not None and (gen % dims.rollout_dp or gen * n % dims.world_size):
        step = dims.rollout_dp * dims.world_size // math.gcd(dims.rollout_dp, dims.world_size)
        raise ConfigError(
            f"data.gen_batch_size={gen} prompts must split evenly over the {dims.rollout_dp} rollout dp groups and "
            f"x actor_rollout_ref.rollout.n={n} over the {dims.world_size} ranks. Nearest valid: "
            f"{_nearest_multiples(gen, step)}.")

    # Each role's settings; a null key means the actor's value (verl's defaults), resolved here once.
    actor, ref, rollout, critic = actor_rollout_ref.actor, actor_rollout_ref.ref, actor_rollout_ref.rollout, cfg.critic
    packed = actor_rollout_ref.model.use_remove_padding  # the actor's and the reference model's forwards
    sequence_len = cfg.data.max_prompt_length + cfg.data.max_response_length

    def budget(key: str, value: int, dynamic: bool, micro: int) -> int | None:
        """use_dynamic_bsz: micro batches of at most this many valid tokens (checked); else None."""
        return _token_budget(key, value, sequence_len, micro, dims.sp) if dynamic else None

    def resolve(value: Any, default: Any) -> Any:  # a null key means `default` (mostly the actor's value)
        return default if value is None else value

    mini, micro = _mini_micro(
        "actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, tbs, n, dims
    )
    actor_update = UpdateSpec(
        epochs=actor.ppo_epochs, mini_batch_size=mini, micro_batch_size=micro,
        max_token_len=budget("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu,
                             actor.use_dynamic_bsz, micro),
        shuffle=actor.shuffle, loss_agg_mode=actor.loss_agg_mode, use_remove_padding=packed, grad_clip=actor.grad_clip,
        accumulate_unsharded_grads=actor.fsdp_config.accumulate_unsharded_grads)

    lp_micro = rollout.log_prob_micro_batch_size_per_gpu
    if lp_micro < 1 or lp_micro > per_rank:
        raise ConfigError(
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={lp_micro} must be between 1 and "
            f"the {per_rank} samples each rank recomputes log-probs for ({total} samples / {dims.train_dp} "
            f"training ranks). Valid values: 1..{per_rank}, e.g. {min(8, per_rank)}."
        )
    for key, forward_micro in (("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                                ref.log_prob_micro_batch_size_per_gpu),
                               ("critic.forward_micro_batch_size_per_gpu", critic.forward_micro_batch_size_per_gpu)):
        if forward_micro is not None and (forward_micro < 1 or forward_micro > per_rank):
            raise ConfigError(
                f"{key}={forward_micro} must be between 1 and {per_rank} (samples per rank), or null to use "
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu."
            )

    def log_prob_forward(section: Config, prefix: str, micro: int) -> ForwardSpec:
        """The old or reference log-probs: the section's log_prob_* keys, null meaning the actor's."""
        dynamic = resolve(section.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz)
        max_tokens = resolve(section.log_prob_max_token_len_per_gpu, actor.ppo_max_token_len_per_gpu)
        return ForwardSpec(micro, budget(f"{prefix}.log_prob_max_token_len_per_gpu", max_tokens, dynamic, micro), packed)

    old_log_prob = log_prob_forward(rollout, "actor_rollout_ref.rollout", lp_micro)
    ref_log_prob = teacher_log_prob = None
    if _uses_reference(cfg):  # the ref's micro batch: null means the rollout's log-prob one
        ref_log_prob = log_prob_forward(ref, "actor_rollout_ref.ref",
                                        resolve(ref.log_prob_micro_batch_size_per_gpu, lp_micro))
    if cfg.distillation.enabled:  # the teacher is a frozen model beside the reference: its forward is cut alike
        teacher_log_prob = log_prob_forward(ref, "actor_rollout_ref.ref",
                                            resolve(ref.log_prob_micro_batch_size_per_gpu, lp_micro))

    values = critic_update = None
    if _uses_critic(cfg):
        c_mini, c_micro = _mini_micro("critic", resolve(critic.ppo_mini_batch_size, actor.ppo_mini_batch_size),
                                      critic.ppo_micro_batch_size_per_gpu, tbs, n, dims)
        critic_dynamic = resolve(critic.use_dynamic_bsz, actor.use_dynamic_bsz)
        critic_packed = critic.model.use_remove_padding
        critic_update = UpdateSpec(
            epochs=resolve(critic.ppo_epochs, actor.ppo_epochs), mini_batch_size=c_mini, micro_batch_size=c_micro,
            max_token_len=budget("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu, critic_dynamic,
                                 c_micro),
            shuffle=resolve(critic.shuffle, actor.shuffle),
            loss_agg_mode=resolve(critic.loss_agg_mode, actor.loss_agg_mode),
            use_remove_padding=critic_packed, grad_clip=critic.grad_clip,
            accumulate_unsharded_grads=critic.fsdp_config.accumulate_unsharded_grads)
        # the values' forward: null micro batch means the rollout's log-prob one, null budget the critic update's
        v_micro = resolve(critic.forward_micro_batch_size_per_gpu, lp_micro)
        v_tokens = resolve(critic.forward_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu)
        values = ForwardSpec(v_micro, budget("critic.forward_max_token_len_per_gpu", v_tokens, critic_dynamic, v_micro),
                             critic_packed)
    return BatchPlan(
        train_batch_size=tbs,
        n=n,
        prompts_per_rollout_group=tbs // dims.rollout_dp,
        samples_per_rollout_group=tbs // dims.rollout_dp * n,
        total_samples=total,
        samples_per_rank=per_rank,
        old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob,
        values=values,
        actor_update=actor_update,
        critic_update=critic_update,
        teacher_log_prob=teacher_log_prob,
    )


def validate(cfg: Config, world_size: int | None = None) -> tuple[ParallelDims, BatchPlan]:
    """Every layout and batch rule, as pure arithmetic; raises ConfigError before any model loads."""
    check_supported(cfg)
    dims = parallel_dims(cfg, world_size)
    return dims, plan_batches(cfg, dims)


# -----------------------------------------------------------------------------
# The device map as plain lists (what the meshes below must reproduce rank by rank)


@dataclass(frozen=True)
class DeviceMap:
    fsdp_groups: list[list[int]]  # ranks sharding one copy of the model
    ddp_groups: list[list[int]]  # ranks holding the same shard (HSDP replicas); [[r]] each for FSDP
    rollout_tp_groups: list[list[int]]  # one vLLM engine each, row g = rollout dp group g
    sp_groups: list[list[int]]  # ranks training on the same samples, each on 1/sp of every sequence
    node_of_rank: list[int]
    # ranks at the same place in every sp group: between them they hold each training sample once
    # (all ranks when sp=1); the training reductions (loss counts, whitening, GRPO's groups) run over one
    train_dp_groups: list[list[int]]
    # a separate rollout pool: the trainers' own engines, built because vLLM's groups span the whole job, idle
    idle_engine_groups: list[list[int]] = field(default_factory=list)


def _blocks(world: int, size: int) -> list[list[int]]:
    return [list(range(start, start + size)) for start in range(0, world, size)]


def plan_device_map(dims: ParallelDims) -> DeviceMap:
    """Row-major layout, the same order `init_device_mesh` and `_unflatten` use."""
    w = dims.world_size  # the trainers: ranks [0, w); a separate pool: ranks [w, w + rollout_ranks)
    engines = _blocks(dims.launched, dims.infer_tp)
    return DeviceMap(
        fsdp_groups=_blocks(w, dims.fsdp),
        ddp_groups=[list(range(i, w, dims.fsdp)) for i in range(dims.fsdp)],
        rollout_tp_groups=[g for g in engines if g[0] >= w] if dims.split else engines,
        sp_groups=_blocks(w, dims.sp),
        node_of_rank=[r // dims.n_gpus_per_node if r < w else dims.nnodes + (r - w) // dims.rollout_per_node
                      for r in range(dims.launched)],
        train_dp_groups=[list(range(i, w, dims.sp)) for i in range(dims.sp)],
        idle_engine_groups=[g for g in engines if g[0] < w] if dims.split else [],
    )


# -----------------------------------------------------------------------------
# Process group and meshes (the only part that needs torch.distributed)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device_type: str  # "cuda" or "cpu", detected
    device: Any  # torch.device
    local_world_size: int = 1  # processes on this node, as launched (vLLM's CPU platform rewrites the variable)


def init_distributed(timeout_s: int = 1800) -> DistEnv:
    """Init the default process group from torchrun's environment, or as world size 1 under plain python.
    timeout_s (actor_rollout_ref.nccl_timeout) bounds how long any collective waits for a rank.

    On CUDA the group gets NCCL for GPU tensors and gloo for CPU tensors (object collectives,
    CPU-offloaded state); on CPU it is gloo alone. Idempotent.
    """
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        # A plain `python train_ppo.py` run: be rank 0 of 1. vLLM's external launcher reads the
        # same variables, so set them rather than passing them only to init_process_group.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device_type, backend = "cuda", "cuda:nccl,cpu:gloo"
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device_type, backend, device = "cpu", "gloo", torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, local_rank, world, device_type, device,
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _attempt_store(rank: int, world: int, timeout: timedelta) -> Any:
    """The store for this launch attempt, or None to let init_process_group use env://.

    torchrun's agent keeps one TCPStore server for the whole job, restarts included
    (TORCHELASTIC_USE_AGENT_STORE=True), and does not clear it: after `--max-restarts` brings the
    workers back, they would read the dead attempt's process-group keys (its gloo/NCCL addresses)
    and hang or fail connecting to them. Each rank counts its own start-ups in the store; all ranks
    of one attempt get the same count, which prefixes every key of that attempt.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    attempt = store.add(f"train_ppo/starts/rank{rank}", 1)
    return dist.PrefixStore(f"train_ppo/attempt{attempt}", store)


def check_launch(dims: ParallelDims, env: DistEnv) -> None:
    """What torchrun launched must be what the config plans: processes per node included, since
    the node boundaries decide which TP groups stay on one node."""
    local_world = env.local_world_size
    if dims.split:  # one machine for both roles, or nodes of equal size (torchrun starts as many on each)
        if local_world != dims.launched and not local_world == dims.n_gpus_per_node == dims.rollout_per_node:
            raise ConfigError(
                f"torchrun launched {local_world} processes on this node; a split job runs on one machine (all "
                f"{dims.launched}: trainer.nnodes x n_gpus_per_node + actor_rollout_ref.rollout.nnodes x "
                f"n_gpus_per_node) or on nodes of one size: trainer.n_gpus_per_node={dims.n_gpus_per_node} and "
                f"actor_rollout_ref.rollout.n_gpus_per_node={dims.rollout_per_node} equal to --nproc_per_node.")
        return
    if local_world != dims.n_gpus_per_node:
        raise ConfigError(
            f"torchrun launched {local_world} processes on this node but trainer.n_gpus_per_node="
            f"{dims.n_gpus_per_node}. Launch with --nproc_per_node={dims.n_gpus_per_node}, or set "
            f"trainer.n_gpus_per_node={local_world} trainer.nnodes={env.world_size // max(local_world, 1)}."
        )


def node_rank() -> int:
    """This process's node index as torchrun assigned it (GROUP_RANK), 0 outside torchrun."""
    return int(os.environ.get("GROUP_RANK", 0))


@dataclass
class Meshes:
    world: Any  # 1D ('world',): the one mesh every domain below is a view of
    fsdp: Any  # ('fsdp',) or ('ddp','fsdp')
    rollout: Any  # ('dp','infer_tp'): the engines that generate
    sp: Any | None  # ('dp','sp') when sp > 1
    engines: Any = None  # ('dp','infer_tp') over every rank, as vLLM groups them; None: `rollout` (collocated)
    pool_fsdp: Any = None  # ('fsdp',) over a split job's rollout pool: its reward model's shards; None: collocated


def build_meshes(dims: ParallelDims, device_type: str, timeout_s: int | None = None) -> Meshes:
    """One world DeviceMesh, unflattened into each domain by name (needs an initialised group).

    timeout_s (actor_rollout_ref.nccl_timeout) is given to every group the meshes create: new
    subgroups do not inherit the default group's timeout but take torch's default (10 min NCCL,
    30 min gloo). vLLM's own groups keep vLLM's settings.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    world = init_device_mesh(device_type, (dims.launched,), mesh_dim_names=("world",))
    engines = pool_fsdp = None
    if dims.split:  # trainers [0, T), the pool [T, N): meshes over one role each (every rank builds them)
        def over(first: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
            ranks = torch.arange(first, first + math.prod(shape)).reshape(shape)
            return DeviceMesh(device_type, ranks, mesh_dim_names=names)

        engines = world._unflatten(0, (dims.launched // dims.infer_tp, dims.infer_tp), ("dp", "infer_tp"))
        fsdp2d = over(0, (dims.ddp, dims.fsdp), ("ddp", "fsdp"))
        rollout = over(dims.world_size, (dims.rollout_dp, dims.infer_tp), ("dp", "infer_tp"))
        sp = over(0, (dims.train_dp, dims.sp), ("dp", "sp")) if dims.sp > 1 else None
        pool_fsdp = over(dims.world_size, (dims.launched - dims.world_size,), ("fsdp",))
    else:
        fsdp2d = world._unflatten(0, (dims.ddp, dims.fsdp), ("ddp", "fsdp"))
        rollout = world._unflatten(0, (dims.rollout_dp, dims.infer_tp), ("dp", "infer_tp"))
        sp = world._unflatten(0, (dims.train_dp, dims.sp), ("dp", "sp")) if dims.sp > 1 else None
    fsdp = fsdp2d if dims.ddp > 1 else fsdp2d["fsdp"]
    if timeout_s is not None:
        for mesh in (world, fsdp2d, rollout, *(m for m in (sp, engines, pool_fsdp) if m is not None)):
            for name in mesh.mesh_dim_names:
                group = mesh.get_group(name) if mesh.get_coordinate() is not None else None
                if group is not None:  # no public setter yet; this is the one torch's own tests use
                    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    return Meshes(world, fsdp, rollout, sp, engines, pool_fsdp)


def write_rank_layout(out_dir: Path, rank: int, meshes: Meshes) -> None:
    """Each rank records the groups it actually joined (out_dir/rank<r>.json), to compare with the
    planner's map."""
    import torch.distributed as dist

    def ranks(mesh: Any, dim: str) -> list[int]:
        return dist.get_process_group_ranks(mesh.get_group(dim))

    out_dir.mkdir(parents=True, exist_ok=True)
    if meshes.engines is not None:  # a split job: each rank joined one role's meshes
        trains = meshes.fsdp.get_coordinate() is not None
        layout = {"rank": rank, "node_rank": node_rank(), "hostname": os.uname().nodename, "pid": os.getpid(),
                  "role": "trainer" if trains else "rollout",
                  "fsdp_group": ranks(meshes.fsdp, "fsdp") if trains else [],
                  "rollout_tp_group": ranks(meshes.rollout, "infer_tp") if not trains else [],
                  "rollout_dp_rank": meshes.rollout.get_local_rank("dp") if not trains else None}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(layout))
        return
    layout = {"rank": rank, "node_rank": node_rank(), "hostname": os.uname().nodename, "pid": os.getpid(),
              "fsdp_group": ranks(meshes.fsdp, "fsdp"), "rollout_tp_group": ranks(meshes.rollout, "infer_tp"),
              "rollout_dp_rank": meshes.rollout.get_local_rank("dp"),
              "sp_group": ranks(meshes.sp, "sp") if meshes.sp is not None else [rank],
              "train_dp_group": dist.get_process_group_ranks(train_dp_group(meshes))}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(layout))


def train_dp_group(meshes: Meshes) -> Any:
    """The ranks holding distinct training samples that this rank reduces with (the ('dp','sp') mesh's
    dp dimension; the whole world when sp=1). Sums and statistics over the step's batch run over it, so
    the sp ranks sharing samples do not count them twice."""
    import torch.distributed as dist

    if meshes.sp is not None:
        return meshes.sp.get_group("dp") if meshes.sp.get_coordinate() is not None else None
    return dist.group.WORLD  # a split job: the trainers' group instead (placement.Pool.trainer_group)


def _dynamic_sampling_lines(cfg: Config, dims: ParallelDims) -> list[str]:
    """The planner's account of algorithm.filter_groups (DAPO's dynamic sampling), if enabled."""
    filter_groups = cfg.algorithm.filter_groups
    if not filter_groups.enable:
        return []
    gen = cfg.data.gen_batch_size or cfg.data.train_batch_size
    limit = filter_groups.max_num_gen_batches
    return [f"  dynamic sampling: generation batches of data.gen_batch_size={gen} prompts ({gen // dims.rollout_dp} "
            f"per rollout dp group), {f'at most {limit}' if limit > 0 else 'any number'} a step, until "
            f"{cfg.data.train_batch_size} prompts have groups whose {filter_groups.metric} differs; those are "
            f"the samples above"]


# -----------------------------------------------------------------------------
# The planner


def _fmt(groups: list[list[int]]) -> str:
    return "[" + ", ".join("[" + ",".join(map(str, g)) + "]" for g in groups) + "]"


def describe(cfg: Config, dims: ParallelDims, plan: BatchPlan) -> str:
    """The device map and batch flow of a valid config, as a person would want to read it."""
    dm = plan_device_map(dims)
    actor_rollout_ref = cfg.actor_rollout_ref
    w = dims.world_size
    lines = [line for line in [describe_verl_keys(cfg)] if line]
    if dims.split:
        first = dims.launched - dims.rollout_ranks
        lines.append(f"Device map: trainers {dims.nnodes} node(s) x {dims.n_gpus_per_node} = ranks 0..{w - 1}; rollout "
                     f"pool {dims.rollout_nnodes} node(s) x {dims.rollout_per_node} = ranks {first}..{dims.launched - 1}"
                     f" (actor_rollout_ref.hybrid_engine=false, trainer.v1.trainer_mode=separate_async)")
    else:
        lines.append(f"Device map: {dims.nnodes} node(s) x {dims.n_gpus_per_node} devices = world {w}")
    if dims.ddp == 1:
        lines.append(f"  FSDP      fsdp_size={actor_rollout_ref.actor.fsdp_config.fsdp_size}: mesh ('fsdp',) = ({w},), "
                     f"one group {_fmt(dm.fsdp_groups)}")
    else:
        lines.append(f"  FSDP      fsdp_size={dims.fsdp}: HSDP mesh ('ddp','fsdp') = ({dims.ddp},{dims.fsdp}), "
                     f"shard groups {_fmt(dm.fsdp_groups)}, replica groups {_fmt(dm.ddp_groups)}")
    lines.append(f"  rollout   tensor_model_parallel_size={dims.infer_tp}: mesh ('dp','infer_tp') = "
                 f"({dims.rollout_dp},{dims.infer_tp}), TP groups {_fmt(dm.rollout_tp_groups)}")
    if dims.split:
        lines.append(f"  idle      the trainers' engines {_fmt(dm.idle_engine_groups)}: built (vLLM's groups span the "
                     f"job), never synced nor asked to generate; asleep for good where sleep mode exists")
    if dims.sp > 1:
        lines.append(f"  ulysses   sp={dims.sp}: mesh ('dp','sp') = ({dims.train_dp},{dims.sp}), "
                     f"sp groups {_fmt(dm.sp_groups)} (each trains on one set of samples, 1/{dims.sp} of every "
                     f"sequence per rank), train dp groups {_fmt(dm.train_dp_groups)}")
    else:
        lines.append("  ulysses   off (ulysses_sequence_parallel_size=1)")
    if dims.split:
        lines.append("  rank  node  role     fsdp_group  rollout_dp  infer_tp_rank  train_dp_rank")
        for r in range(dims.launched):
            trains = r < w
            lines.append(f"  {r:>4}  {dm.node_of_rank[r]:>4}  {'trainer' if trains else 'rollout':<7}  "
                         f"{r // dims.fsdp if trains else '-':>10}  {'-' if trains else (r - w) // dims.infer_tp:>10}  "
                         f"{'-' if trains else (r - w) % dims.infer_tp:>13}  {r // dims.sp if trains else '-':>13}")
    else:
        lines.append("  rank  node  local  fsdp_group  rollout_dp  infer_tp_rank  train_dp_rank")
        for r in range(w):
            lines.append(f"  {r:>4}  {dm.node_of_rank[r]:>4}  {r % dims.n_gpus_per_node:>5}  {r // dims.fsdp:>10}  "
                         f"{r // dims.infer_tp:>10}  {r % dims.infer_tp:>13}  {r // dims.sp:>13}")
    for g, ranks in enumerate(dm.rollout_tp_groups):
        lines.append(f"  rollout group {g}: ranks {ranks} on node {dm.node_of_rank[ranks[0]]}")
    p, mini_prompts = plan, actor_rollout_ref.actor.ppo_mini_batch_size
    lines += [
        "Batch flow per step:",
        f"  data.train_batch_size={p.train_batch_size} prompts -> {dims.rollout_dp} rollout dp groups x "
        f"{p.prompts_per_rollout_group} prompts",
        f"  x rollout.n={p.n} -> {p.samples_per_rollout_group} samples per group, {p.total_samples} in all",
        *_split_flow_lines(cfg, dims),
        f"  training: {p.total_samples} samples / {dims.train_dp} dp ranks (world {w} / sp {dims.sp}) = "
        f"{p.samples_per_rank} per rank",
        *_dynamic_sampling_lines(cfg, dims),
        f"  actor mini batch: ppo_mini_batch_size={mini_prompts} x n={p.n} = {mini_prompts * p.n} -> / "
        f"{dims.train_dp} = {p.actor_update.mini_batch_size} per rank; "
        f"{p.samples_per_rank // p.actor_update.mini_batch_size} optimizer step(s) per ppo epoch",
        *_role_lines(p, dims.sp),
    ]
    return "\n".join(lines)


def _split_flow_lines(cfg: Config, dims: ParallelDims) -> list[str]:
    """The planner's account of a separate rollout pool's step: what moves where, and how stale."""
    if not dims.split:
        return []
    sep = cfg.trainer.v1.separate_async
    ahead = ("sequential: the pool waits for each update (staleness 0)" if sep.num_warmup_batches == 0 else
             "one step off: the pool samples step t+1's batch with the weights one update old while the trainers "
             "update on step t's (staleness 1)")
    return [f"  the pool scores its samples, then hands them to the {dims.world_size} trainer ranks (rank order: "
            f"trainer r takes slice r, as collocated rank r would); {ahead}",
            f"  after each update trainer 0 broadcasts the weights to the pool in buckets "
            f"({sep.parameter_sync_step} actor update(s) per sync: trainer.v1.separate_async.parameter_sync_step)"]


def _role_lines(plan: BatchPlan, sp: int) -> list[str]:
    """Each role's forward or update as the trainer runs it, verl's null-means-the-actor's resolved."""
    def tokens(max_token_len: int | None) -> str:  # use_dynamic_bsz's budget per micro batch, else "-"
        if max_token_len is None:
            return "-"
        return f"{max_token_len}" if sp == 1 else f"{max_token_len} ({max_token_len // sp}/gpu)"

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    lines = ["Per role (sizes in samples per rank; null keys resolved to the actor's values, as verl does):",
             f"  {'forward':<14} {'micro':>5} {'micro steps':>11}  {'token budget':<18} packed"]
    forwards = {"old log-probs": plan.old_log_prob, "ref log-probs": plan.ref_log_prob,
                "teacher": plan.teacher_log_prob, "values": plan.values}
    for name, f in forwards.items():
        if f is not None:
            steps = "-" if f.max_token_len is not None else str(-(-plan.samples_per_rank // f.micro_batch_size))
            lines.append(f"  {name:<14} {f.micro_batch_size:>5} {steps:>11}  {tokens(f.max_token_len):<18} "
                         f"{yes(f.use_remove_padding)}")
    lines.append(f"  {'update':<14} {'epochs':>6} {'mini':>5} {'micro':>5} {'accum steps':>11}  {'token budget':<18} "
                 f"{'shuffle':<7}  {'loss_agg_mode':<23} {'grad_clip':>9}  packed")
    for name, u in {"actor": plan.actor_update, "critic": plan.critic_update}.items():
        if u is not None:
            accum = "-" if u.max_token_len is not None else str(u.mini_batch_size // u.micro_batch_size)
            lines.append(f"  {name:<14} {u.epochs:>6} {u.mini_batch_size:>5} {u.micro_batch_size:>5} {accum:>11}  "
                         f"{tokens(u.max_token_len):<18} {yes(u.shuffle):<7}  {u.loss_agg_mode:<23} "
                         f"{u.grad_clip:>9}  {yes(u.use_remove_padding)}")
    lines.append("  token budget (use_dynamic_bsz): valid tokens per micro batch, per gpu x sp; the micro size then "
                 "does not apply")
    return lines


def plan_arguments(description: str, example: str) -> argparse.ArgumentParser:
    """The planners' command line (this file's and memory_plan.py's): a config, overrides, a world size, --json."""
    ap = argparse.ArgumentParser(description=description, epilog=f"example: {example}")
    ap.add_argument("--config", help="YAML file under configs/ (default: built-in defaults)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="plan for this many processes (default: trainer.nnodes x trainer.n_gpus_per_node)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    return ap


def plan_from_args(args: argparse.Namespace) -> tuple[Config, ParallelDims, BatchPlan] | None:
    """The config plan_arguments' command line names, and its plan; None, the error on stderr, if invalid."""
    try:
        cfg = load_config(args.config, args.overrides)
        return (cfg, *validate(cfg, args.world_size))
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = plan_arguments("Explain and validate the device map and batch flow of a config, with no GPU and no "
                        "process group (the memory plan too: memory_plan.py). Exits 1 with the reason when the "
                        "config is invalid.",
                        "python mesh_utils.py --config configs/gsm8k_grpo_1node_6gpu.yaml "
                        "actor_rollout_ref.actor.fsdp_config.fsdp_size=3")
    args = ap.parse_args(argv)
    planned = plan_from_args(args)
    if planned is None:
        return 1
    cfg, dims, plan = planned
    if args.json:
        print(json.dumps({"dims": asdict(dims), "device_map": asdict(plan_device_map(dims)), "batch": asdict(plan)},
                         indent=1))
    else:
        print(describe(cfg, dims, plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
