"""PPO / GRPO post-training of an LLM: one SPMD program, FSDP2 actor + collocated vLLM, no Ray.

Every rank runs this file. It holds an FSDP2 shard of the actor (and critic and reference model when
the algorithm needs them) *and* a shard of a vLLM engine on its rollout tensor-parallel group, and
alternates: sync weights -> generate -> score -> log-probs and values -> advantages -> update.
The device map is verl's (`python mesh_utils.py --config X`; with memory: `python memory_plan.py`).

    # one CPU box, the tiny embedded demo (what `make demo` runs, after building its assets)
    torchrun --standalone --nproc_per_node=2 train_ppo.py --config configs/tiny_cpu.yaml
    # 1 node x 6 GPUs, GRPO on GSM8K
    torchrun --standalone --nproc_per_node=6 train_ppo.py --config configs/gsm8k_grpo_1node_6gpu.yaml
    # 2 nodes (SLURM): sbatch launch/slurm_multinode.sbatch configs/gsm8k_grpo_2node_6gpu.yaml
    # any key can be overridden: ... actor_rollout_ref.rollout.n=8 trainer.total_training_steps=100

The file reads in execution order: `Run` (every piece of state a run holds, listed once; the engine's in
`Engine`) -> `train_step` (steps 1-8) -> `train` (the loop) and `main` -> the functions the steps call, in
step order -> set-up (`build_run` makes the `Run` whole).

The step's batch is a dict of tensors, one row per sample this rank trains on (B samples on this
rank, P = max_prompt_length, R = max_response_length):
    prompts (B, P) left-padded; responses, response_mask, rollout_log_probs (B, R);
    rollout_versions (B, R): the weight version of each token (colocate_async and separate_async only)
    input_ids, attention_mask, position_ids (B, P+R); prompt_index (B,)      <- step 2, generate
    token_level_scores (B, R); reward_baselines (B,) for ReMax               <- step 3, reward
    old_log_probs, ref_log_probs, values (B, R)                              <- step 4
    routed_experts (B, P+R, layers, top_k): a MoE's routes, router_replay R2 <- step 4, old log-probs
    teacher_log_probs (B, R), or teacher_topk_log_probs / _ids (B, R, k)     <- step 4, distillation
    token_level_rewards, advantages, returns (B, R)                          <- step 5
    rollout_is_weights (B, R); response_mask less rejected tokens            <- step 5b (rollout correction)
attention_mask marks every real token; response_mask (the loss mask) the tokens the policy sampled.
With Ulysses (actor.ulysses_sequence_parallel_size = sp > 1) the sp ranks of a group hold the same
samples, and sums over the step's batch run over the train dp group, so no sample counts twice.
Before step 4, trainer.balance_batch deals the step's samples anew over that group, as many tokens on
each rank (balance_batch): rows are then in no particular order, and everything keys on prompt_index.

With trainer.v1.trainer_mode=separate_async (docs/split_placement.md) ranks [0, T) train and ranks [T, N)
generate: the pool runs serve_rollouts (weights in, batches scored and handed out), the trainers train_step
with their batch from the pool (placement.py: the roles' groups, the hand-off, the weights' broadcast).

Scores come from a rule function or, with reward_model.enable, a learned reward model (reward_model.py);
validation always scores with the rule function, as verl does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import eval_metrics
import placement
import ppo_core as core
import reward_remote
import rollout
import rollout_correction
import run_dir
import ulysses
import vision
import watchdog
from agent_loop import MultiTurnStats, TurnLimits, generate_multi_turn
from checkpoint import (
    STATE_FILE,
    abandon_later,
    resume_checkpoint,
    save_checkpoint,
    step_seed,
)
from collectives import failing_together, gather_items, gather_rows, my_rows
from config import (
    Config,
    ConfigError,
    check_supported,
    check_vision_run,
    load_config,
    non_defaults,
    policy_loss_key,
    sampling_truncates,
    shown,
    to_yaml,
    unread_keys,
)
from data import Prompt, PromptSampler, load_prompts
from lora import LoraSpec, iter_sync_params, lora_config, sync_modules
from mesh_utils import (
    BatchPlan,
    DistEnv,
    Meshes,
    ParallelDims,
    UpdateSpec,
    build_meshes,
    check_launch,
    check_validation_share,
    describe,
    init_distributed,
    train_dp_group,
    validate,
    write_rank_layout,
)
from models import (
    GATHER_BUCKET_BYTES,
    apply_moves,
    check_model,
    check_sequence_parallel_heads,
    check_teacher,
    compute_log_probs,
    compute_values,
    default_dtypes,
    freeze_vision_tower,
    iter_full_params,
    load_causal_lm,
    load_frozen_model,
    load_value_model,
    make_optimizer,
    optimizer_step,
    padding_fraction,
    read_model_config,
    set_optimizer_config,
    token_budget_micro_batches,
)
from moe import RouterLogits, RouterReplay, check_router_replay, engine_names, load_balancing_loss
from offload import LOADED, PHASES, OffloadFlags, plan_moves
from reward_model import RewardModel
from rewards import (
    RewardError,
    RewardFn,
    check_code_sandbox,
    check_data_sources,
    filter_metric,
    load_reward_fn,
    score_batch,
    score_samples,
)
from tracking import (
    Tracker,
    add_token_fields,
    batch_metrics,
    count_batch,
    machine,
    mean_over_ranks,
    peak_memory_gb,
    plot_metrics,
    print0,
    reduce_metrics,
    route_library_logs,
    sample_records,
    stats,
    summary,
    timed,
    truncate_metrics,
    values_by_key,
    write_samples,
)

if TYPE_CHECKING:
    from vllm import LLM

Batch = dict[str, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="PPO / GRPO with an FSDP2 actor and a collocated vLLM engine. Launch with torchrun.",
        epilog="Plan the layout first, without GPUs: python mesh_utils.py --config CONFIG [key=value ...] "
        "(with the memory plan: python memory_plan.py ...). List every key: python config.py --keys.",
    )
    ap.add_argument("--config", help="YAML file under configs/ (verl key names)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor_rollout_ref.rollout.n=8")
    return ap.parse_args(argv)


# -----------------------------------------------------------------------------
# The run: every piece of state a run holds, listed once (build_run makes it whole)


@dataclass
class Engine:
    """The rollout engine and what talks to it, built whole by build_engine."""

    llm: LLM
    settings: dict[str, Any]  # what the engine was built with (engine_settings)
    train_sampling: rollout.Sampling
    val_sampling: rollout.Sampling
    probe: list[int]  # a prompt whose greedy log-probs fingerprint the engine
    actor_probe: Batch  # its last tokens, for the actor's side of that check
    stale_check: rollout.StaleWeightsCheck
    lora_modules: set[str] | None  # with LoRA: what syncs after the first (full) sync
    synced_once: bool = False


@dataclass
class InFlight:
    """trainer.v1.trainer_mode=colocate_async: this rollout dp group's samples between steps (unfinished, or in
    complete groups not trained yet), and the prompts drawn from the sampler but not dispatched (the same on
    every rank). Plain host data, saved in checkpoints (in_flight_state)."""

    warmup_batches: int  # trainer.v1.colocate_async.num_warmup_batches
    threshold: int  # trainer.v1.sampler.max_off_policy_threshold
    strategy: str  # trainer.v1.sampler.max_off_policy_strategy
    trajectories: list[rollout.Trajectory] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: Config) -> InFlight | None:
        v1 = cfg.trainer.v1
        if v1.trainer_mode != "colocate_async":
            return None
        return cls(v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold,
                   v1.sampler.max_off_policy_strategy)


@dataclass
class Run:
    """Everything a run holds between steps; build_run makes it whole, train_step and train use it."""

    cfg: Config
    env: DistEnv
    dims: ParallelDims
    plan: BatchPlan
    meshes: Meshes
    dp_group: dist.ProcessGroup  # the ranks holding distinct samples: sums over the step's batch run here
    sp_group: dist.ProcessGroup | None  # Ulysses: the ranks sharing each sample's sequence
    out_dir: Path
    tokenizer: Any
    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    reward_fn: RewardFn
    sampler: PromptSampler
    total_steps: int
    actor: torch.nn.Module
    actor_optim: torch.optim.Optimizer
    actor_sched: Any
    actor_loss: ActorLoss
    ref: torch.nn.Module | None  # the reference model for a KL term; with LoRA the actor, adapter off
    reference_mode: Callable[[], contextlib.AbstractContextManager]
    critic: torch.nn.Module | None
    critic_optim: torch.optim.Optimizer | None
    critic_sched: Any
    kl_ctrl: core.FixedKLController
    lora_spec: LoraSpec | None
    param_dtype: torch.dtype
    offload: OffloadFlags
    old_log_probs_from: str  # "engine" | "update" | "forward" (old_log_prob_source)
    rollout_data_dir: Path | None  # trainer.rollout_data_dir: each step's samples; None: not written
    validation_data_dir: Path  # trainer.validation_data_dir (null: <out_dir>/val_generations)
    start_step: int  # the checkpoint's step (resume), else 0
    engine: Engine
    tracker: Tracker
    progress: watchdog.Progress  # off (watchdog.Progress(None)) unless build_run(watch=True)
    lock: run_dir.RunLock | None  # rank 0: the run directory's lock (run_dir.py)
    stop: run_dir.StopRequests  # SIGTERM / SIGUSR2 (build_run(watch=True)) or <out_dir>/stop: save, then stop
    fingerprint: dict[str, Any]  # what the checkpoints are trained with (run_dir.fingerprint)
    placement: str  # the memory phase the models and engine are placed for (offload.placement)
    multi_turn: MultiTurn | None = None  # actor_rollout_ref.rollout.multi_turn.enable: tools and their replies
    reward_model: RewardModel | None = None  # reward_model.enable: it scores the training samples
    teacher: torch.nn.Module | None = None  # distillation.enabled: the frozen teacher, beside the reference
    teacher_vocab_limit: int | None = None  # the ids its top-k may name: the tokenizer's (models.check_teacher)
    in_flight: InFlight | None = None  # trainer.v1.trainer_mode=colocate_async: the samples carried between steps
    # trainer.v1.trainer_mode=separate_async: this rank's role and the groups between the roles (placement.py);
    # a rollout rank holds no model (actor, critic, ... are None) and runs serve_rollouts instead of train
    pool: placement.Pool | None = None
    vision: vision.VisionRun | None = None  # a vision-language model: its processor and the ids never sampled
    generated_ahead: placement.Part | None = None  # a pool rank: the batch generated ahead, from the checkpoint
    consecutive_skips: int = 0

    @property
    def train_group(self) -> dist.ProcessGroup | None:  # the ranks that train (None: every rank)
        return self.pool.trainer_group if self.pool is not None else None

    def checkpointed(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]]:
        return checkpointed(self)


def checkpointed(models: Models | Run) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]]:
    """What a checkpoint holds of the models: the actor's and the critic's model, optimizer and schedule."""
    out = {"actor": (models.actor, models.actor_optim, models.actor_sched)}
    if models.critic is not None:
        out["critic"] = (models.critic, models.critic_optim, models.critic_sched)
    return out


# -----------------------------------------------------------------------------
# One step


def train_step(run: Run, step: int) -> dict[str, float]:
    """Steps 1-7 of one PPO / GRPO iteration; returns its metrics, reduced over ranks (verl's names).
    Validation and the checkpoint (8) follow in train."""
    cfg, plan = run.cfg, run.plan
    algo_cfg, actor_cfg = cfg.algorithm, cfg.actor_rollout_ref.actor
    metrics: dict[str, float] = {}
    step_start = time.perf_counter()
    # Everything random in this step derives from (seed, step, rank): a resumed step repeats exactly.
    torch.manual_seed(step_seed(cfg.trainer.seed, step, run.env.rank))
    # the shuffle of the update's mini batches: the same on the sp ranks sharing the samples
    generator = torch.Generator().manual_seed(step_seed(cfg.trainer.seed, step, dist.get_rank(run.dp_group)))

    # 1. weight sync: the engine samples from the current actor; check the update reached it
    enter(run, step, "sync")  # every rank records its phases: a hang names the rank behind
    metrics["timing_s/sync_weights"] = sync_weights(run)
    enter(run, step, "generate")  # param_offload: the actor's (and critic's) shards to the host for the engine

    # 2-3. generate and score: each rollout dp group samples n responses for its prompts, each rank
    # keeps its slice and scores it. With algorithm.filter_groups (DAPO's dynamic sampling) generation
    # batches repeat until train_batch_size prompts have groups whose metric differs.
    if run.pool is not None:  # separate_async: the rollout pool generated and scored them (serve_rollouts)
        rows, reward_extras = receive_rollouts(run, metrics)
    elif algo_cfg.filter_groups.enable:
        rows, reward_extras, sampling_metrics = dynamic_sampling(
            functools.partial(rollout_step, run, step, metrics=metrics), algo_cfg.filter_groups,
            train_batch_size=cfg.data.train_batch_size)
        metrics.update(sampling_metrics)
    else:
        rows, reward_extras = rollout_step(run, step, 0, metrics)
    enter(run, step, "log_prob")  # free_cache_engine: the engine sleeps; param_offload: the shards come back
    rows.pop("fn_scores")  # dynamic sampling's `score` metric has been read
    batch = {k: v.to(run.env.device) for k, v in rows.items()}
    if run.sp_group is not None:  # Ulysses: every rank of an sp group trains on the group's slices
        batch = ulysses.gather_rows(batch, run.sp_group)
        reward_extras = gather_items(reward_extras, run.sp_group)  # the extras stay beside their rows
    check_generated_layout(batch["prompt_index"], plan.n, run.dp_group)
    if "rollout_versions" in batch:  # colocate_async, separate_async: tokens of older weights, within the bound
        metrics.update(check_versions(batch, step, cfg.trainer.v1.sampler.max_off_policy_threshold,
                                      run.old_log_probs_from, run.dp_group))
    if cfg.trainer.balance_batch:  # verl's: as many tokens on every dp rank, for the forwards and the update
        with timed(metrics, "balance_batch"):
            batch, reward_extras, balance_metrics = balance_batch(batch, reward_extras, run.dp_group)
        metrics.update(balance_metrics)
    batch["token_level_scores"] = place_scores(batch.pop("scores"), batch["response_mask"])  # (B, R)
    if run.vision is not None:  # a VLM: each row's pixels and grids, and its 4-row positions (once per sample)
        batch.update(run.vision.batch_columns(run.actor, batch, run.train_prompts))

    # 4. old log-probs (run.old_log_probs_from), reference log-probs, values: no-grad forwards
    old = None
    # trainer.critic_warmup: the actor is not updated before that step (verl's `critic_warmup <= global_steps`)
    update_actor_now = step >= cfg.trainer.critic_warmup
    if run.old_log_probs_from == "engine":  # bypass mode: one forward less
        batch["old_log_probs"] = batch["rollout_log_probs"]
    elif run.old_log_probs_from == "forward" or not update_actor_now:  # no update forward to take them from
        with timed(metrics, "old_log_prob"):
            old = old_policy_forward(run, batch)
        batch["old_log_probs"] = old.old_log_probs
        if old.sum_pi_squared is not None:  # the optimal token baseline's input
            batch["sum_pi_squared"] = old.sum_pi_squared
        if old.routed_experts is not None:  # router_replay R2: the update's forwards take these experts
            batch["routed_experts"] = old.routed_experts
    if run.ref is not None:
        spec = plan.ref_log_prob
        with timed(metrics, "ref"), torch.no_grad(), run.reference_mode():
            batch["ref_log_probs"] = compute_log_probs(
                run.ref, batch, run.actor_loss.temperature, spec.micro_batch_size, max_token_len=spec.max_token_len,
                use_remove_padding=spec.use_remove_padding, sp_group=run.sp_group, dp_group=run.dp_group).log_probs
    if run.teacher is not None:
        with timed(metrics, "teacher"):
            batch.update(teacher_log_probs(run, batch))
    if run.critic is not None:
        spec = plan.values
        run.critic.eval()
        with timed(metrics, "values"), torch.no_grad():
            batch["values"] = compute_values(run.critic, batch, spec.micro_batch_size, max_token_len=spec.max_token_len,
                                             use_remove_padding=spec.use_remove_padding, sp_group=run.sp_group,
                                             dp_group=run.dp_group)

    # 5. advantages
    with timed(metrics, "adv"):
        components = reward_components(reward_extras, algo_cfg.gdpo_reward_keys, run.env.device)  # gdpo's
        metrics.update(compute_advantages(batch, algo_cfg, run.kl_ctrl, run.dp_group, plan.total_samples,
                                          plan.n, components))
    # 5b. the sync check, and rollout correction (decoupled mode): the old actor against the engine over
    # the whole step batch; IS weights for the policy loss, rejected tokens out of every loss
    if old is not None:
        metrics.update(check_old_policy(batch, old, run.actor_loss.correction, actor_cfg.loss_agg_mode,
                                        run.dp_group, version=step - 1))

    # 6. updates: critic first (verl's order), then the actor; Adam's moments may live on the host between
    enter(run, step, "update")  # optimizer_offload: Adam's state to the device for the steps
    if run.critic is not None:
        with timed(metrics, "update_critic"):
            metrics.update(update_critic(run.critic, run.critic_optim, batch, plan.critic_update, generator,
                                         cfg.critic.cliprange_value, cfg.data.max_response_length, run.dp_group,
                                         run.sp_group))
        run.critic_sched.step()
    if update_actor_now:  # during the critic's warm-up no actor metric, and its schedule does not advance
        with timed(metrics, "update_actor"):
            actor_metrics, update_old = update_actor(run.actor, run.actor_optim, batch, run.actor_loss,
                                                     plan.actor_update, generator, run.dp_group, run.sp_group,
                                                     own_old_log_probs=run.old_log_probs_from == "update")
        if update_old is not None:  # 5b's checks, from the update's forward
            old = update_old
            batch["old_log_probs"] = old.old_log_probs
            metrics.update(check_old_policy(batch, old, run.actor_loss.correction, actor_cfg.loss_agg_mode,
                                            run.dp_group, version=step - 1))
        metrics["actor/on_policy_shortcut"] = float(run.old_log_probs_from == "update")
        metrics.update(actor_metrics)
        metrics["actor/lr"] = run.actor_sched.get_last_lr()[0]
        run.actor_sched.step()
        run.consecutive_skips = run.consecutive_skips + 1 if actor_metrics.get("actor/skipped_steps", 0) else 0
    move_to(run, "sync")  # optimizer_offload: Adam's state back to the host; ready for the next sync
    if run.rollout_data_dir is not None:  # the step's samples, their advantages, the engine-vs-actor gaps
        with timed(metrics, "dump_rollout_generations"):
            dump_rollouts(run, step, batch, reward_extras, old)

    # 7. metrics (verl's names), reduced over ranks
    metrics["timing_s/step"] = time.perf_counter() - step_start
    metrics.update(step_metrics(run, batch, metrics["timing_s/step"]))
    metrics.setdefault("actor/skipped_steps", 0)
    metrics = reduce_metrics(metrics, run.env.device, run.train_group)
    metrics.update(mean_over_ranks(values_by_key(reward_extras), "reward_extra/", run.env.device, run.train_group))
    metrics.update(count_batch(batch["prompt_index"], run.dp_group))
    metrics["batch/ppo_mini_batch_size_per_rank"] = plan.actor_update.mini_batch_size
    metrics["training/epoch"] = run.sampler.epoch if run.pool is None else metrics["training/epoch"]  # the pool's
    limit = cfg.trainer.max_consecutive_skipped_steps
    if run.consecutive_skips >= limit:
        raise RuntimeError(
            f"{run.consecutive_skips} steps in a row had non-finite actor losses or gradients "
            f"(trainer.max_consecutive_skipped_steps={limit}); stopping. "
            f"Lower actor_rollout_ref.actor.optim.lr or check the reward function's values.")
    return metrics


# -----------------------------------------------------------------------------
# The loop


def train(run: Run) -> None:
    """Validation before training, then every step from the checkpoint on, each followed by validation
    and a checkpoint when they are due (8)."""
    tc = run.cfg.trainer  # build_run placed the models for the first sync
    if run.pool is not None and not run.pool.is_trainer:  # separate_async: this rank generates for the trainers
        serve_rollouts(run)
        return
    if tc.val_before_train and run.val_prompts and run.start_step < run.total_steps:  # on resume, too
        enter(run, run.start_step, "validate")
        val_metrics = validate_on_engine(run, run.start_step)
        print0(f"validation before training: val/score {val_metrics['val/score']:.3f}")
        run.tracker.log(run.start_step, val_metrics)
    for step in range(run.start_step + 1, run.total_steps + 1):
        metrics = train_step(run, step)
        last = step == run.total_steps
        if validation_due(run, step):
            enter(run, step, "validate")
            with timed(metrics, "testing"):  # the weights just trained, not the ones this step sampled from
                metrics.update(validate_on_engine(run, step))
        run.tracker.log(step, metrics)
        stopping = not last and stop_requested(run, step)
        if save_due(run, step) or stopping:
            enter(run, step, "save", timeout_s=save_budget_s(run))
            save(run, step)
        if stopping:
            break


def validation_due(run: Run, step: int) -> bool:
    """trainer.test_freq: every k steps and at the last (when there is a validation set)."""
    freq = run.cfg.trainer.test_freq
    return bool(run.val_prompts) and freq > 0 and (step % freq == 0 or step == run.total_steps)


def validate_on_engine(run: Run, step: int) -> dict[str, float]:
    """The weights trained so far into the engine(s), then run_validation. In a split job every rank calls it:
    trainer 0 sends the weights, the pool generates and scores the held-out set, and its first rank hands the
    metrics to every rank."""
    if run.pool is None:
        sync_weights(run)
        return run_validation(run, step)
    if run.pool.is_trainer:
        sync_weights(run)  # placement.send_weights
    else:
        receive_weights(run)
    metrics = [run_validation(run, step) if not run.pool.is_trainer else None]
    dist.broadcast_object_list(metrics, src=run.pool.leader)
    return metrics[0]


def save_due(run: Run, step: int) -> bool:
    """trainer.save_freq: every k steps and at the last."""
    freq = run.cfg.trainer.save_freq
    return freq > 0 and (step % freq == 0 or step == run.total_steps)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    check_supported(cfg)  # the config-only checks (nccl_timeout among them) before the process group
    env = init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    run = build_run(cfg, env, watch=True)
    train(run)
    run.progress.stop()
    finish(run)
    rollout.shutdown(run.engine.llm)  # stops the engine, then the process group, in the order vLLM needs


# -----------------------------------------------------------------------------
# Phase boundaries: the watchdog's progress line and the memory placement


def enter(run: Run, step: int, phase: str, timeout_s: float | None = None) -> None:
    """A phase boundary, in one verb: the rank's progress line (the watchdog names a hung rank and its phase;
    timeout_s: the phase's own budget) and, for a memory phase (offload.PHASES), the placement of models,
    optimizer states and engine."""
    run.progress.enter(step, phase, timeout_s)
    if phase in PHASES:
        move_to(run, phase)


def move_to(run: Run, phase: str) -> None:
    """Place models, optimizer states and engine for `phase` (offload.placement, from the offload flags)."""
    llm = run.engine.llm if run.pool is None else None  # a split job's trainers: their engine sleeps for good
    place(run, run.offload, run.placement, phase, run.env.device, llm)
    run.placement = phase


def place(models: Models | Run, offload: OffloadFlags, src: str, dst: str, device: torch.device,
          llm: LLM | None) -> None:
    """The moves from placement `src` to `dst` (offload.plan_moves) of the actor, the critic, their
    optimizer states and the engine, if there is one yet."""
    # LoRA's syncs after the first send only the modules it changes: the engine keeps its other weights
    level = rollout.sleep_level(partial_sync=bool(models.lora_spec))
    apply_moves(plan_moves(offload, src, dst), {"actor": models.actor, "critic": models.critic},
                {"actor": models.actor_optim, "critic": models.critic_optim}, device,
                sleep_engine=functools.partial(rollout.sleep, llm, level) if llm is not None else None)


# -----------------------------------------------------------------------------
# 1. Weight sync


def sync_weights(run: Run) -> float:
    """Actor -> engine, then check that it landed (rollout.StaleWeightsCheck); the sync's seconds.
    With LoRA the first sync sends every weight (merged), later ones only the modules LoRA changes."""
    engine = run.engine
    if run.lora_spec:
        weights = iter_sync_params(run.actor, run.param_dtype, engine.lora_modules if engine.synced_once else None)
    else:
        weights = iter_full_params(run.actor, dtype=run.param_dtype)
    weights = engine_names(run.actor, weights)  # a MoE's checkpoint names, which the engine loads
    if run.pool is not None:  # separate_async: trainer 0 broadcasts them to the pool, which checks they landed
        start = time.perf_counter()
        run.actor.eval()
        with torch.no_grad():
            actor_log_probs = compute_log_probs(run.actor, engine.actor_probe, 1.0, 1).log_probs  # (1, 4)
        placement.send_weights(run.pool, weights, actor_log_probs.double().cpu(), GATHER_BUCKET_BYTES)
        engine.synced_once = True  # the pool's engines got every weight once: LoRA's later syncs send its modules
        return time.perf_counter() - start
    seconds = rollout.sync_weights(engine.llm, weights, partial=bool(run.lora_spec) and engine.synced_once)
    engine.synced_once = True
    run.actor.eval()
    with torch.no_grad():
        actor_log_probs = compute_log_probs(run.actor, engine.actor_probe, 1.0, 1).log_probs  # (1, 4)
    engine.stale_check.check(rollout.engine_fingerprint(engine.llm, engine.probe), actor_log_probs.double().cpu())
    return seconds


# -----------------------------------------------------------------------------
# 2-3. Generate and score; DAPO's dynamic sampling


def dynamic_sampling(generate_and_score: Callable[[int], tuple[Batch, list[dict[str, float]]]], filter_cfg: Config,
                     *, train_batch_size: int, group: dist.ProcessGroup | None = None
                     ) -> tuple[Batch, list[dict[str, float]], dict[str, float]]:
    """DAPO's dynamic sampling (algorithm.filter_groups): generation batches k = 0, 1, ...
    (generate_and_score(k) returns this rank's rows, scored) until train_batch_size prompts have groups
    whose metric differs (ppo_core.group_has_spread); at most max_num_gen_batches (<= 0: no limit).
    Every rank of group (the ranks that generate: every rank, or a split job's pool) sees every sample's metric,
    so all keep the same prompts, the first train_batch_size in generation order; rank r of the group then
    keeps slice r of their samples, prompt-major (as plain generation). Returns (this rank's rows, their
    extras, train/num_gen_batches and train/uniform_group_fraction)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
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
        rows, extras = generate_and_score(gen_batch)
        values = filter_metric(rows["scores"], rows["fn_scores"], extras, filter_cfg.metric)  # (B,)
        every_rank: list[Any] = [None] * world
        dist.all_gather_object(every_rank, (rows["prompt_index"].tolist(), values.tolist()), group=group)
        index = [i for rank_index, _ in every_rank for i in rank_index]  # the generation batch, prompt-major
        spread = core.group_has_spread(torch.tensor([v for _, vs in every_rank for v in vs], dtype=torch.float64),
                                       index)
        now: set[int] = set()
        for prompt, has_spread in dict(zip(index, spread.tolist(), strict=True)).items():  # each prompt once
            num_groups, num_uniform = num_groups + 1, num_uniform + (not has_spread)
            if has_spread and prompt not in taken and len(taken) < train_batch_size:
                taken.add(prompt)
                now.add(prompt)
        keep = [i for i, prompt in enumerate(rows["prompt_index"].tolist()) if prompt in now]
        kept.append(({k: v[keep] for k, v in rows.items()}, [extras[i] for i in keep]))
        if len(taken) == train_batch_size:
            break
    every_rank = [None] * world
    dist.all_gather_object(every_rank, kept, group=group)
    parts = [every_rank[r][k] for k in range(len(kept)) for r in range(world)]  # prompt-major: batch by batch
    samples = {key: torch.cat([part[key] for part, _ in parts]) for key in kept[0][0]}
    all_extras = [e for _, part_extras in parts for e in part_extras]
    per_rank = len(all_extras) // world  # train_batch_size x n / world (mesh_utils.plan_batches)
    my_slice = slice(rank * per_rank, (rank + 1) * per_rank)
    metrics = {"train/num_gen_batches": gen_batch + 1, "train/uniform_group_fraction": num_uniform / num_groups}
    return {k: v[my_slice] for k, v in samples.items()}, all_extras[my_slice], metrics


def rollout_step(run: Run, step: int, gen_batch: int,
                 metrics: dict[str, float]) -> tuple[Batch, list[dict[str, float]]]:
    """One generation batch for this rank, on the host: its rollout dp group's prompts, n samples each,
    TP rank r's slice r of them, scored (`scores`, (B,)); for ReMax also `reward_baselines`, the score
    of each prompt's greedy response."""
    cfg, rollout_mesh = run.cfg, run.meshes.rollout
    sampling = run.engine.train_sampling.for_batch(gen_batch)  # fresh seeds per generation batch
    baseline_rollout = core.ADV_ESTIMATORS[cfg.algorithm.adv_estimator].baseline_rollout
    versions = None
    with timed(metrics, "gen"):
        if run.in_flight is not None:  # colocate_async: carried samples resumed, the step's batch cut from the stream
            (generated, versions), turn_stats = stream_rollout(run, step, metrics), None
        else:
            prompt_indices = run.sampler.next_batch()  # the same on every rank
            group_indices = rollout.shard_for_dp(prompt_indices, rollout_mesh.get_local_rank("dp"),
                                                 run.dims.rollout_dp)
            group_prompts = [run.train_prompts[i] for i in group_indices]
            generated, turn_stats = generate(run, group_prompts, group_indices, step, sampling)  # prompt-major
            if baseline_rollout == "greedy":
                greedy, greedy_stats = generate(run, group_prompts, group_indices, step, sampling.greedy())
    tp_rows = rollout.training_rows(len(generated), rollout_mesh.get_local_rank("infer_tp"), run.dims.infer_tp)
    rows = dict(vars(generated.rows(tp_rows)))
    if versions is not None:
        rows["rollout_versions"] = versions[tp_rows]  # (B, R) the weight version of each token, -1 on padding
    score = functools.partial(score_samples, run.reward_fn, run.tokenizer, prompts=run.train_prompts,
                              reward_cfg=cfg.reward_model, max_response_length=cfg.data.max_response_length)
    if run.reward_model is not None:  # the learned reward model's score replaces the rule's (verl's rm_scores)
        score = functools.partial(reward_model_scores, run)
    if turn_stats is not None:  # multi-turn: per-sample counts travel with the rows, for the step's metrics
        turn_stats = turn_stats.rows(tp_rows)
        rows.update(num_turns=turn_stats.num_turns, tool_calls=turn_stats.tool_calls,
                    tool_failures=turn_stats.tool_failures)
        metrics["timing_s/tool"] = metrics.get("timing_s/tool", 0.0) + turn_stats.tool_seconds
    generators = run.pool.pool_group if run.pool is not None else None  # the ranks that score
    with timed(metrics, "reward"), failing_together(RewardError, run.env.device, generators):
        # scores: the reward trained on; fn_scores: the function's own (they differ by the overlong penalty)
        rows["scores"], rows["fn_scores"], extras = score(rows, rollout_info=turn_stats and turn_stats.reward_info)
        if baseline_rollout == "greedy":
            greedy_scores, _, _ = score(vars(greedy), rollout_info=greedy_stats and greedy_stats.reward_info)
            baseline = dict(zip(greedy.prompt_index.tolist(), greedy_scores.tolist(), strict=True))
            rows["reward_baselines"] = torch.tensor([baseline[i] for i in rows["prompt_index"].tolist()])  # (B,)
    return rows, extras


def stream_rollout(run: Run, step: int, metrics: dict[str, float]) -> tuple[rollout.RolloutBatch, torch.Tensor]:
    """colocate_async's generation for this rollout dp group: fresh groups dispatched until (1 +
    num_warmup_batches) batches' worth are in flight, the carried ones resumed, all streamed under weight
    version step - 1 until a batch's worth is complete (rollout.should_cut), the oldest complete groups
    taken (rollout.select_groups) and the rest carried; (their batch, prompt-major, and each token's weight
    version (N, R)). Every rank draws the same prompts from the sampler (a collective: each dp group's need)."""
    flight, sampling, llm = run.in_flight, run.engine.train_sampling, run.engine.llm
    quota = run.cfg.data.train_batch_size // run.dims.rollout_dp  # groups this dp group trains per step
    dp_rank = run.meshes.rollout.get_local_rank("dp")
    every_rank: list[Any] = [None] * run.env.world_size
    need = (1 + flight.warmup_batches) * quota - len(rollout.groups_of(flight.trajectories))
    dist.all_gather_object(every_rank, (dp_rank, need))
    needs = dict(every_rank)  # dp rank -> groups to dispatch (the ranks of a TP group agree)
    while len(flight.queue) < sum(needs.values()):
        flight.queue += run.sampler.next_batch()
    start = sum(needs[g] for g in range(dp_rank))
    fresh = flight.queue[start:start + needs[dp_rank]]
    flight.queue = flight.queue[sum(needs.values()):]
    flight.trajectories += [rollout.Trajectory(i, k, step, list(run.train_prompts[i].token_ids))
                            for i in fresh for k in range(sampling.n)]
    cut = functools.partial(rollout.should_cut, step=step, quota=quota, threshold=flight.threshold,
                            strategy=flight.strategy)
    stream = rollout.stream_generate(llm, sampling, flight.trajectories, version=step - 1, stop=cut,
                                     tp_group=run.meshes.rollout.get_group("infer_tp"))
    selected, flight.trajectories = rollout.select_groups(flight.trajectories, quota)
    if len(selected) != quota * sampling.n:  # all finished, yet too few distinct prompts among them
        raise RuntimeError(f"step {step}: {len(selected) // sampling.n} complete groups of distinct prompts for a batch "
                           f"of {quota}: the same prompts are in flight twice (a data set of fewer prompts than "
                           f"(1 + trainer.v1.colocate_async.num_warmup_batches) batches?). Lower num_warmup_batches.")
    dropped = 0
    if flight.strategy == "drop":  # groups the next step could not train within the bound
        flight.trajectories, dropped = rollout.drop_stale(flight.trajectories, step + 1, flight.threshold)
    check_same_in_tp_group(selected + flight.trajectories, run.meshes.rollout.get_group("infer_tp"))
    metrics.update({"rollout/engine_steps": stream.engine_steps,
                    "rollout/engine_occupancy": sum(stream.running) / max(len(stream.running), 1),
                    "rollout/reprefilled_tokens": stream.reprefilled_tokens, "rollout/aborted_samples": stream.aborted,
                    "rollout/carried_groups": len(rollout.groups_of(flight.trajectories)),
                    "training/off_policy/dropped_groups": dropped})
    return rollout.trajectories_batch(selected, sampling)


def serve_rollouts(run: Run) -> None:
    """The rollout pool's loop (separate_async): each step, the weights of version step - 1 from trainer 0
    (checked as they land), then the step's batch, generated and scored, handed to the trainers. One step off
    (separate_async.num_warmup_batches=1) the pool then generates step + 1's batch with the same weights while
    the trainers update on this one: every batch after the first was sampled by the weights one update old."""
    ahead = run.cfg.trainer.v1.separate_async.num_warmup_batches
    held = run.generated_ahead  # a batch generated ahead: this rank's (rows, extras, metrics); resumed: a checkpoint's
    if run.cfg.trainer.val_before_train and run.val_prompts and run.start_step < run.total_steps:  # as train
        run.progress.enter(run.start_step, "validate")
        validate_on_engine(run, run.start_step)
    for step in range(run.start_step + 1, run.total_steps + 1):
        run.progress.enter(step, "sync")
        receive_weights(run)  # version step - 1
        run.progress.enter(step, "generate")
        if held is None:  # sequential, or the first step
            held = pool_batch(run, step, version=step - 1)
        run.progress.enter(step, "hand_off")
        placement.hand_off(run.pool, held)
        held = None
        if ahead and step < run.total_steps:
            run.progress.enter(step, "generate_ahead")
            held = pool_batch(run, step + 1, version=step - 1)
        if validation_due(run, step):  # the weights of version step, after the batch ahead took version step - 1
            run.progress.enter(step, "validate")
            validate_on_engine(run, step)
        run.progress.enter(step, "wait_trainers")  # for the end of their step: the stop check, a save
        stopping = step < run.total_steps and stop_requested(run, step)  # the trainers' call of it (train)
        if save_due(run, step) or stopping:  # the pool's sampler and its batch generated ahead join the checkpoint
            run.progress.enter(step, "save")
            save(run, step, held)
        if stopping:
            break


def receive_weights(run: Run) -> None:
    """A pool rank: trainer 0's broadcast into this rank's engine (placement.receive_weights), then the same
    check as a collocated sync (rollout.StaleWeightsCheck) against the actor's probe log-probs sent with it."""
    probe: list[Any] = [None]
    weights = placement.receive_weights(run.pool, run.env.device, probe)
    lora = run.cfg.actor_rollout_ref.model.lora_rank > 0  # after the first sync, the modules LoRA changes alone
    rollout.sync_weights(run.engine.llm, weights, partial=lora and run.engine.synced_once)
    run.engine.synced_once = True
    if next(weights, None) is not None:
        raise RuntimeError("the engine stopped reading the weights trainer 0 broadcast before their end")
    run.engine.stale_check.check(rollout.engine_fingerprint(run.engine.llm, run.engine.probe), probe[0])


def pool_batch(run: Run, step: int, version: int) -> tuple[Batch, list[dict[str, float]], dict[str, float]]:
    """A pool rank's part of step `step`'s batch (rollout_step: its TP slice of its engine's samples, scored),
    each response token tagged with the weight version that sampled it (-1 on padding), and the metrics."""
    metrics: dict[str, float] = {}
    filter_cfg = run.cfg.algorithm.filter_groups
    if filter_cfg.enable:  # DAPO's dynamic sampling, over the pool's ranks
        rows, extras, sampling_metrics = dynamic_sampling(
            functools.partial(rollout_step, run, step, metrics=metrics), filter_cfg,
            train_batch_size=run.cfg.data.train_batch_size, group=run.pool.pool_group)
        metrics.update(sampling_metrics)
    else:
        rows, extras = rollout_step(run, step, 0, metrics)
    metrics["training/epoch"] = run.sampler.epoch  # the pool draws the prompts: the trainers' sampler stands still
    rows["rollout_versions"] = torch.where(rows["response_mask"].bool(), version, -1)  # (B, R)
    return rows, extras, metrics


def receive_rollouts(run: Run, metrics: dict[str, float]) -> tuple[Batch, list[dict[str, float]]]:
    """A trainer: its slice of the pool's batch (placement.hand_off), as collocated rank r would hold it."""
    with timed(metrics, "wait_rollout"):  # the time the pool kept the trainers waiting
        rows, extras, pool_metrics = placement.hand_off(run.pool, None)
    metrics.update(pool_metrics)
    return rows, extras


def check_same_in_tp_group(trajs: list[rollout.Trajectory], group: dist.ProcessGroup) -> None:
    """Every rank of a rollout TP group must hold the same trajectories after a cut (the same engine outputs,
    the same stop rule): compare a digest, and fail on every rank rather than train on a split."""
    if dist.get_world_size(group) == 1:
        return
    digest = hashlib.blake2b(repr([vars(t) for t in trajs]).encode(), digest_size=16).hexdigest()
    every_rank: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, digest, group=group)
    if len(set(every_rank)) > 1:
        raise RuntimeError(f"the ranks of rollout TP group {dist.get_process_group_ranks(group)} cut the stream "
                           f"differently (digests {every_rank}): the stop rule must read the engine's outputs only.")


def generate(run: Run, prompts: list[Prompt], prompt_indices: list[int], step: int,
             sampling: rollout.Sampling) -> tuple[rollout.RolloutBatch, MultiTurnStats | None]:
    """The rollout seam, for training, ReMax's baseline and validation: this rollout dp group's prompts,
    sampling.n responses each, prompt-major; every rank of the TP group makes the same call. With
    multi_turn.enable the policy and its tools take turns (agent_loop.py), and per-sample stats come too."""
    if run.multi_turn is None:
        engine_prompts = run.vision.engine_prompts(prompts) if run.vision is not None else None  # + their images
        return rollout.generate(run.engine.llm, [p.token_ids for p in prompts], sampling, step=step,
                                prompt_indices=prompt_indices, engine_prompts=engine_prompts), None
    return generate_multi_turn(functools.partial(rollout.sample_turns, run.engine.llm, sampling), prompts, prompt_indices,
                               sampling, run.multi_turn.limits, step=step, make_env=run.multi_turn.environment,
                               renderer=run.multi_turn.renderer,
                               decode=functools.partial(run.tokenizer.decode, skip_special_tokens=True),
                               tp_group=run.meshes.rollout.get_group("infer_tp"))


def reward_model_scores(run: Run, rows: dict[str, torch.Tensor], rollout_info: list[dict[str, Any]] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, float]]]:
    """Step 3 with reward_model.enable: the reward model's score of each sample (B,), as both the reward
    and the score (score_samples' two), and no extras. As in verl, whose reward managers return the
    model's `rm_scores` as they are, the rule function, the DAPO manager's additions and rollout_info
    do not enter (config refuses what would need them)."""
    scores = run.reward_model.score(rows, run.train_prompts)  # (B,), collective over its FSDP mesh (split: the pool)
    return scores, scores, [{} for _ in range(len(scores))]


