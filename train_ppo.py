"""PPO / GRPO post-training of an LLM: one SPMD program, FSDP2 actor + collocated vLLM, no Ray.

Every rank runs this file top to bottom. It holds an FSDP2 shard of the actor (and critic and
reference model when the algorithm needs them) *and* a shard of a vLLM engine on its rollout
tensor-parallel group, and alternates: sync weights -> generate -> score -> recompute log-probs and
values -> advantages -> update. The device map is verl's (see `python mesh_utils.py --config X`).

    # one CPU box, the tiny embedded demo (what `make demo` runs, after building its assets)
    torchrun --standalone --nproc_per_node=2 train_ppo.py --config configs/tiny_cpu.yaml
    # the seed's job: 1 node x 6 GPUs, GRPO on GSM8K
    torchrun --standalone --nproc_per_node=6 train_ppo.py --config configs/seed_1node_6gpu.yaml
    # 2 nodes (SLURM): sbatch launch/slurm_multinode.sbatch configs/seed_2node_6gpu.yaml
    # any key can be overridden: ... actor_rollout_ref.rollout.n=8 trainer.total_training_steps=100

Deliberate simplifications: rewards are rule functions (no reward model); Ulysses sequence
parallelism is planned and meshed but not yet used by the training forward (sp must be 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ppo_core as core
from checkpoint import find_resume_path, load_checkpoint, save_checkpoint, step_seed
from config import ConfigError, load_config, to_yaml
from data import PromptSampler, load_prompts
from mesh_utils import build_meshes, check_launch, describe, init_distributed, node_rank, print0, validate
from models import (
    compute_log_probs,
    compute_values,
    default_dtypes,
    iter_full_params,
    load_causal_lm,
    load_fsdp_model_to_device,
    load_optimizer,
    load_value_model,
    offload_fsdp_model_to_cpu,
    offload_optimizer,
)
from rewards import load_reward_fn, score_responses
from tracking import Tracker, plot_metrics, summary, timed


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
# Small helpers the loop below uses


def lr_lambda(optim_cfg: dict, total_steps: int):  # noqa: ANN201 - returns a schedule function
    """Linear warmup, then constant or cosine down to min_lr_ratio (verl's warmup_style)."""
    warmup = optim_cfg["lr_warmup_steps"]
    if warmup < 0:
        warmup = int(optim_cfg["lr_warmup_steps_ratio"] * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim_cfg["warmup_style"] == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        floor = optim_cfg["min_lr_ratio"]
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def make_optimizer(model: torch.nn.Module, optim_cfg: dict, total_steps: int):  # noqa: ANN201
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg["lr"], betas=tuple(optim_cfg["betas"]),
                                  weight_decay=optim_cfg["weight_decay"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))


def reduce_metrics(local: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean over ranks, except */max and */min which take the max / min."""
    keys = sorted(local)
    out = {}
    for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.endswith(("/max", "/min"))),
                     (dist.ReduceOp.MAX, lambda k: k.endswith("/max")),
                     (dist.ReduceOp.MIN, lambda k: k.endswith("/min"))):
        names = [k for k in keys if pick(k)]
        if not names:
            continue
        t = torch.tensor([float(local[k]) for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        if op == dist.ReduceOp.SUM:
            t /= dist.get_world_size()
        out.update(zip(names, t.tolist(), strict=True))
    return out


def gather_in_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate equal-sized 1D tensors of every rank of `group`, in group-rank order."""
    out = torch.empty(x.numel() * dist.get_world_size(group), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def peak_memory_gb(device: torch.device) -> float:
    """Accelerator peak allocation, or the process's peak RSS on a CPU run."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def check_model_length(path: str, needed: int, trust_remote_code: bool) -> None:
    """Prompt + response must fit the model's context, or the engine refuses at start (or worse)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                    "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {needed} tokens exceeds the model's "
            f"max_position_embeddings={limit} ({path}); lower one of them so their sum is <= {limit}."
        )


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint: they are about to be redone."""
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in lines))


def write_rank_layout(out_dir: Path, rank: int, meshes) -> None:  # noqa: ANN001
    """Each rank records the groups it actually joined, to compare with the planner's map."""
    def ranks(mesh, dim: str) -> list[int]:  # noqa: ANN001
        return dist.get_process_group_ranks(mesh.get_group(dim))

    out_dir.mkdir(parents=True, exist_ok=True)
    layout = {"rank": rank, "node_rank": node_rank(), "hostname": os.uname().nodename, "pid": os.getpid(),
              "fsdp_group": ranks(meshes.fsdp, "fsdp"), "rollout_tp_group": ranks(meshes.rollout, "infer_tp"),
              "rollout_dp_rank": meshes.rollout.get_local_rank("dp")}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(layout))


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


# -----------------------------------------------------------------------------
# Forward passes in micro batches (no grad): old log-probs, reference log-probs, values


@torch.no_grad()
def forward_log_probs(model: torch.nn.Module, batch: dict, micro: int, temperature: float,
                      entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    return compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                             batch["responses"].shape[1], temperature, micro, calc_entropy=entropy)


@torch.no_grad()
def forward_values(critic: torch.nn.Module, batch: dict, micro: int) -> torch.Tensor:
    """V(s_t) for each response token: the critic's output at the position that predicts it."""
    return compute_values(critic, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                     batch["responses"].shape[1], micro)


# -----------------------------------------------------------------------------
# Updates: ppo_epochs x mini batches x micro batches, loss scaled so the gradient does not depend
# on how a mini batch is cut (see ppo_core's module docstring)


def micro_batches(batch: dict, rows: torch.Tensor, size: int) -> list[dict]:
    return [{k: v[rows[i:i + size]] for k, v in batch.items()} for i in range(0, len(rows), size)]


def optimizer_step(model, optimizer, grad_clip: float, prefix: str, metrics: dict) -> bool:  # noqa: ANN001
    """Clip and step; a non-finite gradient skips the step (counted in <prefix>/skipped_steps)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    ok = bool(torch.isfinite(grad_norm))
    if ok:
        optimizer.step()
    else:
        print(f"[rank {dist.get_rank()}] warning: non-finite {prefix} grad norm {grad_norm.item()}; "
              f"skipping this update", flush=True)
        metrics[f"{prefix}/skipped_steps"] = metrics.get(f"{prefix}/skipped_steps", 0) + 1
    optimizer.zero_grad(set_to_none=True)
    metrics[f"{prefix}/grad_norm"] = grad_norm.item() if ok else float("nan")
    return ok


def update_actor(actor, optimizer, batch: dict, cfg, plan, world: int, generator: torch.Generator) -> dict:  # noqa: ANN001
    a = cfg.actor_rollout_ref.actor
    temperature = cfg.actor_rollout_ref.rollout.temperature
    metrics: dict[str, float] = {}
    sums = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0,
            "actor/kl_loss": 0.0, "actor/entropy_loss": 0.0}
    n = batch["responses"].shape[0]
    updates = 0
    for _ in range(a.ppo_epochs):
        order = torch.randperm(n, generator=generator) if a.shuffle else torch.arange(n)
        for start in range(0, n, plan.ppo_mini_batch_size_per_rank):
            mini = micro_batches(batch, order[start:start + plan.ppo_mini_batch_size_per_rank],
                                 plan.ppo_micro_batch_size_per_gpu)
            num_tokens, num_seqs = core.global_num_tokens_and_seqs([mb["response_mask"] for mb in mini])
            scale = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, dp_size=world,
                         loss_scale_factor=cfg.data.max_response_length)
            for i, mb in enumerate(mini):
                actor.set_requires_gradient_sync(i == len(mini) - 1)  # reduce-scatter once per mini batch
                log_prob, entropy = compute_log_probs(
                    actor, mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["responses"].shape[1],
                    temperature, plan.ppo_micro_batch_size_per_gpu, calc_entropy=a.entropy_coeff != 0)
                mask = mb["response_mask"]
                pg_loss, clipfrac, ppo_kl, clipfrac_lower = core.compute_policy_loss(
                    mb["old_log_probs"], log_prob, mb["advantages"], mask, a.clip_ratio_low, a.clip_ratio_high,
                    a.clip_ratio_c, a.loss_agg_mode, **scale)
                loss = pg_loss
                if a.entropy_coeff != 0:
                    entropy_loss = core.agg_loss(entropy, mask, a.loss_agg_mode, **scale)
                    loss = loss - a.entropy_coeff * entropy_loss
                    sums["actor/entropy_loss"] += entropy_loss.item()
                if a.use_kl_loss:
                    kl = core.kl_penalty(log_prob, mb["ref_log_probs"], a.kl_loss_type)
                    kl_loss = core.agg_loss(kl, mask, a.loss_agg_mode, **scale)
                    loss = loss + a.kl_loss_coef * kl_loss
                    sums["actor/kl_loss"] += kl_loss.item()
                # A non-finite loss still goes through backward: its NaN reaches every rank's
                # gradient through the reduce-scatter, so all ranks skip the step together below.
                loss.backward()
                # micro-batch shares: their sum over the mini batch, averaged over ranks (reduce_metrics),
                # is the mini batch's loss, because each share is scaled by dp_size / global count
                sums["actor/pg_loss"] += pg_loss.item()
                sums["actor/pg_clipfrac"] += clipfrac.item() / len(mini)
                sums["actor/ppo_kl"] += ppo_kl.item() / len(mini)
                sums["actor/pg_clipfrac_lower"] += clipfrac_lower.item() / len(mini)
            optimizer_step(actor, optimizer, a.grad_clip, "actor", metrics)
            updates += 1
    metrics.update({k: v / updates for k, v in sums.items()})
    return metrics


def update_critic(critic, optimizer, batch: dict, cfg, plan, world: int, generator: torch.Generator) -> dict:  # noqa: ANN001
    c = cfg.critic
    metrics: dict[str, float] = {}
    sums = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
    n = batch["responses"].shape[0]
    size, micro = plan.critic_ppo_mini_batch_size_per_rank, plan.critic_ppo_micro_batch_size_per_gpu
    updates = 0
    for _ in range(c.ppo_epochs or cfg.actor_rollout_ref.actor.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            mini = micro_batches(batch, order[start:start + size], micro)
            num_tokens, num_seqs = core.global_num_tokens_and_seqs([mb["response_mask"] for mb in mini])
            for i, mb in enumerate(mini):
                critic.set_requires_gradient_sync(i == len(mini) - 1)
                vpreds = compute_values(critic, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                   mb["responses"].shape[1], micro)
                vf_loss, vf_clipfrac = core.compute_value_loss(
                    vpreds, mb["returns"], mb["values"], mb["response_mask"], c.cliprange_value, c.loss_agg_mode,
                    global_num_tokens=num_tokens, global_num_seqs=num_seqs, dp_size=world,
                    loss_scale_factor=cfg.data.max_response_length)
                vf_loss.backward()
                sums["critic/vf_loss"] += vf_loss.item()
                sums["critic/vf_clipfrac"] += vf_clipfrac.item() / len(mini)
            optimizer_step(critic, optimizer, c.grad_clip, "critic", metrics)
            updates += 1
    metrics.update({k: v / updates for k, v in sums.items()})
    return metrics


# -----------------------------------------------------------------------------
# Validation: greedy (rollout.val_kwargs), each rollout dp group on its share of the held-out set


def run_validation(llm, prompts: list, tokenizer, reward_fn, cfg, meshes, step: int,  # noqa: ANN001
                   device: torch.device) -> dict:
    """Greedy scores on the held-out prompts; each group's generations go to
    <default_local_dir>/val_generations/step<N>_dp<g>.jsonl for a person (or a test) to read."""
    from rollout import generate

    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    dp, dp_rank = meshes.rollout.size(0), meshes.rollout.get_local_rank("dp")
    usable = len(prompts) - len(prompts) % dp  # equal shares; the remainder (< dp prompts) is skipped
    share = list(range(usable))[dp_rank * (usable // dp):(dp_rank + 1) * (usable // dp)]
    batch = generate(llm, [prompts[i].token_ids for i in share], n=vk.n,
                     temperature=vk.temperature if vk.do_sample else 0.0, top_p=vk.top_p, top_k=vk.top_k,
                     max_tokens=cfg.data.max_response_length, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, seed=cfg.trainer.seed + 7919, step=step,
                     prompt_indices=share, max_prompt_length=cfg.data.max_prompt_length)
    rows = [prompts[i] for i in batch.prompt_index.tolist()]
    texts = tokenizer.batch_decode([r[m.bool()] for r, m in zip(batch.responses, batch.response_mask,
                                                                 strict=True)], skip_special_tokens=True)
    scores = score_responses(reward_fn, [p.data_source for p in rows], texts, [p.ground_truth for p in rows],
                             [p.text for p in rows])
    if meshes.rollout.get_local_rank("infer_tp") == 0:
        out = Path(cfg.trainer.default_local_dir) / "val_generations"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"step{step}_dp{dp_rank}.jsonl", "w") as f:
            for p, text, score in zip(rows, texts, scores, strict=True):
                f.write(json.dumps({"prompt": p.text, "response": text, "ground_truth": p.ground_truth,
                                    "score": score}) + "\n")
    # every rank of a TP group scored the same samples: sum over the dp dimension only
    t = torch.tensor([sum(scores), len(scores)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=meshes.rollout.get_group("dp"))
    return {"val/score": (t[0] / t[1]).item(), "val/num_samples": t[1].item()}


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    # --- config and layout: pure arithmetic, fails before anything heavy -----------------------
    cfg = load_config(args.config, args.overrides)
    if cfg.actor_rollout_ref.nccl_timeout <= 0:
        raise ConfigError(f"actor_rollout_ref.nccl_timeout={cfg.actor_rollout_ref.nccl_timeout} must be a "
                          "positive number of seconds (how long a collective may wait), e.g. 1800.")
    env = init_distributed(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    dims, plan = validate(cfg, env.world_size)
    check_launch(dims, env)
    if dims.sp > 1:
        raise ConfigError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={dims.sp}: the ('dp','sp') mesh is built "
            f"and planned, but the training forward does not shard sequences yet; set it to 1."
        )
    print0(to_yaml(cfg))
    print0(describe(cfg, dims, plan))
    meshes = build_meshes(dims, env.device_type, timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    rank, world, device = env.rank, env.world_size, env.device
    write_rank_layout(Path(cfg.trainer.default_local_dir) / "layout", env.rank, meshes)
    tp_rank, tp_size = meshes.rollout.get_local_rank("infer_tp"), dims.infer_tp
    dp_rank = meshes.rollout.get_local_rank("dp")
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)

    # --- data and reward -------------------------------------------------------------------------
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or arr.model.path,
                                              trust_remote_code=arr.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.data.train_files is None:
        raise ConfigError("data.train_files is not set; give parquet/jsonl files in verl's row format.")
    load_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                       filter_overlong=cfg.data.filter_overlong_prompts, truncation=cfg.data.truncation)
    train_prompts, overlong = load_prompts(cfg.data.train_files, tokenizer, key="data.train_files", **load_kwargs)
    print0(f"data: {len(train_prompts)} training prompts ({overlong} over data.max_prompt_length="
           f"{cfg.data.max_prompt_length}, {'dropped' if cfg.data.filter_overlong_prompts else 'truncated'})")
    val_prompts = []
    if cfg.data.val_files is not None:
        val_prompts, _ = load_prompts(cfg.data.val_files, tokenizer, key="data.val_files", **load_kwargs)
        val_prompts = val_prompts[:cfg.data.max_val_samples] if cfg.data.max_val_samples else val_prompts
    reward_fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    sampler = PromptSampler(len(train_prompts), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
    total_steps = cfg.trainer.total_training_steps or sampler.batches_per_epoch * cfg.trainer.total_epochs

    check_model_length(arr.model.path, cfg.data.max_prompt_length + cfg.data.max_response_length,
                       arr.model.trust_remote_code)

    # --- models: actor (+ reference for KL, + critic for GAE), FSDP2 on the FSDP mesh ---------------
    param_dtype, reduce_dtype = default_dtypes(env.device_type)
    fsdp_kwargs = dict(device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       trust_remote_code=arr.model.trust_remote_code)
    actor = load_causal_lm(arr.model.path, meshes.fsdp, cpu_offload=arr.actor.fsdp_config.param_offload,
                           reshard_after_forward=arr.actor.fsdp_config.reshard_after_forward,
                           activation_checkpointing=arr.model.enable_gradient_checkpointing, **fsdp_kwargs)
    actor_optim, actor_sched = make_optimizer(actor, dict(arr.actor.optim), total_steps)
    need_ref = arr.actor.use_kl_loss or algo.use_kl_in_reward
    ref = load_causal_lm(arr.model.path, meshes.fsdp, cpu_offload=arr.ref.fsdp_config.param_offload,
                         **fsdp_kwargs).eval() if need_ref else None
    critic = critic_optim = critic_sched = None
    if algo.adv_estimator == "gae":
        critic = load_value_model(cfg.critic.model.path or arr.model.path, meshes.fsdp,
                                  cpu_offload=cfg.critic.fsdp_config.param_offload,
                                  activation_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
                                  **fsdp_kwargs)
        critic_optim, critic_sched = make_optimizer(critic, dict(cfg.critic.optim), total_steps)
    kl_ctrl = (core.AdaptiveKLController(algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
               if algo.kl_ctrl.type == "adaptive" else core.FixedKLController(algo.kl_ctrl.kl_coef))

    # --- resume: the latest complete checkpoint (DCP reshards it to this world size) ---------------
    out_dir = Path(cfg.trainer.default_local_dir)
    ckpt_models = {"actor": (actor, actor_optim, actor_sched)}
    if critic is not None:
        ckpt_models["critic"] = (critic, critic_optim, critic_sched)
    start_step = 0
    resume_path = find_resume_path(cfg.trainer.resume_mode, out_dir, cfg.trainer.resume_from_path)
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

    llm = ro.build_rollout_engine(
        arr.model.path, meshes.rollout,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        dtype="bfloat16" if env.device_type == "cuda" else "float32", enforce_eager=arr.rollout.enforce_eager,
        cpu_kv_cache_gib=arr.rollout.cpu_kv_cache_space_gb, max_num_seqs=arr.rollout.max_num_seqs,
        max_num_batched_tokens=max(arr.rollout.max_num_batched_tokens,
                                   cfg.data.max_prompt_length + cfg.data.max_response_length))
    probe = train_prompts[0].token_ids  # a fixed prompt whose logprobs fingerprint the engine's weights
    tracker = Tracker(out_dir, cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                      dict(cfg), total_steps, enabled=rank == 0)
    if rank == 0:
        (out_dir / "config.yaml").write_text(to_yaml(cfg))

    def sync() -> float:
        return ro.sync_weights(llm, iter_full_params(actor, dtype=param_dtype))

    # --- the loop ----------------------------------------------------------------------------------
    fingerprint = None
    updated = False  # did the last step change the actor? (then the engine must change too)
    consecutive_skips = 0
    for step in range(start_step + 1, total_steps + 1):
        metrics: dict[str, float] = {}
        step_start = time.perf_counter()
        # Everything random in this step derives from (seed, step, rank): a resumed step repeats exactly.
        torch.manual_seed(step_seed(cfg.trainer.seed, step, rank))
        generator = torch.Generator().manual_seed(step_seed(cfg.trainer.seed, step, rank))

        # 1. weight sync: the engine samples from the current actor; check the update reached it
        metrics["timing_s/sync_weights"] = sync()
        new_fingerprint = ro.engine_fingerprint(llm, probe)
        if updated and fingerprint is not None:
            ro.assert_weights_changed(fingerprint, new_fingerprint)
        fingerprint = new_fingerprint
        if step == 1 and cfg.trainer.val_before_train and val_prompts:
            val = run_validation(llm, val_prompts, tokenizer, reward_fn, cfg, meshes, 0, device)
            print0(f"validation before training: val/score {val['val/score']:.3f}")
            tracker.log(0, val)
        if arr.actor.fsdp_config.param_offload:  # free the accelerator for the engine (seed, 3.2)
            offload_fsdp_model_to_cpu(actor)

        # 2. generate: this rollout dp group's share of the step's prompts, n samples each
        with timed(metrics, "gen"):
            indices = sampler.next_batch()  # same on every rank
            mine = ro.shard_for_dp(indices, dp_rank, dims.rollout_dp)
            group = ro.generate(llm, [train_prompts[i].token_ids for i in mine], n=arr.rollout.n,
                                temperature=arr.rollout.temperature, top_p=arr.rollout.top_p,
                                top_k=arr.rollout.top_k, max_tokens=cfg.data.max_response_length,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                seed=cfg.trainer.seed, step=step, prompt_indices=mine,
                                max_prompt_length=cfg.data.max_prompt_length)
        ro.sleep(llm)
        if arr.actor.fsdp_config.param_offload:
            load_fsdp_model_to_device(actor, device)
        # training is data parallel over all ranks: TP rank r keeps slice r of its group's samples
        share = ro.split_for_training(group, tp_rank, tp_size)
        batch = {k: v.to(device) for k, v in vars(share).items()}
        mask = batch["response_mask"].float()  # (B, R)
        lengths = batch["response_mask"].sum(-1)  # (B,)

        # 3. reward: a rule score at each response's last token
        with timed(metrics, "reward"):
            rows = [train_prompts[i] for i in share.prompt_index.tolist()]
            texts = tokenizer.batch_decode([r[m.bool()] for r, m in zip(share.responses, share.response_mask,
                                                                         strict=True)], skip_special_tokens=True)
            scores = torch.tensor(score_responses(reward_fn, [p.data_source for p in rows], texts,
                                                  [p.ground_truth for p in rows], [p.text for p in rows]),
                                  dtype=torch.float32, device=device)  # (B,)
            token_scores = torch.zeros_like(mask)  # (B, R)
            token_scores[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores

        # 4. old log-probs (and the sync check), reference log-probs, values
        with timed(metrics, "old_log_prob"):
            batch["old_log_probs"], entropy = forward_log_probs(
                actor, batch, plan.log_prob_micro_batch_size_per_gpu, arr.rollout.temperature, entropy=True)
        diff = ro.logprob_diff(batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
        metrics["rollout/logprob_diff_mean"], metrics["rollout/logprob_diff_max"] = (
            diff["logprob_diff_mean"], diff["logprob_diff_max"])
        metrics["actor/entropy"] = core.masked_mean(entropy, mask).item()
        if ref is not None:
            with timed(metrics, "ref"):
                batch["ref_log_probs"], _ = forward_log_probs(
                    ref, batch, arr.ref.log_prob_micro_batch_size_per_gpu or plan.log_prob_micro_batch_size_per_gpu,
                    arr.rollout.temperature)
        if critic is not None:
            with timed(metrics, "values"):
                batch["values"] = forward_values(critic, batch, plan.log_prob_micro_batch_size_per_gpu)

        # 5. advantages
        with timed(metrics, "adv"):
            rewards = token_scores
            if algo.use_kl_in_reward:
                rewards, current_kl = core.apply_kl_penalty(token_scores, batch["old_log_probs"],
                                                            batch["ref_log_probs"], mask, kl_ctrl.value,
                                                            algo.kl_penalty)
                # The controller must see the whole batch's KL (as verl's driver does), or each rank's
                # coefficient drifts its own way: average the per-sequence means over every rank's share.
                kl_total = torch.tensor([current_kl * len(mask), len(mask)], dtype=torch.float64)
                dist.all_reduce(kl_total)
                current_kl = (kl_total[0] / kl_total[1]).item()
                kl_ctrl.update(current_kl, n_steps=plan.total_samples)
                metrics["actor/reward_kl_penalty"], metrics["actor/reward_kl_penalty_coeff"] = current_kl, kl_ctrl.value
            if algo.adv_estimator == "gae":
                # whitened over the whole step's batch: every rank holds a different share of it
                adv, returns = core.compute_gae_advantage_return(rewards, batch["values"], mask, algo.gamma, algo.lam,
                                                                 whiten_group=dist.group.WORLD)
                batch["returns"] = returns
            elif algo.adv_estimator == "reinforce_plus_plus":
                adv, _ = core.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, algo.gamma,
                                                                            whiten_group=dist.group.WORLD)
            else:
                # GRPO / RLOO compare the n samples of a prompt, which the TP ranks of this rollout
                # group hold between them: gather every sample's total reward inside the group.
                tp_group = meshes.rollout.get_group("infer_tp")
                group_rewards = gather_in_group((rewards * mask).sum(-1), tp_group)  # (B * tp,)
                group_index = gather_in_group(batch["prompt_index"], tp_group)  # (B * tp,)
                kwargs = dict(norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo) if algo.adv_estimator == "grpo" else {}
                group_adv, _ = core.compute_advantage(
                    algo.adv_estimator, token_level_rewards=group_rewards[:, None],
                    response_mask=torch.ones_like(group_rewards)[:, None], index=group_index.tolist(), **kwargs)
                mine_rows = slice(tp_rank * len(scores), (tp_rank + 1) * len(scores))
                adv = group_adv[mine_rows] * mask  # (B, 1) broadcast over each response's tokens
            batch["advantages"] = adv

        # 6. updates: critic first (verl's order), then the actor
        if critic is not None:
            with timed(metrics, "update_critic"):
                if cfg.critic.fsdp_config.optimizer_offload:
                    load_optimizer(critic_optim, device)
                metrics.update(update_critic(critic, critic_optim, batch, cfg, plan, world, generator))
                if cfg.critic.fsdp_config.optimizer_offload:
                    offload_optimizer(critic_optim)
            critic_sched.step()
        with timed(metrics, "update_actor"):
            if arr.actor.fsdp_config.optimizer_offload:  # Adam moments live on the host between updates
                load_optimizer(actor_optim, device)
            actor_metrics = update_actor(actor, actor_optim, batch, cfg, plan, world, generator)
            if arr.actor.fsdp_config.optimizer_offload:
                offload_optimizer(actor_optim)
        metrics.update(actor_metrics)
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        actor_sched.step()
        skipped = actor_metrics.get("actor/skipped_steps", 0)
        updated = skipped < plan.num_mini_batches * arr.actor.ppo_epochs
        consecutive_skips = consecutive_skips + 1 if skipped else 0

        # 7. metrics (verl's names), reduced over ranks, and validation
        valid_tokens = batch["attention_mask"].sum().item()
        metrics["timing_s/step"] = time.perf_counter() - step_start
        metrics.update(stats("critic/score", scores))
        metrics.update(stats("critic/rewards", (rewards * mask).sum(-1)))
        metrics.update(stats("critic/advantages", adv[mask.bool()]))
        metrics.update(stats("response_length", lengths))
        metrics["response_length/clip_ratio"] = (lengths == cfg.data.max_response_length).float().mean().item()
        metrics["perf/throughput"] = valid_tokens / metrics["timing_s/step"]
        metrics["perf/max_memory_gb"] = peak_memory_gb(device)
        metrics.setdefault("actor/skipped_steps", 0)
        metrics = reduce_metrics(metrics, device)
        metrics["batch/num_prompts"] = len(indices)
        metrics["batch/num_samples"] = len(indices) * arr.rollout.n
        metrics["batch/ppo_mini_batch_size_per_rank"] = plan.ppo_mini_batch_size_per_rank
        metrics["training/epoch"] = sampler.epoch
        if consecutive_skips >= cfg.trainer.max_consecutive_skipped_steps:
            raise RuntimeError(
                f"{consecutive_skips} steps in a row had non-finite actor losses or gradients "
                f"(trainer.max_consecutive_skipped_steps={cfg.trainer.max_consecutive_skipped_steps}); stopping. "
                f"Lower actor_rollout_ref.actor.optim.lr or check the reward function's values."
            )
        if val_prompts and cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or step == total_steps):
            sync()  # validate the weights just trained, not the ones this step sampled from
            fingerprint, updated = ro.engine_fingerprint(llm, probe), False
            with timed(metrics, "testing"):
                metrics.update(run_validation(llm, val_prompts, tokenizer, reward_fn, cfg, meshes, step, device))
        tracker.log(step, metrics)

        # 8. checkpoint: sharded, atomic, old ones pruned only after the new one is complete
        if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == total_steps):
            start = time.perf_counter()
            path = save_checkpoint(out_dir, step, ckpt_models,
                                   {"sampler": sampler.state_dict(), "kl_ctrl": kl_ctrl.state_dict()},
                                   hf_source=(actor.config, tokenizer), keep=cfg.trainer.max_actor_ckpt_to_keep)
            print0(f"saved {path} in {time.perf_counter() - start:.1f}s")

    tracker.close()
    if rank == 0 and (out_dir / "metrics.jsonl").is_file():
        png = plot_metrics(out_dir / "metrics.jsonl", out_dir / "metrics.png")
        print0(summary(out_dir / "metrics.jsonl"))
        print0(f"metrics: {out_dir / 'metrics.jsonl'}, plot: {png}")
    ro.shutdown(llm)  # stops the engine, then the process group, in the order vLLM needs


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a config the user must change: one clear line, no traceback
        print(f"[rank {os.environ.get('RANK', 0)}] config error: {e}", flush=True)
        raise SystemExit(2) from None
