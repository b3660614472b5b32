"""Show that the suite catches the bugs it guards against: each mutation below plants one bug in a
temporary copy of the repo and runs only the test that should catch it; that test must fail.

    .venv/bin/python tests/mutations.py               # all of them (about 15 min on 2 CPU cores)
    .venv/bin/python tests/mutations.py --only sync   # the ones whose name contains "sync"

Prints a table (mutation | test | caught) and writes it to outputs/mutations.md; exits 1 if any
mutation survives. A mutation whose text is no longer in the source is reported as stale (exit 1):
the table must keep describing the code as it is.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    edits: tuple[tuple[str, str], ...]  # (text in the file, what replaces it)
    test: str  # a pytest node id (or file plus -k expression after a space)


MUTATIONS = (
    # vision-language models' training forward (tests/test_vision.py)
    Mutation("a VLM's packed row loses the text position row (3-row mrope positions only)", "models.py", ((
        "packed_positions = positions.transpose(0, 1)[:, valid][:, None]",
        "packed_positions = positions.transpose(0, 1)[1:, valid][:, None]"),),
        "tests/test_vision.py::test_packed_and_padded_vl_forwards_equal_hf_per_sample"),
    Mutation("a VLM micro batch's images taken in reverse row order", "vision.py", ((
        "pixels = torch.cat([pixel_values[i, :n] for i, n in enumerate(patches)])",
        "pixels = torch.cat([pixel_values[i, :n] for i, n in reversed(list(enumerate(patches)))])"),),
        "tests/test_vision.py::test_packed_and_padded_vl_forwards_equal_hf_per_sample"),
    Mutation("a VLM micro batch without an image skips the tower (no dummy image)", "models.py", ((
        "    if tower is None or _pixel_inputs(inputs):", "    if True:"),),
        "tests/test_vision.py::test_a_rank_without_images_runs_the_tower_on_a_dummy_image"),
    Mutation("freeze_vision_tower leaves the tower trainable", "models.py", ((
        "    tower.requires_grad_(False)\n", "    tower.requires_grad_(True)\n"),),
        "tests/test_vision.py::test_a_frozen_vision_tower_takes_no_gradient_and_no_optimizer_state"),
    Mutation("the trainer's log-probs keep the image pads the engine bans", "models.py", ((
        "        if banned_token_ids:  # never sampled", "        if False:  # never sampled"),),
        "tests/test_vision.py::test_packed_and_padded_vl_forwards_equal_hf_per_sample"),
    # trainer.v1.trainer_mode=colocate_async (tests/test_train_ppo_colocate_async.py, tests/test_config.py)
    Mutation("colocate_async allows the on-policy shortcut on tokens of older weights", "config.py", ((
        "if warmup > 0 and not (rc.bypass_mode or rc.rollout_is is not None):", "if False:"),),
        "tests/test_config.py -k test_colocate_async_refusals"),
    Mutation("colocate_async tags tokens with a weight version one too new", "train_ppo.py", ((
        "flight.trajectories, version=step - 1, stop=cut,",
        "flight.trajectories, version=step, stop=cut,"),),
        "tests/test_train_ppo_colocate_async.py::test_carried_tokens_stay_within_the_bound_and_fresh_ones_match_the_engine"),
    Mutation("rollout correction over the fresh tokens only (the stale ones left out of the loss, unweighted)",
             "train_ppo.py", ((
                 'old.sampling_log_probs, batch["rollout_log_probs"], mask, correction, dp_group)',
                 'old.sampling_log_probs, batch["rollout_log_probs"], fresh, correction, dp_group)'),),
             "tests/test_train_ppo_colocate_async.py::test_is_weights_recomputed_from_the_dumps_equal_the_trainers"),
    Mutation("a carried sample's log-probs recomputed under the new weights instead of kept", "rollout.py", (
        ("stop_token_ids=list(sampling.stop_token_ids), logprobs=0, seed=seed,\n",
         "stop_token_ids=list(sampling.stop_token_ids), logprobs=0, seed=seed, prompt_logprobs=0,\n"),
        ("            traj, sampled = live[out.request_id], out.outputs[0]\n",
         "            traj, sampled = live[out.request_id], out.outputs[0]\n"
         "            if out.prompt_logprobs and traj.log_probs and len(traj.log_probs) == len(traj.tokens):\n"
         "                traj.log_probs[:] = [e[t].logprob for t, e in zip(traj.tokens, out.prompt_logprobs["
         "len(traj.prompt):], strict=True)]\n")),
        "tests/test_rollout.py -k stream_without_cut and w2_tp1"),
    Mutation("TP engines keep vLLM's segment names, the same for every job on a node", "rollout.py", ((
        "    if ident is None:\n        yield\n        return\n", "    yield\n    return\n"),),
        "tests/test_rollout.py::test_two_tp_jobs_on_one_node_run_side_by_side"),
    Mutation("one rank of a rollout TP group cuts the stream one engine step late", "rollout.py", ((
        "cut = bool(live) and stop is not None and stop(trajectories)",
        "cut = bool(live) and stop is not None and stop(trajectories) and (not dist.get_rank() % 2 or "
        "getattr(stop, 'late', 0) or setattr(stop, 'late', 1) or False)"),),
        "tests/test_train_ppo_colocate_async.py::test_tp_ranks_cut_alike_and_drop_keeps_the_bound"),
    # trainer.v1.trainer_mode=separate_async (tests/test_train_ppo_split.py)
    Mutation("the rollout pool samples a step's batch with the next step's seeds", "train_ppo.py", ((
        "held = pool_batch(run, step, version=step - 1)", "held = pool_batch(run, step + 1, version=step - 1)"),),
        "tests/test_train_ppo_split.py::test_one_trainer_and_one_rollout_rank_are_the_collocated_run_and_resume_collocated"),
    Mutation("a split job's pool scores with the rule function: its reward model is never built", "train_ppo.py", ((
        "reward_model = load_learned_reward_model(cfg, meshes, env, tokenizer) if pool is None or not pool.is_trainer",
        "reward_model = load_learned_reward_model(cfg, meshes, env, tokenizer) if pool is None"),),
        "tests/test_train_ppo_split.py::test_one_trainer_and_one_rollout_rank_are_the_collocated_run_and_resume_collocated"),
    Mutation("a split's LoRA syncs after the first send one module, not every module the adapter changes",
             "train_ppo.py", ((
        "engine.lora_modules = sync_modules(models.actor, rollout.packed_modules(engine.llm))",
        "engine.lora_modules = {next(iter(sync_modules(models.actor, rollout.packed_modules(engine.llm))))}"),),
        "tests/test_train_ppo_split.py::test_one_trainer_and_one_rollout_rank_are_the_collocated_run_and_resume_collocated"),
    Mutation("trainer 0 never broadcasts the last bucket of weights", "placement.py", ((
        "    if bucket:\n        _broadcast_bucket(pool, bucket)", "    if False:\n        _broadcast_bucket(pool, bucket)"),),
        "tests/test_train_ppo_split.py::test_one_trainer_and_one_rollout_rank_are_the_collocated_run_and_resume_collocated"),
    Mutation("one step off, the batch ahead is tagged with the next weights' version", "train_ppo.py", ((
        "held = pool_batch(run, step + 1, version=step - 1)", "held = pool_batch(run, step + 1, version=step)"),),
        "tests/test_train_ppo_split.py::test_one_step_off_trains_each_batch_sampled_by_the_weights_one_update_old_and_resumes"),
    Mutation("the rollout pool deals trainer r the rows of trainer T-1-r", "placement.py", ((
        "mine = slice(r * per_trainer, (r + 1) * per_trainer)",
        "mine = slice((pool.trainers - 1 - r) * per_trainer, (pool.trainers - r) * per_trainer)"),),
        "tests/test_train_ppo_split.py::test_two_trainers_and_two_rollout_ranks_are_the_collocated_two_rank_runs"),
    Mutation("a split job's checkpoint drops the batch the pool generated ahead", "placement.py", ((
        '"generated_ahead": batch_to_json(whole)', '"generated_ahead": None'),),
        "tests/test_train_ppo_split.py::test_one_step_off_trains_each_batch_sampled_by_the_weights_one_update_old_and_resumes"),
    # (dcp.load fills the state dicts in place, and they share storage with the model and the optimizer:
    # the load itself restores them, so the mutations drop what is loaded, not only what is set after)
    Mutation("resume restores the model but not the optimizer", "checkpoint.py", (
        ('loaded = {"model": model_sd, "optim": optim_sd}', 'loaded = {"model": model_sd}'),
        ('set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],\n'
         '                       options=_options(model))',
         '__import__("torch.distributed.checkpoint.state_dict", fromlist=["_"]).set_model_state_dict('
         'model, loaded["model"], options=_options(model))')),
        "tests/test_checkpoint.py::test_killed_rank_resumes_and_reproduces"),
    Mutation("resume restores neither model nor optimizer", "checkpoint.py", (
        ('dcp.load(loaded, checkpoint_id=str(path / name), process_group=group)', 'pass'),
        ('set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],\n'
         '                       options=_options(model))', 'pass')),
        "tests/test_checkpoint.py::test_killed_rank_resumes_and_reproduces"),
    Mutation("GRPO baselines from one rank's samples, not the whole batch", "train_ppo.py", (
        ('all_rewards, all_mask = gather_rows(rewards, dp_group), gather_rows(mask, dp_group)',
         'all_rewards, all_mask = rewards, mask'),
        ('all_index = gather_rows(batch["prompt_index"], dp_group)', 'all_index = batch["prompt_index"]'),
        ('if not bool((group_sizes == samples_per_prompt).all()):', 'if False:'),
        ('batch["advantages"] = batch["returns"] = my_rows(all_adv, dp_group)',
         'batch["advantages"] = batch["returns"] = all_adv')),
        "tests/test_train_ppo_steps.py::test_advantages_use_the_whole_rollout_group"),
    Mutation("balance_batch's partition pairs the heaviest parts together", "ppo_core.py", ((
        "zip(wide, reversed(other), strict=True)", "zip(wide, other, strict=True)"),),
        "tests/test_ppo_core.py::test_balanced_partitions_against_every_equal_split"),
    Mutation("dynamic sampling decides from each rank's own samples", "train_ppo.py", ((
        'dist.all_gather_object(every_rank, (rows["prompt_index"].tolist(), values.tolist()), group=group)',
        'every_rank = [(rows["prompt_index"].tolist(), values.tolist())] * world'),),
        "tests/test_train_ppo_steps.py::test_dynamic_sampling_keeps_the_first_groups_that_differ"),
    Mutation("GSPO clips each token's ratio, not the sequence's", "ppo_core.py", ((
        'seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)', 'log_ratio.detach()).clamp(max=10.0)'),),
        "tests/test_ppo_core.py::test_gspo_clips_the_sequence_ratio_and_each_token_keeps_its_gradient"),
    Mutation("weight sync silently skips a layer", "models.py", ((
        'for name, param in model.named_parameters(remove_duplicate=False))',
        'for name, param in model.named_parameters(remove_duplicate=False) if ".layers.1.mlp." not in name)'),),
        "tests/test_rollout.py -k w2_tp1_qwen2 and greedy"),
    Mutation("MoE sync leaves the CPU engine's experts as vLLM reloads them (unpacked)", "rollout.py", ((
        "    _restore_cpu_moe_layout(llm, reloaded_experts)\n", ""),),
        "tests/test_moe.py -k qwen3_moe and engine_equals_actor"),
    # vision-language models (tests/test_vision.py, tests/dist_vl_check.py)
    Mutation("a VLM sync keeps the engine's encoder cache (image embeddings of the old tower)", "rollout.py", ((
        "    _reset_encoder_cache(llm)  # images embedded by the old vision tower\n", ""),),
        "tests/test_vision.py -k engine_log_probs and qwen2_vl and not qwen2_5"),
    Mutation("the memory plan leaves out the vision tower's activations", "memory_plan.py", ((
        "        tower = vision_activation_bytes(shape.vision, patches, m.compute_bytes, checkpointing)\n", ""),),
        "tests/test_memory_rehearsal.py::test_a_vl_plan_is_within_15_percent_of_its_rehearsal[qwen2_vl]"),
    Mutation("the memory plan leaves out the pixels a VLM batch holds (its float32 column)", "memory_plan.py", ((
        "return (samples * 4 + micro_samples * (4 + dtype_bytes)) * patches * patch_dim",
        "return (micro_samples * (4 + dtype_bytes)) * patches * patch_dim"),),
        "tests/test_memory_rehearsal.py::test_a_vl_plan_is_within_15_percent_of_its_rehearsal[qwen2_vl]"),
    Mutation("the engine samples the image pads the trainer's log-probs mask", "rollout.py", ((
        "allowed_token_ids=allowed, seed=seed)", "seed=seed)"),),
        "tests/test_vision.py -k engine_log_probs and qwen2_vl and not qwen2_5"),
    Mutation("image prompts sent to the engine with their pads expanded", "vision.py", ((
        "if t != image_token_id or j == 0 or token_ids[j - 1] != t]", "]"),),
        "tests/test_vision.py -k engine_log_probs and qwen2_vl and not qwen2_5"),
    Mutation("MoE sync sends transformers' names, not the checkpoint's", "moe.py", ((
        "yield from revert_weight_conversion(model, {name: tensor}).items()", "yield name, tensor"),),
        "tests/test_moe.py -k names_are_the_checkpoint"),
    Mutation("router replay keeps the router's own choice", "moe.py", ((
        "            return _replayed(router, logits, weights, forced)", "            return output"),),
        "tests/test_moe.py -k replay_forces_flipped"),
    Mutation("router replay's weights cut off from the router's gradient", "moe.py", ((
        "return logits, chosen.to(weights.dtype), experts", "return logits, chosen.detach().to(weights.dtype), experts"),),
        "tests/test_moe.py -k replay_forces_flipped"),
    Mutation("R2's routes forced on the wrong rows (the batch's first ones)", "models.py", ((
        "router_replay.force(routes_from_rows(routed_experts[rows], ran))",
        "router_replay.force(routes_from_rows(routed_experts[:len(rows)], ran))"),),
        "tests/test_moe.py -k routes_recorded_per_row"),
    Mutation("the update does not replay R2's routes", "train_ppo.py", ((
        'replay = RouterReplay(actor, "replay") if "routed_experts" in batch else None',
        "replay = None"),),
        "tests/test_moe.py::test_the_update_replays_the_old_forwards_routes"),
    Mutation("router replay's hooks gone before the backward recomputes the forward", "moe.py", ((
        "forced = torch.where(forced < 0, experts, forced.to(experts.dtype))  # unrecorded tokens route freely",
        "forced = experts if torch._C._current_graph_task_id() != -1 else torch.where(forced < 0, experts, forced)"),),
        "tests/test_moe.py::test_replay_holds_through_activation_checkpointing"),
    Mutation("the export writes the initial (unloaded) weights", "export_hf.py", ((
        'dcp.load(state, checkpoint_id=str(ckpt / which), no_dist=True)', 'pass'),),
        "tests/test_checkpoint.py::test_killed_rank_resumes_and_reproduces"),
    Mutation("micro-batch loss scaled by the micro batch's own token count", "train_ppo.py", ((
        'loss, terms = loss_fn(mb, scale)',
        'loss, terms = loss_fn(mb, core.LossScale(mb["response_mask"].sum() * dp_size, num_seqs, dp_size))'),),
        "tests/test_train_ppo_steps.py::test_micro_batch_cut_does_not_change_the_update[token-mean]"),
    Mutation("the reference model is the actor (updated with it)", "train_ppo.py", ((
        'param_offload=cfg.actor_rollout_ref.ref.fsdp_config.param_offload, **fsdp_kwargs)\n',
        'param_offload=cfg.actor_rollout_ref.ref.fsdp_config.param_offload, **fsdp_kwargs)\n'
        '        ref = actor\n'),),
        "tests/test_train_ppo.py::test_gae_with_kl"),
    Mutation("LoRA's reference log-probs computed with the adapter on (the reference is the actor)", "train_ppo.py", ((
        'ref, reference_mode = actor, actor.disable_adapter', 'ref, reference_mode = actor, contextlib.nullcontext'),),
        "tests/test_lora.py -k learns_and_exports"),
    Mutation("rollout.n samples of a prompt split across rollout dp groups", "train_ppo.py", (
        ('group_indices = rollout.shard_for_dp(prompt_indices, rollout_mesh.get_local_rank("dp"),\n'
         '                                                 run.dims.rollout_dp)',
         'group_indices = prompt_indices'),
        ('train_sampling = rollout.Sampling(n=rollout_cfg.n,',
         'train_sampling = rollout.Sampling(n=rollout_cfg.n // dims.rollout_dp,')),
        "tests/test_train_ppo.py::test_seed_six_rank_job"),
    Mutation("multi-turn: the tool replies' tokens left in the loss", "agent_loop.py", ((
        '    t.add(ids, False)\n', '    t.add(ids, True)\n'),),
        "tests/test_train_ppo.py::test_multi_turn_rollouts_train_on_what_the_policy_sampled"),
    Mutation("multi-turn: every TP rank runs every trajectory's environment", "agent_loop.py", ((
        'envs = {j: make_env(t.row) for j, t in enumerate(trajs) if j % tp_size == tp_rank}',
        'envs = {j: make_env(t.row) for j, t in enumerate(trajs)}'),),
        "tests/test_train_ppo.py::test_multi_turn_rollouts_train_on_what_the_policy_sampled"),
    Mutation("the score placed at response_mask.sum() - 1", "train_ppo.py", ((
        'last = length - 1 - response_mask.flip(-1).argmax(-1)', 'last = response_mask.sum(-1) - 1'),),
        "tests/test_train_ppo_steps.py::test_the_score_sits_on_the_last_sampled_token"),
    Mutation("REINFORCE++ resets the return at tool replies", "ppo_core.py", ((
        'token_level_rewards[:, t] + gamma * running, running)', 'token_level_rewards[:, t] + gamma * running, 0.0)'),),
        "tests/test_ppo_core.py::test_reinforce_plus_plus_carries_the_return_through_tool_replies"),
    Mutation("packed forward lets attention cross sequences (one position run over the row)", "models.py", ((
        'packed_positions = positions[valid][None]  # (1, N)',
        'packed_positions = torch.arange(int(valid.sum()), device=valid.device)[None]'),),
        "tests/test_models_packing.py -k packed-tiny-qwen2"),
    Mutation("packed attention runs the whole row as one sequence", "attention.py", ((
        'bounds = sequence_bounds(position_ids.reshape(-1)[-length:])', 'bounds = [0, length]'),),
        "tests/test_attention.py -k each_sequence_alone"),
    Mutation("token-budget micro batches' results left in micro-batch order", "models.py", ((
        'return out[torch.argsort(rows)]', 'return out'),),
        "tests/test_models_packing.py -k packed_dynamic-tiny-llama-tied"),
    Mutation("prepare_data writes a row whose ground truth its reward rule cannot match", "prepare_data.py", ((
        "if (result[\"score\"] if isinstance(result, dict) else result) != 1.0:",
        "if result is None:"),),
        "tests/test_prepare_data.py::test_dapo_rows_are_checked_and_copied"),
    # verl 0.9.1 parity
    Mutation("verl: kl_cov ranks the padded grid (ties pick other tokens than verl)", "ppo_core.py", (
        ("cov = (valid_adv - valid_adv.mean()) * (valid_log_prob - valid_log_prob.mean())",
         "cov = torch.where(mask, _centred_product(advantages, log_prob, mask), -torch.inf).flatten().cpu()"),
        ("penalised[valid_idx[top.to(valid_idx.device)]] = True", "penalised[top.to(mask.device)] = True")),
        "tests/test_ppo_core.py -k kl_cov_ranks_only_the_valid_tokens"),
    Mutation("verl: the optimal token baseline's zero tail starts one position early", "ppo_core.py", ((
        "baselines[longest[0], int(top[1]):] = 0.0", "baselines[longest[0], int(top[1]) - 1:] = 0.0"),),
        "tests/test_ppo_core.py -k optimal_token_baseline_matches_verls_formula"),
    Mutation("verl: best@k draws without the seed verl uses", "eval_metrics.py", ((
        "np.random.RandomState(seed).choice", "np.random.RandomState(seed + 1).choice"),),
        "tests/test_eval_metrics.py -k bootstrap_equals_verls_loop"),
    Mutation("pass@k is \"any of the n samples correct\", not the unbiased estimate", "eval_metrics.py", ((
        "return 1.0 - math.comb(n - c, k) / math.comb(n, k)", "return float(c > 0)"),),
        "tests/test_eval_metrics.py -k pass_at_k_by_hand"),
    Mutation("trainer.critic_warmup=N holds the actor back N steps, not verl's N - 1", "train_ppo.py", ((
        "update_actor_now = step >= cfg.trainer.critic_warmup", "update_actor_now = step > cfg.trainer.critic_warmup"),),
        "tests/test_train_ppo.py -k critic_warmup_then_validation"),
    Mutation("verl: filter_groups.metric=score filters on the score after the overlong penalty", "rewards.py", ((
        '    if metric == "score":\n        return score', '    if metric == "score":\n        return reward'),),
        "tests/test_rewards.py -k filter_metric_score_is_the_functions_score"),
    Mutation("verl: the DAPO manager adds acc for a dict without one too", "rewards.py", ((
        '            if not from_dict:\n                sample_extras["acc"] = score',
        '            sample_extras.setdefault("acc", score)'),),
        "tests/test_rewards.py -k dapo_adds_acc_for_a_float_only"),
    # faults (tests/test_faults.py): each feature off, its fault test must fail
    Mutation("fault: the watchdog sees the hang but never ends the job", "watchdog.py", ((
        'if why is not None and self._state != "done":', 'if False:'),),
        "tests/test_faults.py -k stopped_rank and generate"),
    Mutation("fault: a split job's watchdog compares phase counts, not places in the step", "watchdog.py", ((
        "        if self.order is None:\n            return self.current.seq + 1",
        "        if True:\n            return self.current.seq + 1"),),
        "tests/test_faults.py -k split_jobs_watchdog"),
    Mutation("fault: a checkpoint is visible before it is complete (written in place, any dir counts)",
             "checkpoint.py", (
        ('final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"',
         'final = tmp = root / f"global_step_{step}"'),
        ('            if final.exists():  # re-saving a step (after a resume): the complete one stays until the new '
         'one is in\n                shutil.rmtree(old, ignore_errors=True)\n                os.replace(final, old)\n'
         '            os.replace(tmp, final)\n', ''),
        ('if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]',
         'if (m := _STEP_DIR.match(p.name))]')),
        "tests/test_faults.py::test_rank_killed_while_saving_keeps_the_previous_checkpoint"),
    Mutation("fault: resume trusts file sizes it does not check", "checkpoint.py", ((
        '        problems = (damaged or {}).get(path) or check_files(path)\n        if not problems:',
        '        problems = (damaged or {}).get(path) or []\n        if not problems:'),),
        "tests/test_faults.py::test_damaged_shards_are_named_and_never_loaded"),
    Mutation("fault: auto-resume stops at a checkpoint whose content changed instead of taking an older one",
             "checkpoint.py", ((
        '            if mode != "auto":\n                raise', '            if True:\n                raise'),),
        "tests/test_faults.py::test_damaged_shards_are_named_and_never_loaded"),
    Mutation("fault: load skips the CRC check", "checkpoint.py", ((
        'problems = check_files(path, deep=True, part=(dist.get_rank(), dist.get_world_size()))', 'problems = []'),),
        "tests/test_faults.py::test_damaged_shards_are_named_and_never_loaded"),
    Mutation("fault: a failed save surfaces as DCP's raw exception and leaves its .tmp", "checkpoint.py", ((
        'except (Exception, CheckpointException) as e:  # DCP raises', 'except ZeroDivisionError as e:  # DCP raises'),),
        "tests/test_faults.py::test_full_disk_during_save_is_a_clear_error"),
    Mutation("fault: reward_model.timeout_s is ignored", "rewards.py", ((
        'if timeout_s <= 0 or threading.current_thread() is not threading.main_thread():', 'if True:'),),
        "tests/test_faults.py::test_hanging_reward_function_is_stopped_and_named"),
    Mutation("code reward: a program the sandbox killed still passes on what it printed", "code_reward.py", ((
        "    if not run.ok:\n        return False\n", ""),),
        "tests/test_code_reward.py::test_hostile_programs_score_zero_and_harm_nothing"),
    Mutation("sandbox: no PID namespace (the caller's /proc, signals and daemons in reach)", "sandbox.py", ((
        'namespaces = ["--unshare-pid", ', 'namespaces = ['),),
        "tests/test_sandbox.py::test_full_sandbox_holds_against_the_battery"),
    Mutation("sandbox: bwrap not killed with its caller (a program outlives a dead trainer)", "sandbox.py", ((
        '"--die-with-parent", ', ''),),
        "tests/test_sandbox.py::test_full_sandbox_holds_against_the_battery"),
    Mutation("sandbox: a fake root's user namespace keeps every capability", "sandbox.py", ((
        '"--cap-drop", "ALL", ', ''),),
        "tests/test_sandbox.py::test_full_sandbox_holds_against_the_battery"),
    Mutation("code reward: a batch's programs run one sample after another", "rewards.py", ((
        "    if base is not default_compute_score or not code:", "    if True:"),),
        "tests/test_code_reward.py::test_score_batch_runs_a_batchs_programs_at_once"),
    Mutation("tir_optimal_token_baseline compares absolute positions, as optimal_token_baseline", "ppo_core.py", ((
        "k = (mask.long().cumsum(-1) - 1)[rows, cols]", "k = cols"),),
        "tests/test_ppo_core.py::test_tir_optimal_token_baseline_compares_the_kth_generated_tokens_as_verl_does"),
    Mutation("gdpo does not whiten the weighted sum over the batch", "ppo_core.py", ((
        "advantages = masked_whiten(total, mask.bool()) * mask", "advantages = total * mask"),),
        "tests/test_ppo_core.py::test_gdpo_normalises_each_reward_component_in_its_group_then_whitens_the_weighted_sum"),
    Mutation("dro rewards the log-ratio's square instead of penalising it", "ppo_core.py", ((
        "- 0.5 * dro_beta * log_ratio.square()", "+ 0.5 * dro_beta * log_ratio.square()"),),
        "tests/test_ppo_core.py::test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty"),
    Mutation("verl config: a not-implemented verl key is accepted at any value", "config.py", ((
        "            if value != default:", "            if False:"),),
        "tests/test_config.py::test_verls_generated_config_loads_and_plans"),
    Mutation("verl config: an interpolated verl default is compared as written, not resolved", "config.py", ((
        'if not (isinstance(default, str) and "${" in default):', "if True:"),),
        "tests/test_config.py::test_verls_generated_config_loads_and_plans"),
)


def copy_repo(dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (no .venv, no outputs)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def run_one(mutation: Mutation) -> tuple[str, float, str]:
    """'caught', 'SURVIVED', 'stale' or 'ERROR' (a fixture broke), the seconds the test took, and how
    it failed (the first error line pytest printed), so a failure for an unrelated reason is visible in
    the table."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        source = (repo / mutation.file).read_text()
        for old, new in mutation.edits:
            if source.count(old) != 1:
                return "stale", 0.0, f"{old[:40]!r} is not in {mutation.file} once"
            source = source.replace(old, new)
        (repo / mutation.file).write_text(source)
        node, _, keyword = mutation.test.partition(" -k ")
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", node]
        cmd += ["-k", keyword] if keyword else []
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - start
        errors = [line[1:].strip() for line in proc.stdout.splitlines() if line.startswith("E ")]
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
        how = errors[0] if errors else summary
        if " error" in summary and " failed" not in summary and " passed" not in summary:
            return "ERROR", seconds, how[:90].replace("|", "/")  # a fixture broke: neither caught nor survived
        if "no tests ran" in proc.stdout or " deselected" in proc.stdout and " passed" not in proc.stdout \
                and " failed" not in proc.stdout:
            return "stale", seconds, "the test id selects nothing"
        return ("caught" if proc.returncode != 0 else "SURVIVED"), seconds, how[:90].replace("|", "/")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the mutations whose name contains this text")
    args = ap.parse_args()
    rows = ["| mutation | test that must fail | result | s | how it failed |", "|---|---|---|---:|---|"]
    failed = False
    for mutation in MUTATIONS:
        if args.only not in mutation.name:
            continue
        result, seconds, how = run_one(mutation)
        failed |= result != "caught"
        rows.append(f"| {mutation.name} | `{mutation.test}` | {result} | {seconds:.0f} | {how} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows) + "\n"
    out = ROOT / "outputs" / "mutations.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(f"\n{table}\nwritten to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