def check_generated_layout(prompt_index: torch.Tensor, samples_per_prompt: int, dp_group: dist.ProcessGroup) -> None:
    """The layout generation promises, checked on the step's whole batch before balance_batch deals it anew:
    prompt-major, each prompt's rollout.n samples one run (all made by one rollout group, whose sample
    indices 0 .. n-1 seed them apart: rollout.sample_seed). Collective."""
    all_index = gather_rows(prompt_index, dp_group)  # (B * dp,), dp rank order
    runs = all_index.view(-1, samples_per_prompt) if len(all_index) % samples_per_prompt == 0 else None
    if runs is None or not bool((runs == runs[:, :1]).all()) or len(set(all_index.tolist())) != len(runs):
        raise RuntimeError(f"generation must give the step's samples in prompt-major order, rollout.n="
                           f"{samples_per_prompt} per prompt; got prompt indices {all_index.tolist()[:24]}...")


def balance_batch(batch: Batch, reward_extras: list[dict[str, float]], dp_group: dist.ProcessGroup
                  ) -> tuple[Batch, list[dict[str, float]], dict[str, float]]:
    """verl's trainer.balance_batch: the step's samples dealt anew over the ranks of dp_group, as many per
    rank as before, so that each rank holds about as many tokens (ppo_core.balanced_partitions over
    attention_mask.sum(-1)); every all-reduce of the forwards and the update waits for the rank with the
    most. Every rank gathers every row, computes the same partition and keeps its part, in batch order,
    with its rows' reward extras (the sp ranks of a group hold the same rows and keep the same part).
    The update's gradient is the same sum, in another float order; the estimators group samples by
    prompt_index, not by place. Returns (this rank's rows, their extras, verl's global_seqlen/* metrics:
    the ranks' token sums before (min, max, minmax_diff) and after (balanced_min, balanced_max), and
    their mean). Collective."""
    lengths = gather_rows(batch["attention_mask"].sum(-1), dp_group).tolist()  # (B * dp,) dp rank order
    dp, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    parts = core.balanced_partitions(lengths, dp)
    kept_rows = torch.tensor(parts[rank], device=batch["attention_mask"].device)  # (B,) rows of the gathered batch
    balanced = {key: gather_rows(rows, dp_group)[kept_rows] for key, rows in batch.items()}
    extras = gather_items(reward_extras, dp_group)
    per_rank = len(lengths) // dp
    before = [sum(lengths[r * per_rank:(r + 1) * per_rank]) for r in range(dp)]
    after = [sum(lengths[i] for i in part) for part in parts]
    metrics = {"global_seqlen/min": min(before), "global_seqlen/max": max(before),
               "global_seqlen/minmax_diff": max(before) - min(before), "global_seqlen/balanced_min": min(after),
               "global_seqlen/balanced_max": max(after), "global_seqlen/mean": sum(after) / dp}
    return balanced, [extras[i] for i in parts[rank]], metrics


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R) token-level scores: each at its response's last loss-mask token."""
    length = response_mask.shape[-1]
    last = length - 1 - response_mask.flip(-1).argmax(-1)  # (B,) the last 1 of each row
    last = torch.where(response_mask.any(-1), last, 0)
    token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    token_level_scores[torch.arange(len(scores)), last] = scores.to(token_level_scores)
    return token_level_scores  # (B, R)


# -----------------------------------------------------------------------------
# 4. Old log-probs (where they come from, decided once), the teacher's


def old_log_prob_source(actor: torch.nn.Module, algo_cfg: Config, spec: UpdateSpec,
                        samples_per_rank: int, calculate_sum_pi_squared: bool = False) -> tuple[str, str]:
    """("engine" | "update" | "forward", why). engine: bypass mode, the engine's log-probs are the old
    ones. update: one epoch of one mini batch, so the update's forward runs on the weights that sampled
    the batch and its detached log-probs are the old ones (verl and TRL do the same; the ratio is 1).
    forward: a separate no-grad forward, needed when something uses them before the update (KL in
    reward, rollout correction's weights or rejections), or when training forwards differ (dropout)."""
    rc_cfg = algo_cfg.rollout_correction
    if rc_cfg.bypass_mode:
        return "engine", "algorithm.rollout_correction.bypass_mode: the engine's log-probs are the old ones"
    if calculate_sum_pi_squared:
        return "forward", "actor.calculate_sum_pi_squared: the advantages need sum_v pi(v)^2 before the update"
    if spec.epochs != 1:
        return "forward", f"actor.ppo_epochs={spec.epochs}: later epochs train on updated weights"
    if samples_per_rank > spec.mini_batch_size:
        return "forward", (f"{samples_per_rank} samples per rank in mini batches of {spec.mini_batch_size} "
                           f"(actor.ppo_mini_batch_size): later mini batches train on updated weights")
    if algo_cfg.use_kl_in_reward:
        return "forward", "algorithm.use_kl_in_reward: the advantages need the old log-probs before the update"
    if rc_cfg.rollout_is is not None or rc_cfg.rollout_rs is not None:
        return "forward", ("algorithm.rollout_correction.rollout_is / rollout_rs: the losses need the weights "
                           "before the update")
    dropout = [m.p for m in actor.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if dropout or getattr(getattr(actor, "config", None), "attention_dropout", 0.0):
        return "forward", "the actor has dropout: its training forward differs from a no-grad one"
    return "update", "one epoch of one mini batch: the actor update's own forward"


@dataclass
class PolicyForward:
    """The actor's outputs on the step's batch under the weights that sampled it, (B, R) each."""

    old_log_probs: torch.Tensor
    entropy: torch.Tensor
    sampling_log_probs: torch.Tensor  # under the engine's top-k / top-p cut (old_log_probs without one)
    sum_pi_squared: torch.Tensor | None = None  # sum_v pi(v)^2 per token, with actor.calculate_sum_pi_squared
    routed_experts: torch.Tensor | None = None  # (B, P+R, layers, k) the experts chosen, with router_replay R2


def old_policy_forward(run: Run, batch: Batch) -> PolicyForward:
    """The separate no-grad forward of the actor that sampled the batch: old log-probs, entropy, and the
    log-probs under the engine's top-k / top-p cut (for the comparisons with the engine's). With
    actor.router_replay.mode=R2 it records a MoE's routes per row, for the update's forwards to replay."""
    spec, truncation = run.plan.old_log_prob, run.actor_loss.truncation
    actor_cfg = run.cfg.actor_rollout_ref.actor
    run.actor.eval()
    record = RouterReplay(run.actor, "record") if actor_cfg.router_replay.mode == "R2" else None
    with torch.no_grad(), record or contextlib.nullcontext():
        out = compute_log_probs(
            run.actor, batch, run.actor_loss.temperature, spec.micro_batch_size, calc_entropy=True,
            max_token_len=spec.max_token_len, use_remove_padding=spec.use_remove_padding, sp_group=run.sp_group,
            dp_group=run.dp_group, truncation=truncation, calc_sum_pi_squared=actor_cfg.calculate_sum_pi_squared, router_replay=record)
    return PolicyForward(out.log_probs, out.entropy, out.log_probs if out.truncated is None else out.truncated,
                         out.sum_pi_squared, out.routed_experts)


def teacher_log_probs(run: Run, batch: Batch) -> Batch:
    """The teacher's no-grad forward on the student's samples (distillation.enabled), cut as the reference
    model's: its log-probs of the sampled tokens, teacher_log_probs (B, R), or with forward_kl_topk its top-k
    over the tokenizer's ids, teacher_topk_log_probs and teacher_topk_ids (B, R, k). At temperature 1, as
    verl's teacher (an engine's prompt log-probs) gives them, whatever the rollout's temperature."""
    spec, topk = run.plan.teacher_log_prob, run.actor_loss.distillation.topk
    with torch.no_grad():
        out = compute_log_probs(
            run.teacher, batch, 1.0, spec.micro_batch_size, max_token_len=spec.max_token_len,
            use_remove_padding=spec.use_remove_padding, sp_group=run.sp_group, dp_group=run.dp_group,
            topk=(topk, run.teacher_vocab_limit) if topk is not None else None)
    if topk is None:
        return {"teacher_log_probs": out.log_probs}
    return {"teacher_topk_log_probs": out.topk_values, "teacher_topk_ids": out.topk_ids}


# -----------------------------------------------------------------------------
# 5. Advantages; 5b. the sync check and rollout correction


def reward_components(reward_extras: list[dict[str, float]], keys: list[str] | None,
                      device: torch.device) -> torch.Tensor | None:
    """(B, K): each sample's reward extras named by algorithm.gdpo_reward_keys, in the rows' order; None without keys."""
    if keys is None:
        return None
    missing = sorted({key for extras in reward_extras for key in keys if key not in extras})
    if missing:
        given = sorted({key for extras in reward_extras for key in extras})
        raise ValueError(f"algorithm.gdpo_reward_keys names {missing}, which the reward function does not return "
                         f"for every sample (its extras: {given}); return a dict with those keys.")
    return torch.tensor([[float(extras[key]) for key in keys] for extras in reward_extras], dtype=torch.float32,
                        device=device)  # (B, K)


def compute_advantages(batch: Batch, algo_cfg: Config, kl_ctrl: core.FixedKLController,
                       dp_group: dist.ProcessGroup, total_samples: int, samples_per_prompt: int,
                       reward_components: torch.Tensor | None = None) -> dict[str, float]:
    """Token-level rewards, advantages and returns of this rank's samples, written into `batch`.

    The ranks of dp_group hold the step's samples between them, each once: prompt-major as generated (a
    prompt's samples may span neighbouring ranks), or in any order after balance_batch. Estimators that
    compare a prompt's samples gather the step's whole batch, compute on it as verl's driver does (by
    prompt_index, whatever the order), and keep this rank's rows; the others work per sample (GAE and
    REINFORCE++ whiten over dp_group). The adaptive KL controller sees the whole batch's KL."""
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

    estimator = core.ADV_ESTIMATORS[algo_cfg.adv_estimator]
    if estimator.compares_group:
        all_rewards, all_mask = gather_rows(rewards, dp_group), gather_rows(mask, dp_group)  # (B * dp, R)
        all_index = gather_rows(batch["prompt_index"], dp_group)  # (B * dp,), dp rank order
        # a baseline from part of a group is silently wrong (check_generated_layout saw the order)
        prompts, group_sizes = torch.unique(all_index, return_counts=True)  # (G,) each
        if not bool((group_sizes == samples_per_prompt).all()):
            wrong = group_sizes != samples_per_prompt
            got = list(zip(prompts[wrong].tolist(), group_sizes[wrong].tolist(), strict=True))
            raise RuntimeError(f"{estimator.name} needs all rollout.n={samples_per_prompt} samples of each prompt in "
                               f"the step's batch; got (prompt index, samples) {got[:12]}")
        # the old policy's per-token statistics, when asked for (the optimal token baseline reads them)
        per_token = {k: gather_rows(batch[k], dp_group) for k in ("old_log_probs", "sum_pi_squared")
                     if "sum_pi_squared" in batch}  # (B * dp, R) each
        if reward_components is not None:  # gdpo's components, (B * dp, K), and their weights
            per_token.update(reward_components=gather_rows(reward_components, dp_group),
                             reward_weights=algo_cfg.gdpo_reward_weights)
        all_adv, _ = core.compute_advantage(
            estimator.name, token_level_rewards=all_rewards, response_mask=all_mask, index=all_index.tolist(),
            norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo, **per_token)  # (B * dp, R)
        batch["advantages"] = batch["returns"] = my_rows(all_adv, dp_group)  # (B, R)
    else:
        batch["advantages"], batch["returns"] = core.compute_advantage(
            estimator.name, token_level_rewards=rewards, response_mask=mask, values=batch.get("values"),
            gamma=algo_cfg.gamma, lam=algo_cfg.lam, whiten_group=dp_group,
            reward_baselines=batch.get("reward_baselines"))  # (B, R) each
    return metrics


def check_old_policy(batch: Batch, old: PolicyForward, correction: rollout_correction.Correction, loss_agg_mode: str,
                     dp_group: dist.ProcessGroup, version: int | None = None) -> dict[str, float]:
    """After the old log-probs, wherever they came from: the sync check (the engine's log-probs of its
    samples against the actor's under the same cut), the old policy's entropy, and decoupled rollout
    correction over the whole step batch (IS weights and rejections into `batch`, its diagnostics).
    With colocate_async's rollout_versions, the sync check reads the tokens of weight `version` (the
    weights just synced) only, and the older tokens' gap is reported apart (their drift, not a sync error)."""
    mask = batch["response_mask"]  # (B, R)
    versions = batch.get("rollout_versions")  # (B, R) or None: every token of the synced weights
    fresh = mask if versions is None else mask * (versions == version)  # (B, R)
    diff = rollout.logprob_diff(batch["rollout_log_probs"], old.sampling_log_probs, fresh)
    metrics = {"rollout/logprob_diff_mean": diff["logprob_diff_mean"],
               "rollout/logprob_diff_max": diff["logprob_diff_max"],
               "actor/entropy": core.agg_loss(old.entropy, mask.float(), loss_agg_mode).item()}
    if versions is not None:
        drift = rollout.logprob_diff(batch["rollout_log_probs"], old.sampling_log_probs, mask * (versions < version))
        metrics.update({"rollout/stale_logprob_diff_mean": drift["logprob_diff_mean"],
                        "rollout/stale_logprob_diff_max": drift["logprob_diff_max"]})
    with timed(metrics, "rollout_corr"):
        is_weights, batch["response_mask"], rc_metrics = rollout_correction.correct_batch(
            old.sampling_log_probs, batch["rollout_log_probs"], mask, correction, dp_group)
    metrics.update(rc_metrics)
    if is_weights is not None:
        batch["rollout_is_weights"] = is_weights  # (B, R)
    return metrics


def check_versions(batch: Batch, step: int, threshold: int, old_log_probs_from: str,
                   dp_group: dist.ProcessGroup) -> dict[str, float]:
    """colocate_async: every trained token's weight version (rollout_versions, (B, R)) within verl's bound
    (a token of version v is trained at `step` with step - v <= threshold, i.e. the trajectory spans at
    most `threshold` versions up to this step) and none newer than the weights synced for it (step - 1); the
    on-policy shortcut (the update's own forward as the old policy) refused when any token is older.
    Raises on every rank of dp_group alike. verl V1's metrics: trajectory_spans (versions within a sample),
    trajectory_staleness (the weights' version minus the sample's newest), _worst (minus its oldest). Collective."""
    versions, current = batch["rollout_versions"], step - 1  # (B, R)
    real = versions >= 0  # (B, R) response tokens; -1 is padding
    newest = torch.where(real, versions, -1).max(-1).values  # (B,)
    oldest = torch.where(real, versions, current + 1).min(-1).values  # (B,)
    counts = torch.stack([(oldest < current - (threshold - 1)).sum(), (newest > current).sum(),
                          (real & (versions < current)).sum(), real.sum()]).double()
    dist.all_reduce(counts, group=dp_group)
    too_old, too_new, stale, tokens = counts.tolist()
    if too_old or too_new:
        raise RuntimeError(
            f"step {step}: {too_old:.0f} samples hold tokens older than trainer.v1.sampler.max_off_policy_threshold="
            f"{threshold} versions and {too_new:.0f} hold tokens newer than the weights synced for this step "
            f"({current}): the in-flight bookkeeping is wrong.")
    if old_log_probs_from == "update" and stale:
        raise RuntimeError(
            f"step {step}: {stale:.0f} trained tokens were sampled by older weights than version {current}, but the "
            f"old log-probs are the update's own forward (the on-policy shortcut), which anchors the clip at a "
            f"policy that never sampled them. Set algorithm.rollout_correction.rollout_is=token or bypass_mode=true.")
    prefix = "training/off_policy/"
    return {**stats(f"{prefix}trajectory_spans", newest - oldest + 1),
            **stats(f"{prefix}trajectory_staleness", current - newest),
            **stats(f"{prefix}trajectory_staleness_worst", current - oldest),
            f"{prefix}stale_sample_fraction": (oldest < current).float().mean().item(),
            f"{prefix}stale_token_fraction": stale / tokens}


# -----------------------------------------------------------------------------
# 6. Updates: ppo_epochs x mini batches x micro batches, one loop for the actor and the critic


def mini_batches(batch: Batch, spec: UpdateSpec, generator: torch.Generator,
                 dp_group: dist.ProcessGroup | None = None) -> Iterator[list[Batch]]:
    """Each optimizer step's mini batch as its list of micro batches: spec.epochs passes over this rank's
    samples (a fresh order per pass when spec.shuffle), cut into runs of spec.micro_batch_size samples
    or, with spec.max_token_len, balanced token budgets (as many on every rank of dp_group; collective)."""
    num_samples = batch["responses"].shape[0]
    for _ in range(spec.epochs):
        order = torch.randperm(num_samples, generator=generator) if spec.shuffle else torch.arange(num_samples)
        for start in range(0, num_samples, spec.mini_batch_size):
            rows = order[start:start + spec.mini_batch_size]
            if spec.max_token_len is None:
                size = spec.micro_batch_size
                micro_rows = [rows[i:i + size] for i in range(0, len(rows), size)]
            else:
                micro_rows = [rows[part.cpu()] for part in token_budget_micro_batches(batch["attention_mask"][rows],
                                                                                       spec.max_token_len, dp_group)]
            yield [{k: v[part] for k, v in batch.items()} for part in micro_rows]


def set_gradient_reduction(model: torch.nn.Module, last_micro_batch: bool, accumulate_unsharded: bool) -> None:
    """When this micro batch's backward reduces its gradients. By default (verl's way) every micro batch
    reduce-scatters, so a rank only ever holds its gradient shard; under HSDP the all-reduce across
    replicas still waits for the last one (FSDP2 sums the reduce-scattered shards meanwhile; a no-op
    without HSDP). accumulate_unsharded (fsdp_config.accumulate_unsharded_grads): no reduction before
    the last micro batch, the full unsharded fp32 gradient held on every rank until then."""
    if accumulate_unsharded:
        model.set_requires_gradient_sync(last_micro_batch)
    else:
        model.set_requires_all_reduce(last_micro_batch)


LossFn = Callable[[Batch, core.LossScale], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_updates(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn,
                spec: UpdateSpec, generator: torch.Generator, dp_group: dist.ProcessGroup | None,
                prefix: str) -> dict[str, float]:
    """One optimizer step per mini batch (mini_batches), gradients accumulated over its micro batches.

    loss_fn(micro_batch, scale) -> (loss, terms), where scale (a ppo_core.LossScale) holds the mini batch's
    token and sequence counts over dp_group (the ranks holding distinct samples; all ranks when None) and its size, so the
    gradient does not depend on the cut (ppo_core's docstring). Terms named `*_loss` are shares of the
    mini batch's loss, summed over micro batches; others are averaged; then all over optimizer steps
    (`*/loss` too: distillation/loss)."""
    model.train()
    dp_size = dist.get_world_size(dp_group)
    metrics: dict[str, float] = {}
    sums: dict[str, float] = {}
    num_steps = 0
    for micro_batches in mini_batches(batch, spec, generator, dp_group):
        num_tokens, num_seqs = core.global_num_tokens_and_seqs([mb["response_mask"] for mb in micro_batches],
                                                                 group=dp_group)
        scale = core.LossScale(num_tokens, num_seqs, dp_size)
        for i, mb in enumerate(micro_batches):
            set_gradient_reduction(model, last_micro_batch=i == len(micro_batches) - 1,
                                   accumulate_unsharded=spec.accumulate_unsharded_grads)
            loss, terms = loss_fn(mb, scale)
            # A non-finite loss still goes through backward: its NaN reaches every rank's gradient
            # through the reduce-scatter, so all ranks skip the step together (optimizer_step).
            loss.backward()
            for name, value in terms.items():
                share = value.item() if name.endswith(("_loss", "/loss")) else value.item() / len(micro_batches)
                sums[name] = sums.get(name, 0.0) + share
        optimizer_step(model, optimizer, spec.grad_clip, prefix, metrics)
        num_steps += 1
    metrics.update({k: v / num_steps for k, v in sums.items()})
    return metrics


def _actor_micro_batch(actor: torch.nn.Module, loss: ActorLoss, loss_agg_mode: str, use_remove_padding: bool,
                       groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None], generator: torch.Generator,
                       forwards: list[tuple[torch.Tensor, ...]] | None, replay: RouterReplay | None, mb: Batch,
                       scale: core.LossScale) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's forward and loss on one micro batch (run_updates' loss_fn, through functools.partial).
    With `forwards` (a list) this forward is the old policy's: its log-probs, detached, are the old ones,
    and (rows, log-probs, entropy, cut log-probs) are appended for the caller. With `replay` the MoE's
    routers take the micro batch's routed_experts."""
    dp_group, sp_group = groups
    own_old = forwards is not None
    topk_ids = mb.get("teacher_topk_ids")  # (b, R, k): forward_kl_topk reads the student's log-probs there
    with RouterLogits(actor) as routed:  # a MoE's router logits, for the load-balancing metric (nothing if dense)
        out = compute_log_probs(
            actor, mb, loss.temperature, len(mb["responses"]), loss.entropy_coeff != 0 or own_old,
            use_remove_padding=use_remove_padding, sp_group=sp_group,
            truncation=loss.truncation if own_old else None, topk_ids=topk_ids, router_replay=replay,
            routed_experts=mb.get("routed_experts") if replay is not None else None)  # one forward
    log_prob, entropy = out.log_probs, out.entropy  # (b, R) each
    if own_old:
        mb = dict(mb, old_log_probs=log_prob.detach())
        sampling_log_prob = log_prob if out.truncated is None else out.truncated  # (b, R) under the engine's cut, if any
        forwards.append((mb["row_index"], log_prob.detach(), entropy.detach(), sampling_log_prob.detach()))
    policy_loss, terms = actor_loss(mb, log_prob, entropy, loss, loss_agg_mode,
                                    replace(scale, scale_factor=loss.loss_scale_factor), generator, dp_group,
                                    student_topk=out.gathered)
    if routed.logits:  # a metric only: not in the loss (as verl's FSDP actor)
        terms["actor/moe_load_balance"] = load_balancing_loss(routed.logits, routed.routers[0].top_k)
    return policy_loss, terms


def update_actor(actor: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, loss: ActorLoss,
                 spec: UpdateSpec, generator: torch.Generator, dp_group: dist.ProcessGroup | None = None,
                 sp_group: dist.ProcessGroup | None = None,
                 own_old_log_probs: bool = False) -> tuple[dict[str, float], PolicyForward | None]:
    """The actor's update (run_updates over actor_loss). The batch's rollout_is_weights (decoupled rollout
    correction) weigh the policy loss. With own_old_log_probs (one epoch of one mini batch: the forward
    runs on the weights that sampled the batch) the old log-probs are the update forward's own, and its
    outputs come back as a PolicyForward in batch order; else the batch must carry old_log_probs. With
    routed_experts in the batch (router_replay R2) every forward, and its recomputation under activation
    checkpointing, replays them."""
    num_samples = batch["responses"].shape[0]
    if own_old_log_probs and (spec.epochs != 1 or num_samples > spec.mini_batch_size):
        raise ValueError(f"update_actor(own_old_log_probs=True) needs one epoch of one mini batch; got "
                         f"{spec.epochs} epochs, {num_samples} samples in mini batches of {spec.mini_batch_size}")
    forwards: list[tuple[torch.Tensor, ...]] | None = [] if own_old_log_probs else None
    if own_old_log_probs:
        batch = dict(batch, row_index=torch.arange(num_samples, device=batch["responses"].device))  # (B,)
    replay = RouterReplay(actor, "replay") if "routed_experts" in batch else None
    loss_fn = functools.partial(_actor_micro_batch, actor, loss, spec.loss_agg_mode, spec.use_remove_padding,
                                (dp_group, sp_group), generator, forwards, replay)
    with replay or contextlib.nullcontext():  # hooks on the routers through each backward too
        metrics = run_updates(actor, optimizer, batch, loss_fn, spec, generator, dp_group, "actor")
    if forwards is None:
        return metrics, None
    order = torch.argsort(torch.cat([out[0] for out in forwards]))  # micro batch order -> batch order
    outputs = [torch.cat([out[i] for out in forwards])[order] for i in (1, 2, 3)]  # (B, R) each
    return metrics, PolicyForward(*outputs)


def _critic_micro_batch(critic: torch.nn.Module, spec: UpdateSpec, cliprange_value: float, loss_scale_factor: int,
                        sp_group: dist.ProcessGroup | None, mb: Batch,
                        scale: core.LossScale) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's forward and clipped value loss against the returns on one micro batch."""
    vpreds = compute_values(critic, mb, len(mb["responses"]), use_remove_padding=spec.use_remove_padding,
                            sp_group=sp_group)  # (b, R)
    vf_loss, vf_clipfrac = core.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                                   cliprange_value, spec.loss_agg_mode,
                                                   **replace(scale, scale_factor=loss_scale_factor).counts())
    return vf_loss, {"critic/vf_loss": vf_loss, "critic/vf_clipfrac": vf_clipfrac}


def update_critic(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, spec: UpdateSpec,
                  generator: torch.Generator, cliprange_value: float, loss_scale_factor: int,
                  dp_group: dist.ProcessGroup | None = None,
                  sp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The critic's update: the clipped value loss (critic.cliprange_value), run_updates' loop."""
    loss_fn = functools.partial(_critic_micro_batch, critic, spec, cliprange_value, loss_scale_factor, sp_group)
    return run_updates(critic, optimizer, batch, loss_fn, spec, generator, dp_group, "critic")


# -----------------------------------------------------------------------------
# 6. The actor's loss: pure functions of tensors


@dataclass(frozen=True)
class DistillationLoss:
    """What on-policy distillation's term reads (distillation.distillation_loss), resolved once."""

    loss_mode: str  # ppo_core.DISTILLATION_LOSS_MODES
    topk: int | None  # forward_kl_topk: the teacher's k most likely tokens; None for the KL estimators
    use_task_rewards: bool  # true: the task's loss + coef x this term; false: this term alone
    coef: float  # distillation_loss_coef (with use_task_rewards)
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None  # forward_kl_topk only
    use_policy_gradient: bool
    clip_ratio_low: float | None  # with use_policy_gradient
    clip_ratio_high: float | None

    @classmethod
    def from_config(cls, cfg: Config) -> DistillationLoss | None:
        """None without distillation.enabled. Reads only the keys its mode uses (finish() names any other set)."""
        if not cfg.distillation.enabled:
            return None
        d = cfg.distillation.distillation_loss
        topk = d.loss_mode == "forward_kl_topk"
        low = high = None
        if d.use_policy_gradient:
            _ = d.policy_loss_mode  # vanilla, the only one (config.CHOICES)
            low, high = (d.clip_ratio if c is None else c for c in (d.clip_ratio_low, d.clip_ratio_high))
        return cls(d.loss_mode, d.topk if topk else None, d.use_task_rewards,
                   d.distillation_loss_coef if d.use_task_rewards else 1.0, d.loss_max_clamp,
                   d.log_prob_min_clamp if topk else None, d.use_policy_gradient, low, high)


@dataclass(frozen=True)
class ActorLoss:
    """What the actor's loss reads, resolved from the config once (ActorLoss.from_config)."""

    loss_mode: str  # actor.policy_loss.loss_mode (ppo_core.POLICY_LOSSES)
    loss_params: dict[str, Any]  # the clip ratios, and the keys of actor.policy_loss that loss_mode reads
    entropy_coeff: float
    kl_loss_coef: float | None  # None: no KL loss (actor.use_kl_loss=false)
    kl_loss_type: str
    temperature: float  # rollout.temperature: the log-probs are of logits / temperature
    loss_scale_factor: int  # data.max_response_length, for seq-mean-token-sum-norm
    bypass: bool = False  # algorithm.rollout_correction.bypass_mode: the correction runs here, pi_theta against the engine
    truncation: tuple[int, float] | None = None  # the engine's (top_k, top_p) cut, when it samples from one
    distillation: DistillationLoss | None = None  # distillation.enabled: the teacher's term
    # algorithm.rollout_correction, parsed: in bypass mode the loss's, else check_old_policy's (decoupled mode)
    correction: rollout_correction.Correction = field(default_factory=rollout_correction.Correction)

    @classmethod
    def from_config(cls, cfg: Config) -> ActorLoss:
        actor, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        mode = actor.policy_loss.loss_mode
        low, high = (actor.clip_ratio if c is None else c for c in (actor.clip_ratio_low, actor.clip_ratio_high))
        params = dict(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=actor.clip_ratio_c,
                      **{key: cfg.at(policy_loss_key(key))
                         for key in core.POLICY_LOSSES[mode].keys})
        rc_cfg = cfg.algorithm.rollout_correction
        return cls(mode, params, actor.entropy_coeff, actor.kl_loss_coef if actor.use_kl_loss else None,
                   actor.kl_loss_type, rollout_cfg.temperature, cfg.data.max_response_length,
                   rc_cfg.bypass_mode,
                   (rollout_cfg.top_k, rollout_cfg.top_p) if sampling_truncates(rollout_cfg) else None,
                   DistillationLoss.from_config(cfg), rollout_correction.Correction.from_config(rc_cfg))


def actor_loss(mb: Batch, log_prob: torch.Tensor, entropy: torch.Tensor | None, loss: ActorLoss, loss_agg_mode: str,
               scale: core.LossScale, generator: torch.Generator,
               dp_group: dist.ProcessGroup | None = None, *,
               student_topk: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro batch's policy loss (actor.policy_loss.loss_mode), minus the entropy bonus, plus the KL
    loss to the reference model, each aggregated under `scale` (ppo_core's docstring). log_prob,
    entropy: (b, R) of this forward. In bypass mode the correction runs here, pi_theta against the engine.
    With distillation, its term (distillation_term) is added, or with use_task_rewards=false replaces the rest;
    student_topk (b, R, k): this forward's log-probs of the teacher's top-k tokens (forward_kl_topk)."""
    mask = mb["response_mask"]  # (b, R)
    pg_mask, is_weights, terms = mask, mb.get("rollout_is_weights"), {}  # (b, R) each
    bypass = loss.correction if loss.bypass else None
    if bypass is not None:  # old_log_probs are the engine's: weights and rejection of pi_theta against them
        is_weights, pg_mask, terms = rollout_correction.correct_micro_batch(log_prob, mb["old_log_probs"], mask,
                                                                            bypass, dp_group)
    # bypass mode's loss_type=reinforce is the gpg loss (-A log pi_theta), the weights doing the correcting;
    # with ppo_clip the ratio already is pi_theta / pi_engine, so the weights are logged, not applied (verl's)
    reinforce = bypass is not None and bypass.loss_type == "reinforce"
    pg_loss, pg_metrics = core.policy_loss(
        "gpg" if reinforce else loss.loss_mode, mb["old_log_probs"], log_prob, mb["advantages"], pg_mask,
        loss_agg_mode, **loss.loss_params, generator=generator, scale=scale,
        rollout_is_weights=None if bypass is not None and not reinforce else is_weights)
    terms.update({"actor/pg_loss": pg_loss, **pg_metrics})
    total = pg_loss
    if entropy is not None and loss.entropy_coeff != 0:
        terms["actor/entropy_loss"] = scale.agg(entropy, mask, loss_agg_mode)
        total = total - loss.entropy_coeff * terms["actor/entropy_loss"]
    if loss.kl_loss_coef is not None:
        kl = core.kl_penalty(log_prob, mb["ref_log_probs"], loss.kl_loss_type)  # (b, R)
        terms["actor/kl_loss"] = scale.agg(kl, mask, loss_agg_mode)
        total = total + loss.kl_loss_coef * terms["actor/kl_loss"]
    distill = loss.distillation
    if distill is not None:
        term = distillation_term(mb, log_prob, student_topk, distill, loss_agg_mode, scale, is_weights, terms)
        # verl: use_task_rewards=false drops the task's loss (entropy and KL terms with it)
        total = total + distill.coef * term if distill.use_task_rewards else term
    return total, terms


def distillation_term(mb: Batch, log_prob: torch.Tensor, student_topk: torch.Tensor | None, distill: DistillationLoss,
                      loss_agg_mode: str, scale: core.LossScale, is_weights: torch.Tensor | None,
                      terms: dict[str, torch.Tensor]) -> torch.Tensor:
    """On-policy distillation's share of the micro batch's loss (ppo_core.distillation_loss), its metrics
    into `terms` (verl's distillation/* names): the student's log-probs (b, R), or of the teacher's top-k
    (b, R, k), against the teacher's from step 4."""
    tokens = core.distillation_token_losses(
        distill.loss_mode, log_prob, mb.get("teacher_log_probs"), student_topk_log_probs=student_topk,
        teacher_topk_log_probs=mb.get("teacher_topk_log_probs"), log_prob_min_clamp=distill.log_prob_min_clamp)  # (b, R)
    term, metrics = core.distillation_loss(
        tokens, mb["old_log_probs"], log_prob, mb["response_mask"], loss_agg_mode,
        use_policy_gradient=distill.use_policy_gradient, loss_max_clamp=distill.loss_max_clamp,
        clip_ratio_low=distill.clip_ratio_low, clip_ratio_high=distill.clip_ratio_high,
        rollout_is_weights=is_weights, scale=scale)
    terms.update(metrics, **{"distillation/loss": term})
    return term


# -----------------------------------------------------------------------------
# 7. Metrics and the step's samples; 8. validation, checkpoint, the run's end


def step_metrics(run: Run, batch: Batch, step_seconds: float) -> dict[str, float]:
    """This rank's step statistics (verl's names), before the reduction over ranks."""
    metrics = batch_metrics(batch, run.cfg.data.max_prompt_length, run.dp_group)
    # tokens per second per rank: an sp group shares its samples' tokens
    metrics["perf/throughput"] = batch["attention_mask"].sum().item() / run.dims.sp / step_seconds
    metrics["perf/max_memory_gb"] = peak_memory_gb(run.env.device)
    # of the actor's and reference model's forwards (the critic's follow critic.model.use_remove_padding)
    metrics["perf/padding_fraction"] = padding_fraction(batch["attention_mask"],
                                                        run.cfg.actor_rollout_ref.model.use_remove_padding)
    if "num_turns" in batch:  # multi-turn (verl's and TRL's names); the failure share over every rank's calls
        metrics.update(stats("num_turns", batch["num_turns"]))
        metrics["tools/call_frequency"] = batch["tool_calls"].float().mean().item()
        counts = torch.stack([batch["tool_failures"].sum(), batch["tool_calls"].sum()]).double()
        dist.all_reduce(counts, group=run.dp_group)
        metrics["tools/failure_frequency"] = (counts[0] / counts[1].clamp(min=1)).item()
    return metrics


def dump_rollouts(run: Run, step: int, batch: Batch, reward_extras: list[dict[str, float]],
                  old: PolicyForward | None) -> None:
    """The step's samples to <trainer.rollout_data_dir>/<step>.jsonl (tracking.write_samples: verl's fields,
    and per token the advantage and, when the old log-probs are the actor's, the engine's log-prob minus
    the actor's under the same top-k / top-p cut). Each rank builds its rows' records (the decoding is
    spread over the ranks) and rank 0 gathers and writes them: one file per step, as verl's, on any file
    system. The ranks of rank 0's train dp group hold every sample once (under Ulysses the sp ranks share
    rows); reward_extras are this rank's rows' own, in their order. Collective."""
    if 0 not in dist.get_process_group_ranks(run.dp_group):
        return  # an sp rank whose rows rank 0's group already holds
    response_tokens = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()  # (B, R) the real ones
    outputs = run.tokenizer.batch_decode([r[m] for r, m in zip(batch["responses"], response_tokens, strict=True)],
                                         skip_special_tokens=True)  # the texts the reward function read
    records = sample_records(step, [run.train_prompts[i] for i in batch["prompt_index"].tolist()], outputs,
                             batch["token_level_scores"].sum(-1).tolist(), reward_extras)
    gap = None if old is None else batch["rollout_log_probs"] - old.sampling_log_probs  # (B, R)
    add_token_fields(records, run.tokenizer, batch, gap, exact=correction_inputs(batch, old))
    write_samples(records, run.rollout_data_dir, step, run.dp_group)


def correction_inputs(batch: Batch, old: PolicyForward | None) -> dict[str, torch.Tensor]:
    """The per-token values the step's rollout correction read (each (B, R)), for the dumps, so that its IS
    weights can be recomputed from them (docs/partial_rollout.md): the engine's log-probs, the old actor's under
    the engine's top-k / top-p cut (decoupled mode), the weights applied, each token's weight version
    (colocate_async)."""
    fields = {"rollout_log_probs": batch["rollout_log_probs"]}
    if old is not None:
        fields["old_log_probs"] = old.sampling_log_probs
    if "rollout_is_weights" in batch:
        fields["rollout_is_weights"] = batch["rollout_is_weights"]
    if "rollout_versions" in batch:
        fields["versions"] = batch["rollout_versions"]
    return fields


def run_validation(run: Run, step: int) -> dict[str, float]:
    """Scores on the whole held-out set (greedy unless rollout.val_kwargs.do_sample), rollout.val_kwargs.n
    samples per prompt, verl's names: val-core/<data_source>/reward/mean@<n> (acc/ where the reward function
    returns an `acc`), val-aux/<data_source>/<extra>/mean@<n>; with n > 1 also std@n, best@k, worst@k and
    maj@k (eval_metrics), and this project's val-unbiased/<data_source>/reward/pass@<k>; and val/score.
    Each rollout dp group generates for a contiguous share; every sample goes to
    <validation_data_dir>/<step>.jsonl (write_samples)."""
    rollout_mesh, prompts = run.meshes.rollout, run.val_prompts
    dp, dp_rank = rollout_mesh.size(0), rollout_mesh.get_local_rank("dp")
    indices = list(range(len(prompts) * dp_rank // dp, len(prompts) * (dp_rank + 1) // dp))
    generated, turn_stats = generate(run, [prompts[i] for i in indices], indices, step, run.engine.val_sampling)
    rows = [prompts[i] for i in generated.prompt_index.tolist()]
    response_tokens = generated.attention_mask[:, -generated.responses.shape[1]:]  # (B, R)
    generators = run.pool.pool_group if run.pool is not None else None  # the ranks that generate (a split's pool)
    with failing_together(RewardError, run.env.device, generators):
        texts, scores, extras, preds = score_batch(
            run.reward_fn, run.tokenizer, generated.responses, response_tokens, rows,
            turn_stats and turn_stats.reward_info, run.cfg.reward_model.timeout_s)
    if rollout_mesh.get_local_rank("infer_tp") == 0:  # the TP ranks of a group hold the same samples
        records = sample_records(step, rows, texts, scores, extras)
        if turn_stats is not None:  # every turn: role, text, token count, whether it was trained on
            for record, turns in zip(records, turn_stats.turns, strict=True):
                record["turns"] = turns
        write_samples(records, run.validation_data_dir, step, rollout_mesh.get_group("dp"))
    # Means over every rank's samples and prompts (the TP ranks of a group hold the same ones, which leaves
    # means unchanged). A prompt's n samples are all in one group: its mean@n, best@k, maj@k, pass@k
    # (eval_metrics) are computed there, then averaged over the data source's prompts.
    prompt_ids = generated.prompt_index.tolist()
    extra_keys = sorted({key for sample_extras in extras for key in sample_extras})
    variables = {"reward": scores, **{key: [e.get(key) for e in extras] for key in extra_keys}}  # None: not given
    per_prompt = eval_metrics.per_prompt_metrics(prompt_ids, [p.data_source for p in rows], variables, preds)
    means = mean_over_ranks({"\t".join(key): values for key, values in per_prompt.items()}, "", run.env.device,
                            generators)
    metrics = eval_metrics.name_metrics({tuple(key.split("\t")): value for key, value in means.items()})
    metrics.update(mean_over_ranks({"val/score": scores}, "", run.env.device, generators))
    count = torch.tensor([len(scores)], dtype=torch.float64, device=run.env.device)
    dist.all_reduce(count, group=rollout_mesh.get_group("dp"))  # each group's samples once
    metrics["val/num_samples"] = count.item()
    return metrics


def stop_requested(run: Run, step: int) -> bool:
    """Collective: whether any rank was asked to save and stop (run_dir.StopRequests), said once."""
    reason = run.stop.local_reason()
    asked = torch.tensor([reason is not None], dtype=torch.int32, device=run.env.device)
    dist.all_reduce(asked)
    if asked.item():
        print0(f"stopping after step {step} as asked ({reason or 'by another rank'}; {int(asked.item())} rank(s)): "
               f"saving; the same command resumes it")
    return bool(asked.item())


SAVE_BYTES_PER_S = 50e6  # a slow shared file system: the save phase's budget assumes no faster


def save_budget_s(run: Run) -> float:
    """The save phase's watchdog budget: trainer.hang_timeout_s plus this rank's shards of the models and
    their optimizer states written at SAVE_BYTES_PER_S, so that a large save is not taken for a hang."""
    tensors = [t for model, optimizer, _ in run.checkpointed().values()
               for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]
               if torch.is_tensor(t)]
    local = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)
    return run.cfg.trainer.hang_timeout_s + local / SAVE_BYTES_PER_S


def save(run: Run, step: int, generated_ahead: placement.Part | None = None) -> None:
    """A sharded, atomic checkpoint; older ones pruned only after the new one is complete. A split job's ranks
    all call it: the pool's sampler (it draws the prompts) and the batch it generated ahead (this pool rank's
    part of it, or None) go to trainer 0's trainer state; the trainers write the models."""
    start = time.perf_counter()
    if run.pool is not None and not run.pool.is_trainer:  # a rollout rank: its state, and no model
        placement.pool_state(run.pool, run.sampler.state_dict(), generated_ahead)
        save_checkpoint(run.out_dir, step, {}, {}, keep=run.cfg.trainer.max_actor_ckpt_to_keep, group=run.train_group)
        return
    trainer_state = {"sampler": run.sampler.state_dict(), "kl_ctrl": run.kl_ctrl.state_dict(),
                     "fingerprint": run.fingerprint}
    if run.in_flight is not None:
        trainer_state["in_flight"] = in_flight_state(run)
    if run.pool is not None:  # {"sampler": the pool's, "generated_ahead": ...} on trainer 0, which writes the state
        trainer_state.update(placement.pool_state(run.pool, None, None))
    path = save_checkpoint(run.out_dir, step, run.checkpointed(), trainer_state,
                           hf_source=(run.actor.config, run.tokenizer, *lora_config(run.actor)),
                           keep=run.cfg.trainer.max_actor_ckpt_to_keep, group=run.train_group)
    print0(f"saved {path} in {time.perf_counter() - start:.1f}s")


def in_flight_state(run: Run) -> dict[str, Any]:
    """colocate_async's carried samples, every rollout dp group's (from its TP rank 0), and the undispatched
    prompts: plain JSON for the checkpoint's trainer state. Collective."""
    mine = (run.meshes.rollout.get_local_rank("dp"), run.meshes.rollout.get_local_rank("infer_tp"),
            [vars(t) for t in run.in_flight.trajectories])
    every_rank: list[Any] = [None] * run.env.world_size
    dist.all_gather_object(every_rank, mine)
    groups = {dp: trajs for dp, tp, trajs in every_rank if tp == 0}
    return {"rollout_dp": run.dims.rollout_dp, "trajectories": [groups[dp] for dp in range(run.dims.rollout_dp)],
            "queue": run.in_flight.queue}


def load_in_flight(in_flight: InFlight | None, dp_rank: int, rollout_dp: int, saved: dict[str, Any] | None,
                   path: Path) -> None:
    """A checkpoint's carried samples back into this rollout dp group's InFlight (in_flight_state's); saved at
    another rollout dp size, they are dealt anew (rollout.deal_groups)."""
    if in_flight is None and saved is None:
        return
    if in_flight is None or saved is None:
        raise ConfigError(f"checkpoint {path} was written {'with' if saved else 'without'} trainer.v1.trainer_mode="
                          f"colocate_async and this run is {'not' if saved else ''} one: its carried samples "
                          f"would be {'lost' if saved else 'missing'}. Resume with the trainer_mode it was written with.")
    per_group = [[rollout.Trajectory(**t) for t in trajs] for trajs in saved["trajectories"]]
    if saved["rollout_dp"] != rollout_dp:  # another layout: whole groups dealt anew (the run goes on, not the same)
        print0(f"checkpoint {path}: the carried samples of {saved['rollout_dp']} rollout dp groups dealt to {rollout_dp}")
        per_group = rollout.deal_groups(per_group, rollout_dp)
    in_flight.trajectories = per_group[dp_rank]
    in_flight.queue = list(saved["queue"])


def finish(run: Run) -> None:
    """Close the logs, say which keys the run never read, write the summary. The engine keeps running
    (rollout.shutdown stops it)."""
    run.tracker.close()
    if run.lock is not None:
        run.lock.release()
    out_dir = run.out_dir
    if run.env.rank == 0:  # every key should have done something; say which did not (a typo'd intent, a dead key)
        unread = unread_keys(run.cfg)
        (out_dir / "config_unread.json").write_text(json.dumps(unread, indent=1))
        ignored = sorted(set(unread) & set(non_defaults(run.cfg)))
        if ignored:
            print0(f"warning: this run never read these keys you set: {', '.join(ignored)}")
    if run.env.rank == 0 and (out_dir / "metrics.jsonl").is_file():  # the run's summary, also in summary.txt
        png = plot_metrics(out_dir / "metrics.jsonl", out_dir / "metrics.png")
        text = f"{summary(out_dir / 'metrics.jsonl')}\n{machine(run.env.device, run.env.world_size)}\n"
        (out_dir / "summary.txt").write_text(text)
        print0(text + f"metrics: {out_dir / 'metrics.jsonl'}, plot: {png}, summary: {out_dir / 'summary.txt'}")


# -----------------------------------------------------------------------------
# Set-up: config -> process group -> meshes -> data -> models -> resume -> engine


def build_run(cfg: Config, env: DistEnv, engine: Engine | None = None, *, watch: bool = False) -> Run:
    """Everything a run needs, in order; config errors come before anything heavy. With `engine`, an
    earlier run's engine (in this process) serves this run too, its sampling and probes made for this
    config: the caller checks that it can (tests/run_cases.py). watch: start the hang watchdog
    (trainer.hang_timeout_s) once the run is built."""
    dims, plan = validate(cfg, env.world_size)
    check_launch(dims, env)
    tc = cfg.trainer
    out_dir = Path(tc.default_local_dir)
    print0("config (keys that differ from the defaults; all of them in "
           f"{out_dir / 'config.yaml'}):\n" + "".join(f"  {k}={v}\n" for k, v in non_defaults(cfg).items()))
    print0(describe(cfg, dims, plan))
    lock = None
    with failing_together(run_dir.RunDirError, env.device):  # another job's directory: every rank stops
        if env.rank == 0:
            lock, took_over = run_dir.lock(out_dir)
            run_dir.clear_stop_file(out_dir)
            if took_over:
                print0(took_over)
    meshes = build_meshes(dims, env.device_type, timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    pool = placement.build_pool(dims, env.rank)  # separate_async: trainers [0, T), the rollout pool [T, N)
    write_rank_layout(out_dir / "layout", env.rank, meshes)
    route_library_logs(out_dir / "logs" / f"rank{env.rank}.log", env.rank)
    print0(f"library logs: {out_dir / 'logs'}/rank<r>.log")
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)

    tokenizer, train_prompts, val_prompts, reward_fn, multi_turn, vision_run = load_data(cfg, dims, env)
    # a step draws data.train_batch_size prompts; under dynamic sampling, generation batches of data.gen_batch_size
    size_key = "data.train_batch_size" if cfg.data.gen_batch_size is None else "data.gen_batch_size"
    sampler = PromptSampler(len(train_prompts), cfg.data.gen_batch_size or cfg.data.train_batch_size, cfg.data.seed,
                            cfg.data.shuffle, size_key=size_key)
    steps = cfg.trainer.total_training_steps
    epochs_in_steps = sampler.batches_per_epoch * cfg.trainer.total_epochs
    total_steps = epochs_in_steps if steps is None else steps  # null: every epoch; 0: no step (verl)
    param_dtype, _ = default_dtypes(env.device_type)
    teacher_vocab_limit = check_distillation_teacher(cfg, tokenizer)
    train_files = [cfg.data.train_files] if isinstance(cfg.data.train_files, str) else list(cfg.data.train_files)
    fingerprint = run_dir.fingerprint(cfg, train_files, len(train_prompts))
    offload = OffloadFlags.from_config(cfg)
    if pool is not None:  # a split job: every rank's engine first (vLLM sizes its memory over every rank)
        engine = build_engine(cfg, dims, env, meshes, tokenizer, train_prompts[0].token_ids, multi_turn, None,
                              param_dtype, reuse=engine, vision_run=vision_run,
                              images_per_prompt=max_images(train_prompts + val_prompts))
        if pool.is_trainer:
            rollout.sleep(engine.llm, 2)  # for good: the pool generates
    models = load_models(cfg, meshes, env, total_steps) if pool is None or pool.is_trainer else None
    if pool is not None and models is not None and models.lora_spec:  # what trainer 0 sends after the first sync
        engine.lora_modules = sync_modules(models.actor, rollout.packed_modules(engine.llm))
    # the reward model scores where the batch is generated: every rank collocated, the pool's ranks in a split
    reward_model = load_learned_reward_model(cfg, meshes, env, tokenizer) if pool is None or not pool.is_trainer else None
    source = why = "the rollout pool trains nothing"
    if models is not None:
        source, why = old_log_prob_source(models.actor, cfg.algorithm, plan.actor_update, plan.samples_per_rank,
                                          cfg.actor_rollout_ref.actor.calculate_sum_pi_squared)
    print0(f"old log-probs: {source} ({why})")
    in_flight = InFlight.from_config(cfg)
    # every rank resumes; a split job's rollout ranks hold no model, and read the pool's sampler and batch
    state = resume(cfg, out_dir, env.rank, checkpointed(models) if models is not None else {}, sampler,
                   models.kl_ctrl if models is not None else None, fingerprint,
                   (in_flight, meshes.rollout.get_local_rank("dp"), dims.rollout_dp) if in_flight else (None, 0, 1),
                   group=pool.trainer_group if pool is not None else None)
    start_step = state["step"] if state is not None else 0
    generated_ahead = load_generated_ahead(cfg, pool, state)
    if models is not None:  # placed as for the first weight sync before the engine starts: vLLM sizes its KV
        place(models, offload, LOADED, "sync", env.device, None)  # cache from the memory free then
    if pool is None:
        engine = build_engine(cfg, dims, env, meshes, tokenizer, train_prompts[0].token_ids, multi_turn, models,
                              param_dtype, reuse=engine, vision_run=vision_run,
                              images_per_prompt=max_images(train_prompts + val_prompts))
    tracker = Tracker(out_dir, cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                      shown(cfg), total_steps, enabled=env.rank == 0)
    if env.rank == 0:
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    # a rank that stops ends the job within trainer.hang_timeout_s, named, with every rank's stacks
    role = pool.role(env.rank) if pool is not None else None  # a split job's ranks enter their role's phases
    progress = (watchdog.start(out_dir, env.rank, env.world_size, cfg.trainer.hang_timeout_s, role=role,
                               order=placement.PHASE_ORDER[role] if role else None) if watch
                else watchdog.Progress(None))
    if models is None:  # a rollout rank: no model of its own
        models = Models(*[None] * len(fields(Models)))
    dp_group = pool.trainer_group if pool is not None and meshes.sp is None else train_dp_group(meshes)
    return Run(cfg=cfg, env=env, dims=dims, plan=plan, meshes=meshes, dp_group=dp_group,
               sp_group=meshes.sp.get_group("sp") if meshes.sp is not None else None, out_dir=out_dir,
               tokenizer=tokenizer, train_prompts=train_prompts, val_prompts=val_prompts, reward_fn=reward_fn,
               sampler=sampler, total_steps=total_steps, actor_loss=ActorLoss.from_config(cfg),
               param_dtype=param_dtype, offload=offload, old_log_probs_from=source,
               rollout_data_dir=Path(tc.rollout_data_dir) if tc.rollout_data_dir is not None else None,
               validation_data_dir=Path(tc.validation_data_dir or out_dir / "val_generations"),
               start_step=start_step, engine=engine, tracker=tracker, progress=progress, placement="sync", lock=lock,
               stop=run_dir.StopRequests(out_dir, install=watch), fingerprint=fingerprint,
               multi_turn=multi_turn, reward_model=reward_model, teacher_vocab_limit=teacher_vocab_limit,
               in_flight=in_flight, pool=pool, vision=vision_run, generated_ahead=generated_ahead, **vars(models))


def load_generated_ahead(cfg: Config, pool: placement.Pool | None,
                         state: dict[str, Any] | None) -> placement.Part | None:
    """The batch a split job's pool had generated ahead when the checkpoint was written (separate_async one step
    off), whole on the pool's first rank and a part with no rows on the others (placement.gather_batch), so that
    a pool of any size hands it on. A run that would not train it next refuses the checkpoint."""
    saved = state.get("generated_ahead") if state is not None else None
    if saved is None:
        return None
    ahead = cfg.trainer.v1.separate_async.num_warmup_batches
    if pool is None or ahead == 0:
        this_run = (f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode}" if pool is None
                    else "trainer.v1.separate_async.num_warmup_batches=0")
        raise ConfigError(
            f"the checkpoint of step {state['step']} holds step {state['step'] + 1}'s batch, generated ahead by the "
            f"rollout pool (trainer.v1.trainer_mode=separate_async, trainer.v1.separate_async.num_warmup_batches=1), "
            f"and this run ({this_run}) would not train it. Resume it with trainer_mode=separate_async, "
            f"actor_rollout_ref.hybrid_engine=false and num_warmup_batches=1 (any split), or from a checkpoint "
            f"without one (trainer.resume_mode=resume_path, trainer.resume_from_path=<the last step's checkpoint>).")
    if pool.is_trainer:
        return None
    whole = placement.batch_from_json(saved)
    return whole if pool.rank == pool.leader else placement.empty_part(whole)


def load_data(cfg: Config, dims: ParallelDims, env: DistEnv
              ) -> tuple[Any, list[Prompt], list[Prompt], RewardFn, MultiTurn | None, vision.VisionRun | None]:
    """The tokenizer, the training and validation prompts, the reward function (checked against the data),
    with multi-turn rollouts their tools, and for a vision-language model its processor (VisionRun)."""
    from transformers import AutoTokenizer

    data_cfg, model_cfg = cfg.data, cfg.actor_rollout_ref.model
    check_model(model_cfg.path, data_cfg.max_prompt_length + data_cfg.max_response_length,
                model_cfg.trust_remote_code, env.device_type, dims.infer_tp)
    check_sequence_parallel_heads(model_cfg.path, dims.sp, model_cfg.trust_remote_code, "actor_rollout_ref.model.path")
    if core.ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_critic and cfg.critic.model.path is not None:
        check_sequence_parallel_heads(cfg.critic.model.path, dims.sp, model_cfg.trust_remote_code, "critic.model.path")
    # the other models' configs can be read (one config error naming the key, not a traceback at load)
    critic_path = cfg.critic.model.path if core.ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_critic else None
    reward_path = cfg.reward_model.model.path if cfg.reward_model.enable else None
    for key, path, trust in (("critic.model.path", critic_path, model_cfg.trust_remote_code),
                             ("reward_model.model.path", reward_path, cfg.reward_model.model.trust_remote_code)):
        if path is not None:
            read_model_config(path, key, trust)
    model_config = read_model_config(model_cfg.path, "actor_rollout_ref.model.path", model_cfg.trust_remote_code)
    vision_run = None
    if vision.is_vision_config(model_config):  # what this program runs on a VLM, or one error naming the key
        check_vision_run(cfg, model_config.model_type)
        vision_run = vision.VisionRun.load(model_cfg.path, model_config, model_cfg.trust_remote_code)
    if vision_run is not None and data_cfg.tokenizer is None:
        tokenizer = vision_run.processor.tokenizer  # with the processor's chat template (image items)
    else:
        tokenizer = AutoTokenizer.from_pretrained(data_cfg.tokenizer or model_cfg.path,
                                                  trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    multi_turn = load_multi_turn(cfg, tokenizer)
    http_scorer = reward_remote.from_config(cfg.reward_model)  # reward_model.remote.url / judge.url: over HTTP
    rule_reward = cfg.custom_reward_function.path is None and http_scorer is None  # rules need each row's ground truth
    load_kwargs = dict(prompt_key=data_cfg.prompt_key, max_prompt_length=data_cfg.max_prompt_length,
                       filter_overlong=data_cfg.filter_overlong_prompts, truncation=data_cfg.truncation,
                       require_ground_truth=rule_reward, tools=multi_turn.schemas if multi_turn else None,
                       processor=vision_run.processor if vision_run is not None else None)
    train_prompts, overlong = load_prompts(data_cfg.train_files, tokenizer, key="data.train_files", **load_kwargs)
    print0(f"data: {len(train_prompts)} training prompts ({overlong} over data.max_prompt_length="
           f"{data_cfg.max_prompt_length}, {'dropped' if data_cfg.filter_overlong_prompts else 'truncated'})")
    val_prompts = []
    if data_cfg.val_files is not None:
        val_prompts, _ = load_prompts(data_cfg.val_files, tokenizer, key="data.val_files", **load_kwargs)
        val_prompts = val_prompts[:data_cfg.max_val_samples] if data_cfg.max_val_samples else val_prompts
        check_validation_share(len(val_prompts), dims, data_cfg.max_val_samples)
    reward_fn = http_scorer or load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                              cfg.reward_model.sandbox_fusion)
    if rule_reward:  # a data source without a rule, or code sets where no sandbox runs: fail now, not after a rollout
        sources = {p.data_source for p in train_prompts + val_prompts}
        check_data_sources(sources)
        check_code_sandbox(sources, cfg.reward_model.sandbox_fusion)
    return tokenizer, train_prompts, val_prompts, reward_fn, multi_turn, vision_run


def max_images(prompts: list[Prompt]) -> int:
    """The most images a prompt holds: what a VLM's engine is built to take (0: a text run)."""
    return max((len(p.images) for p in prompts), default=0)


@dataclass
class MultiTurn:
    """What multi-turn rollouts need beside the engine (actor_rollout_ref.rollout.multi_turn)."""

    section: Config
    tools: dict[str, Any]  # name -> agent.BaseTool
    schemas: list[dict[str, Any]]  # the tools' schemas, rendered into every prompt
    renderer: Any  # agent.ObservationRenderer: a reply -> the ids that follow the assistant's turn
    stop_token_ids: list[int]  # what ends an assistant turn
    limits: TurnLimits  # multi_turn.max_assistant_turns, max_user_turns
    environment_class: type | None = None  # multi_turn.environment; None: agent.ToolEnvironment

    def environment(self, row: Prompt) -> Any:
        """A fresh environment for one trajectory of `row`, reset."""
        import agent

        if self.environment_class is not None:
            env = self.environment_class()
        else:
            env = agent.ToolEnvironment.from_config(self.section, self.tools)
        env.reset(row)
        return env


def load_multi_turn(cfg: Config, tokenizer: Any) -> MultiTurn | None:
    """The tools (verl's tool_config_path YAML, function_tool_path functions) and the chat template's
    observation renderer, when multi-turn rollouts are on."""
    section = cfg.actor_rollout_ref.rollout.multi_turn
    if not section.enable:
        return None
    import agent

    tools = (agent.load_tools(section.tool_config_path, section.function_tool_path)
             if section.tool_config_path or section.function_tool_path else {})
    schemas = agent.tool_schemas(tools)
    environment_class = agent.load_environment_class(section.environment) if section.environment else None
    return MultiTurn(section, tools, schemas, agent.ObservationRenderer(tokenizer, schemas or None),
                     agent.end_of_turn_ids(tokenizer), TurnLimits(section.max_assistant_turns, section.max_user_turns),
                     environment_class)


@dataclass
class Models:
    """load_models' result: the actor and critic with their optimizers and schedules, and the frozen models."""

    actor: torch.nn.Module
    actor_optim: torch.optim.Optimizer
    actor_sched: Any
    ref: torch.nn.Module | None  # the reference model for a KL term; with LoRA the actor, adapter off
    reference_mode: Callable[[], contextlib.AbstractContextManager]
    teacher: torch.nn.Module | None  # distillation.enabled: the frozen teacher
    critic: torch.nn.Module | None
    critic_optim: torch.optim.Optimizer | None
    critic_sched: Any
    kl_ctrl: core.FixedKLController
    lora_spec: LoraSpec | None


def load_models(cfg: Config, meshes: Meshes, env: DistEnv, total_steps: int) -> Models:
    """Actor (+ reference model for a KL term, + teacher for distillation, + critic for GAE), FSDP2 on the FSDP
    mesh, with optimizers.

    The actor and critic are plain FSDP2 modules that move_to offloads between phases; only the
    reference model, never stepped, streams its shards from the host (CPUOffloadPolicy). With LoRA the
    actor is the frozen model plus a peft adapter, and the reference is the actor with the adapter off."""
    model_cfg, actor_cfg, critic_cfg = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor, cfg.critic
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    fsdp_kwargs = dict(device=env.device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       trust_remote_code=model_cfg.trust_remote_code)
    if meshes.sp is not None:  # sdpa, plus the all-to-alls when a forward is given the sp group
        fsdp_kwargs["attn_implementation"] = ulysses.register_ulysses_attention()
    lora_spec = LoraSpec.from_config(model_cfg)
    actor = load_causal_lm(model_cfg.path, meshes.fsdp,
                           reshard_after_forward=actor_cfg.fsdp_config.reshard_after_forward,
                           activation_checkpointing=model_cfg.enable_gradient_checkpointing,
                           wrap=lora_spec.add_adapter if lora_spec else None, **fsdp_kwargs)
    check_router_replay(actor, actor_cfg.router_replay.mode)  # R2 needs a MoE's routers
    if actor_cfg.freeze_vision_tower:  # before the optimizer: the tower gets no state
        freeze_vision_tower(actor)
    actor_optim, actor_sched = make_optimizer(actor, actor_cfg.optim, total_steps)
    ref, reference_mode = None, contextlib.nullcontext
    if (actor_cfg.use_kl_loss or cfg.algorithm.use_kl_in_reward) and lora_spec:
        ref, reference_mode = actor, actor.disable_adapter  # the base model, for free: no second copy
    elif actor_cfg.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref = load_frozen_model(load_causal_lm, model_cfg.path, meshes.fsdp,
                                param_offload=cfg.actor_rollout_ref.ref.fsdp_config.param_offload, **fsdp_kwargs)
    teacher = None
    if cfg.distillation.enabled:  # frozen, as the reference model: its shards on the host with param_offload
        teacher_cfg = cfg.distillation.teacher_models.teacher_model
        teacher = load_frozen_model(load_causal_lm, teacher_cfg.model_path, meshes.fsdp,
                                    param_offload=teacher_cfg.fsdp_config.param_offload, **fsdp_kwargs)
    critic = critic_optim = critic_sched = None
    if core.ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_critic:
        critic = load_value_model(critic_cfg.model.path or model_cfg.path, meshes.fsdp,
                                  reshard_after_forward=critic_cfg.fsdp_config.reshard_after_forward,
                                  activation_checkpointing=critic_cfg.model.enable_gradient_checkpointing,
                                  **fsdp_kwargs)
        critic_optim, critic_sched = make_optimizer(critic, critic_cfg.optim, total_steps)
    kl_cfg = cfg.algorithm.kl_ctrl
    kl_ctrl = (core.AdaptiveKLController(kl_cfg.kl_coef, kl_cfg.target_kl, kl_cfg.horizon)
               if kl_cfg.type == "adaptive" else core.FixedKLController(kl_cfg.kl_coef))
    return Models(actor=actor, actor_optim=actor_optim, actor_sched=actor_sched, ref=ref, reference_mode=reference_mode,
                  teacher=teacher, critic=critic, critic_optim=critic_optim, critic_sched=critic_sched, kl_ctrl=kl_ctrl,
                  lora_spec=lora_spec)


def check_distillation_teacher(cfg: Config, tokenizer: Any) -> int | None:
    """distillation.enabled: the teacher reads the actor's token ids (models.check_teacher), before anything
    loads; the ids its top-k may name. None without distillation."""
    if not cfg.distillation.enabled:
        return None
    from transformers import AutoConfig

    model_cfg = cfg.actor_rollout_ref.model
    student_rows = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code).vocab_size
    limit = check_teacher(cfg.distillation.teacher_models.teacher_model.model_path, tokenizer, student_rows,
                          model_cfg.trust_remote_code)
    print0(f"teacher: {cfg.distillation.teacher_models.teacher_model.model_path} (the actor's tokenizer, {limit} ids)")
    return limit


def load_learned_reward_model(cfg: Config, meshes: Meshes, env: DistEnv, tokenizer: Any) -> RewardModel | None:
    """reward_model.enable: the reward model, FSDP2 on the actor's FSDP mesh (a split job's pool: over the
    pool's ranks, meshes.pool_fsdp, which score there), a frozen model as the reference is (its shards on the
    host outside its forward with model.fsdp_config.param_offload)."""
    if not cfg.reward_model.enable:
        return None
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    mesh = meshes.pool_fsdp if meshes.pool_fsdp is not None else meshes.fsdp
    rm = RewardModel.build(cfg, mesh, env.device, tokenizer,
                           cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu,
                           param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ranks = mesh.mesh.flatten().tolist()  # (HSDP: both dims)
    if env.rank == ranks[0]:  # the first rank that holds it: a split job's pool leader, not rank 0
        print(f"reward model: {cfg.reward_model.model.path} ("
              f"{'re-rendered as text for its own tokenizer' if rm.tokenizer is not None else 'reads the rollout ids'})"
              f" on ranks {ranks}", flush=True)
    return rm


def resume(cfg: Config, out_dir: Path, rank: int, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]],
           sampler: PromptSampler, kl_ctrl: core.FixedKLController | None, fingerprint: dict[str, Any],
           in_flight: tuple[InFlight | None, int, int] = (None, 0, 1),
           group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """Load the latest complete checkpoint, if any (DCP reshards it to the size of `group`, the ranks holding
    the models: a split job's trainers), into the models (checkpointed; none on a rollout rank), the prompt
    sampler, the KL controller and, with colocate_async, in_flight's first element (this rollout dp group's
    carried samples: (InFlight, dp rank, rollout dp size)); returns its trainer state (None: no checkpoint).
    Rank 0 chooses it for every rank (checkpoint.resume_checkpoint: in auto mode a damaged one is skipped for the
    next older), moves checkpoints later than a rewind's aside (checkpoint.abandon_later), and compares the config
    and data with the checkpoint's (run_dir.check_resume); the config's optimizer settings then replace the
    checkpoint's."""
    tc = cfg.trainer

    def prepare(path: Path) -> None:  # rank 0, for the checkpoint it picked
        for moved in abandon_later(out_dir, path):
            print0(f"rewound to {path.name}: moved the later {moved.name} to {moved.parent}")
        saved = json.loads((path / STATE_FILE).read_text()).get("fingerprint")
        for line in run_dir.check_resume(path, saved, fingerprint, tc.resume_force):
            print0(f"changed since the checkpoint: {line}")

    found = resume_checkpoint(tc.resume_mode, out_dir, tc.resume_from_path, models, group, prepare)
    state = None
    if found is not None:
        path, state = found
        sampler.load_state_dict(state["sampler"])
        if kl_ctrl is not None:
            kl_ctrl.load_state_dict(state["kl_ctrl"])
        load_in_flight(*in_flight, state.get("in_flight"), path)
        for name, (_, optimizer, sched) in models.items():
            optim_cfg = (cfg.critic if name == "critic" else cfg.actor_rollout_ref.actor).optim
            for change in set_optimizer_config(optimizer, sched, optim_cfg):
                print0(f"{name} optimizer, from the config over the checkpoint's: {change}")
        print0(f"resumed from {path} (step {state['step']}, written by {state['world_size']} ranks)")
    if rank == 0:
        truncate_metrics(out_dir / "metrics.jsonl", state["step"] if state is not None else 0)
    return state


def engine_settings(cfg: Config, dims: ParallelDims, device_type: str) -> dict[str, Any]:
    """What the rollout engine is built with (rollout.build_rollout_engine's arguments)."""
    data_cfg, rollout_cfg, model_cfg = cfg.data, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    max_model_len = data_cfg.max_prompt_length + data_cfg.max_response_length
    return dict(
        model_path=model_cfg.path, tensor_model_parallel_size=dims.infer_tp, max_model_len=max_model_len,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        dtype="bfloat16" if device_type == "cuda" else "float32", enforce_eager=rollout_cfg.enforce_eager,
        cpu_kv_cache_gib=rollout_cfg.cpu_kv_cache_space_gb, max_num_seqs=rollout_cfg.max_num_seqs,
        max_num_batched_tokens=max(rollout_cfg.max_num_batched_tokens, max_model_len),
        trust_remote_code=model_cfg.trust_remote_code)


def build_engine(cfg: Config, dims: ParallelDims, env: DistEnv, meshes: Meshes, tokenizer: Any, probe: list[int],
                 multi_turn: MultiTurn | None, models: Models | None, param_dtype: torch.dtype,
                 reuse: Engine | None = None, vision_run: vision.VisionRun | None = None,
                 images_per_prompt: int = 0) -> Engine:
    """One vLLM shard per rank, TP over the rows of the rollout mesh, after the models are placed (or
    `reuse`'s engine, when given); the sampling settings of training and validation; the probes of the
    stale-weights check (`probe`: a training prompt's ids; a VLM's without its image pads, text alone).
    A vision-language model's engine takes up to images_per_prompt images per prompt (at least 1), and
    neither sampling samples its image/video pads (VisionRun.banned_token_ids)."""
    data_cfg, rollout_cfg = cfg.data, cfg.actor_rollout_ref.rollout
    if reuse is None:
        settings = engine_settings(cfg, dims, env.device_type)
        built = dict(settings)
        if vision_run is not None:
            built["images_per_prompt"] = max(images_per_prompt, 1)
        # a split job: vLLM groups every rank (meshes.engines); a pool engine takes its seed from its dp rank there
        generates = meshes.engines is None or meshes.rollout.get_coordinate() is not None
        seed = meshes.rollout.get_local_rank("dp") if generates else 0
        llm = rollout.build_rollout_engine(built.pop("model_path"), meshes.engines if meshes.engines is not None else meshes.rollout, seed=seed,
                                           **{k: v for k, v in built.items() if k != "tensor_model_parallel_size"})
    else:
        llm, settings = reuse.llm, reuse.settings
    # a response ends at the EOS id; a multi-turn assistant turn at the chat template's end of turn
    stop = multi_turn.stop_token_ids if multi_turn is not None else [tokenizer.eos_token_id]
    limits = dict(max_tokens=data_cfg.max_response_length, max_prompt_length=data_cfg.max_prompt_length,
                  stop_token_ids=tuple(stop), pad_token_id=tokenizer.pad_token_id,
                  banned_token_ids=vision_run.banned_token_ids if vision_run is not None else ())
    seed = cfg.trainer.seed
    train_sampling = rollout.Sampling(n=rollout_cfg.n, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p,
                                      top_k=rollout_cfg.top_k, seed=seed, **limits)
    val = rollout_cfg.val_kwargs
    val_temperature = val.temperature
    val_sampling = rollout.Sampling(n=val.n, temperature=val_temperature if val.do_sample else 0.0,
                                    top_p=val.top_p, top_k=val.top_k, seed=seed + rollout.VALIDATION_SEED_OFFSET,
                                    **limits)
    # A fixed prompt whose greedy log-probs fingerprint the engine's weights, and a fixed sequence (the
    # prompt's first tokens and its last few) whose log-probs under the actor say whether the actor moved.
    if vision_run is not None:  # no image goes with the probe
        probe = [t for t in probe if t not in vision_run.banned_token_ids]
    tail = list(probe[-4:])
    probe_batch = rollout.pad_rollout([probe], [tail], [[0.0] * len(tail)], [0], len(tail), tokenizer.pad_token_id)
    actor_probe = {k: v.to(env.device) for k, v in vars(probe_batch).items()}
    if vision_run is not None and models is not None:  # a VLM's forward takes 4-row positions and (no) pixels
        actor_probe["prompt_index"] = torch.zeros(1, dtype=torch.long, device=env.device)
        actor_probe.update(vision_run.batch_columns(models.actor, actor_probe, [Prompt(probe, None, "probe", "")]))
    stale_check = rollout.StaleWeightsCheck(rollout.STALE_TOLERANCE[str(param_dtype).removeprefix("torch.")])
    lora_modules = sync_modules(models.actor, rollout.packed_modules(llm)) if models and models.lora_spec else None
    return Engine(llm, settings, train_sampling, val_sampling, probe, actor_probe, stale_check, lora_modules)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a config the user must change: one clear line, no traceback
        print(f"[rank {os.environ.get('RANK', 0)}] config error: {e}", flush=True)
        raise SystemExit(2) from None
