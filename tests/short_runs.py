"""The short end-to-end runs that several test modules check, launched together.

Each case is a train_ppo run with configs/tiny_cpu.yaml's lengths, the warmed (SFT) tiny model and the
demo data; its test checks the files it leaves in <dir>/<name>. The cases the selected tests use
(`@pytest.mark.short_run("name")`) run in a few torchrun launches (LAUNCHES: 2 ranks at TP 1, 2 ranks at
TP 2, 4 ranks), one after another in each, sharing the vLLM engine (tests/run_cases.py): most of a short
run's time on a CPU is the imports and the engine start-up, which a launch pays once. A case expected to
stop with an error (EXPECTED_ERRORS) leaves each rank's error in <dir>/<name>/error.rank<r>.txt, and the
launch goes on. The `short_runs` fixture (conftest.py) starts them, once for each group of tests that
pytest-xdist runs apart (conftest.worker_group): the TP 1 launch's tests beside the others.
"""

import json
from collections.abc import Callable
from pathlib import Path

# the 6-GPU recipes scaled to 2 ranks x 8 prompts x 4 samples: 16 samples per rank
TINY = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=16", "data.max_response_length=12", "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.max_num_seqs=256",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1"]
TWO_STEPS = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1"]
RC = "algorithm.rollout_correction"
# the learning runs' lengths: long enough that the training score's rise is many standard errors of its
# noise on every CPU (tests/noise.py; each test's docstring has the numbers). A step of the demo's config
# takes about a second here: the launch's start-up, not the steps, is most of a short run's time.
LEARN_STEPS = 80
LORA_STEPS = 160
LEARN_RM_STEPS = 60
V1 = "trainer.v1"
# the killed-rank resume (tests/test_checkpoint.py) in colocate_async with a batch of groups ahead (decoupled
# PPO), so that the checkpoints carry unfinished samples: a killed process's resume must repeat them too (the
# sync-mode resume: resume_smaller, tests/test_train_ppo.py::test_one_step_replays_in_process)
RESUME = ["trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.val_before_train=false",
          "trainer.test_freq=6", "data.max_val_samples=32", f"{V1}.trainer_mode=colocate_async",
          f"{V1}.colocate_async.num_warmup_batches=1", f"{V1}.sampler.max_off_policy_threshold=2",
          f"{V1}.sampler.max_off_policy_strategy=wait", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"]
PACKING = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
           "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.total_training_steps=3", "trainer.val_before_train=false",
           "trainer.test_freq=0", "actor_rollout_ref.actor.ppo_mini_batch_size=32"]
RC_DECOUPLED = [
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
    "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.top_p=0.9",
    "actor_rollout_ref.rollout.top_k=20", "data.max_val_samples=32",
    f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0", f"{RC}.rollout_is_batch_normalize=true",
    # a band of 0.1% around ratio 1: exactness rejects nothing, the full-vocabulary comparison half
    f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.999_1.001"]
DISTILL_STEPS = 20
GRPO_TP2 = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.total_training_steps=3",
            "trainer.test_freq=3", "data.max_val_samples=16", "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=10"]
RESUME_SMALLER = [*RC_DECOUPLED, "trainer.resume_mode=resume_path", "trainer.resume_from_path={root}/rc_decoupled/global_step_2",
                  "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
                  "trainer.val_before_train=true"]
# bypass mode, one optimizer step per step; the KL loss to a reference model, and token-budget micro batches
# (use_dynamic_bsz) in its forward and the update: split_bypass_tp1 runs them on trainers apart from the pool
RC_BYPASS = [*TWO_STEPS, f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
             f"{RC}.rollout_rs=seq_max_k2,seq_sum_k1", f"{RC}.rollout_rs_threshold=1e-6,1.001",
             "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.use_kl_loss=true",
             "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
             "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1500"]
# a rollout pool apart from the trainers (placement.py) at staleness 0: 2 trainer ranks + 2 rollout ranks (4 launched)
SPLIT_2_2 = ["actor_rollout_ref.hybrid_engine=false", f"{V1}.trainer_mode=separate_async",
             "actor_rollout_ref.rollout.nnodes=1", "trainer.n_gpus_per_node=2", f"{V1}.separate_async.num_warmup_batches=0"]
# colocate_async with a batch of groups dispatched ahead, a bound of 2 versions, decoupled PPO (IS weights actor /
# engine); 4 steps, saved at step 2 (async_resume resumes there)
ASYNC_W1 = [*TINY, f"{V1}.trainer_mode=colocate_async", f"{V1}.colocate_async.num_warmup_batches=1",
            f"{V1}.sampler.max_off_policy_threshold=2", f"{V1}.sampler.max_off_policy_strategy=wait",
            f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0", "trainer.total_training_steps=4",
            "trainer.save_freq=2"]

CASES: dict[str, tuple[str, list[str]]] = {
    # --- tests/test_train_ppo_algorithms.py: the recipes as shipped, and each estimator and loss mode once
    # generation batches of train_batch_size, so a uniform group costs another batch; the overlong
    # buffer over all 12 tokens, so every response pays length / 12
    "dapo": ("configs/gsm8k_dapo_1node_6gpu.yaml", [*TINY, "data.gen_batch_size=8", "reward_model.overlong_buffer.len=12",
                                                     "reward_model.overlong_buffer.log=true"]),
    "gspo": ("configs/gsm8k_gspo_1node_6gpu.yaml", TINY),
    "drgrpo": ("configs/gsm8k_drgrpo_1node_6gpu.yaml", TINY),
    "remax_clip_cov": ("configs/tiny_cpu.yaml", [*TINY, "algorithm.adv_estimator=remax",
                                                 "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                                                 "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05"]),
    "opo_cispo": ("configs/tiny_cpu.yaml", [*TINY, "algorithm.adv_estimator=opo",
                                            "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"]),
    "gpg_kl_cov": ("configs/tiny_cpu.yaml", [*TINY, "algorithm.adv_estimator=gpg",
                                             "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
                                             "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.05"]),
    "reinforce_plus_plus_baseline": ("configs/tiny_cpu.yaml", [*TINY, "algorithm.adv_estimator=reinforce_plus_plus_baseline"]),
    # --- tests/test_train_ppo.py
    # critic, reference model, KL in reward with an adaptive controller, KL loss, DAPO's reward manager
    # with its overlong buffer, validation of an odd-sized held-out set over 2 rollout groups
    "gae_kl": ("configs/tiny_cpu.yaml", [
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_agg_mode=token-mean",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=2",
        "data.max_val_samples=17", "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=12",
        "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=true",
        # every offload flag: on the CPU each move is a no-op, but the trainer walks the whole plan
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "critic.fsdp_config.param_offload=true",
        "critic.fsdp_config.optimizer_offload=true", "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        # scored by a remote scorer (tests/reward_server.py: the demo's rule, over HTTP), which logs what it
        # scored to <dir>/gae_kl.scored.jsonl
        "reward_model.remote.url={reward_server}/ok", "reward_model.remote.max_concurrent=3"]),
    "reinforce_plus_plus": ("configs/tiny_cpu.yaml", [
        "algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        *TWO_STEPS]),
    # trainer.critic_warmup=2: step 1 trains the critic alone, step 2 both (verl: the actor from step
    # critic_warmup on); KL in reward shows whether the actor moved before a step, two mini batches within
    # it. Validation at step 2 samples val_kwargs.n=4 answers per prompt, scored with a `pred` (maj@k).
    "critic_warmup": ("configs/tiny_cpu.yaml", [
        *TWO_STEPS, "algorithm.adv_estimator=gae", "trainer.critic_warmup=2", "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "trainer.test_freq=2",
        "data.max_val_samples=6", "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"custom_reward_function.path={Path(__file__).with_name('pred_reward.py')}",
        "custom_reward_function.name=score_with_pred"]),
    # the demo's task, shortened: over LEARN_STEPS GRPO steps the training score rises
    "learn": ("configs/tiny_cpu.yaml", [f"trainer.total_training_steps={LEARN_STEPS}", f"trainer.test_freq={LEARN_STEPS}"]),
    # --- tests/test_train_ppo_distillation.py: the warmed model as the teacher.
    # Distillation alone (verl's default k3, back-propagated; the task's loss left out), a student 15 supervised
    # steps in ({student}): the KL to the teacher falls (0.91 -> 0.41 over 15 steps)
    "distill": ("configs/tiny_cpu.yaml", [
        "actor_rollout_ref.model.path={student}", "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path={teacher}", "distillation.distillation_loss.use_task_rewards=false",
        "distillation.distillation_loss.loss_max_clamp=10.0", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", f"trainer.total_training_steps={DISTILL_STEPS}",
        f"trainer.test_freq={DISTILL_STEPS}"]),
    # an untrained student ({untrained}) in the other two: k1 as a per-token reward (verl's recipe) beside the
    # task's GRPO loss, 2 steps
    "distill_pg": ("configs/tiny_cpu.yaml", [
        *TWO_STEPS, "actor_rollout_ref.model.path={untrained}", "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path={teacher}", "distillation.distillation_loss.loss_mode=k1",
        "distillation.distillation_loss.use_policy_gradient=true", "distillation.distillation_loss.clip_ratio_high=null"]),
    # the supervised top-k forward KL beside the task's GRPO loss, 2 steps: the teacher's top-k over the tokenizer's
    # ids (the student's embedding is padded past it), the student's log-probs there, padded forwards (the
    # packed ones: tests/test_models_distillation.py)
    "distill_topk": ("configs/tiny_cpu.yaml", [
        *TWO_STEPS, "actor_rollout_ref.model.path={untrained}", "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
        "distillation.distillation_loss.distillation_loss_coef=0.5", "distillation.distillation_loss.log_prob_min_clamp=-10",
        "distillation.teacher_models.teacher_model.fsdp_config.param_offload=true",
        "actor_rollout_ref.model.use_remove_padding=false"]),
    # --- tests/test_reward_model.py: the demo's task trained on a learned reward model's scores
    # (tests/demo_reward_model.py) instead of the rule's; validation scores with the rule, as in verl. Over
    # LEARN_RM_STEPS GRPO steps the reward model's score rises (the rule's greedy score need not: the policy
    # learns what the reward model likes beyond what is right, and on some CPUs it does not rise at all)
    "learn_rm": ("configs/tiny_cpu.yaml", [
        f"trainer.total_training_steps={LEARN_RM_STEPS}", f"trainer.test_freq={LEARN_RM_STEPS}", "reward_model.enable=true",
        "reward_model.model.path={reward_model}", "reward_model.micro_batch_size_per_gpu=64"]),
    # --- tests/test_train_ppo_rollout_correction.py
    "rc_bypass": ("configs/tiny_cpu.yaml", RC_BYPASS),
    # --- tests/test_train_ppo_packing.py: GAE with a reference model and a critic, 3 steps, one mini batch
    # of 256 samples per step; padded (a separate old-log-prob forward, kept by a rejection band no token
    # comes near) and packed with token-budget micro batches of a few samples each in every forward
    "padded": ("configs/tiny_cpu.yaml", [*PACKING, "actor_rollout_ref.model.use_remove_padding=false",
                                         "critic.model.use_remove_padding=false", f"{RC}.rollout_rs=token_k1",
                                         f"{RC}.rollout_rs_threshold=0.5_2.0"]),
    "packed": ("configs/tiny_cpu.yaml", [*PACKING, "actor_rollout_ref.model.use_remove_padding=true",
                                         "critic.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                         "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200",
                                         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=300",
                                         "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=120",
                                         "critic.ppo_max_token_len_per_gpu=250", "critic.forward_max_token_len_per_gpu=400"]),
    # --- tests/test_checkpoint.py: the uninterrupted reference of the killed-rank resume, 6 steps, checkpoints
    # at 3 and 6 (the killed run is RESUME's, too)
    "resume_reference": ("configs/tiny_cpu.yaml", [*RESUME, "trainer.max_actor_ckpt_to_keep=2"]),
    # --- tests/test_train_ppo_colocate_async.py: sync against colocate_async without a batch ahead (nothing is
    # ever cut: the same metrics bit for bit, in one launch); with one, and its resume from step 2
    "async_sync_reference": ("configs/tiny_cpu.yaml", TINY),
    "async_w0": ("configs/tiny_cpu.yaml", [*TINY, f"{V1}.trainer_mode=colocate_async",
                                           f"{V1}.colocate_async.num_warmup_batches=0",
                                           f"{V1}.sampler.max_off_policy_threshold=1",
                                           f"{V1}.sampler.max_off_policy_strategy=wait"]),
    # each step's samples dumped (trainer.rollout_data_dir) with what its IS weights are recomputed from
    "async_w1": ("configs/tiny_cpu.yaml", [*ASYNC_W1, "trainer.rollout_data_dir={root}/async_w1_rollouts"]),
    "async_resume": ("configs/tiny_cpu.yaml", [*ASYNC_W1, "trainer.resume_mode=resume_path", "trainer.save_freq=-1",
                                               "trainer.resume_from_path={root}/async_w1/global_step_2",
                                               "trainer.rollout_data_dir={root}/async_resume_rollouts"]),
    # bypass mode (the engine's log-probs as the old policy: no old-log-prob forward), strategy drop
    "async_bypass": ("configs/tiny_cpu.yaml", [
        *TINY, f"{V1}.trainer_mode=colocate_async", f"{V1}.colocate_async.num_warmup_batches=1",
        f"{V1}.sampler.max_off_policy_threshold=2", f"{V1}.sampler.max_off_policy_strategy=drop",
        f"{RC}.bypass_mode=true", "trainer.total_training_steps=3"]),
    # --- tests/test_lora.py: the demo task with a rank-8 adapter on every linear layer, the KL loss to the
    # reference (the adapter disabled) and the KL in the reward (which logs the KL of the policy before each
    # update to the reference), LORA_STEPS steps; the engine samples from the merged weights, so it is shared
    "lora": ("configs/tiny_cpu.yaml", [
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=true",
        f"trainer.total_training_steps={LORA_STEPS}", f"trainer.test_freq={LORA_STEPS}", f"trainer.save_freq={LORA_STEPS}"]),
    # --- tests/test_train_ppo.py: runs that must stop with an error (EXPECTED_ERRORS)
    # a reward function that raises on rank 1 only (tests/bad_reward.py)
    "reward_raises": ("configs/tiny_cpu.yaml", [*TWO_STEPS, "custom_reward_function.path={tests}/bad_reward.py"]),
    # an entropy bonus beyond float32's range; validation before training on a code data set ({code_val})
    "non_finite": ("configs/tiny_cpu.yaml", ["actor_rollout_ref.actor.entropy_coeff=1e39",
                                             "trainer.max_consecutive_skipped_steps=2", "trainer.total_training_steps=4",
                                             "trainer.test_freq=-1", "data.val_files={code_val}",
                                             "reward_model.sandbox_fusion.max_concurrent=4"]),
    # --- TP 2 (LAUNCHES["tp2"]); the longest first: the engine it builds serves the shorter runs after it
    # tests/test_train_ppo.py: a scripted user (tests/multi_turn_env.py) answers each response twice
    "multi_turn": ("configs/tiny_cpu.yaml", [
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "data.max_response_length=48",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.environment=multi_turn_env.AskAgain",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "data.max_val_samples=16",
        "trainer.rollout_data_dir={root}/multi_turn_rollouts"]),
    # tests/test_train_ppo.py: GRPO with DAPO's dynamic sampling, validation, a checkpoint and its export
    "grpo_tp2": ("configs/tiny_cpu.yaml", [*GRPO_TP2, "trainer.save_freq=3"]),
    # tests/test_train_ppo_ulysses.py: sp=2 on the rollout's TP=2 group, packed forwards cut by token
    # budgets (a sample is at most 16 + 12 tokens), a KL loss; the sp ranks must shuffle alike
    "ulysses": ("configs/tiny_cpu.yaml", [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=300", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.shuffle=true", *TWO_STEPS]),
    # tests/test_train_ppo_colocate_async.py: colocate_async on one TP=2 engine (its ranks must cut alike: the
    # ranks compare each engine step's decision, and their carried samples after every cut), strategy drop,
    # decoupled PPO with its samples dumped (the IS weights recomputed from them, as async_w1's)
    "async_tp2": ("configs/tiny_cpu.yaml", [
        *ASYNC_W1, "actor_rollout_ref.rollout.tensor_model_parallel_size=2", f"{V1}.sampler.max_off_policy_strategy=drop",
        "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.rollout_data_dir={root}/async_tp2_rollouts"]),
    # tests/test_checkpoint.py: rc_decoupled's step-2 checkpoint, written by 4 ranks, resumed on 2 (DCP
    # reshards), validated before a third step
    "resume_smaller": ("configs/tiny_cpu.yaml", RESUME_SMALLER),
    # --- tests/test_moe.py (LAUNCHES["moe"], its own engine: another architecture): Qwen2-MoE with its shared
    # expert, untrained ({moe}), one engine of TP 2, router replay R2 through activation checkpointing
    "moe_tp2": ("configs/tiny_cpu.yaml", [
        *TINY, "actor_rollout_ref.model.path={moe}", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "trainer.total_training_steps=3"]),
    # --- 4 ranks (LAUNCHES["w4"]); tests/test_train_ppo_rollout_correction.py: decoupled, top_k=20 and top_p=0.9,
    # FSDP groups of 2 (HSDP), vLLM TP=2, RLOO, 2 shuffled PPO epochs; saved and validated at step 2
    "rc_decoupled": ("configs/tiny_cpu.yaml", [
        *RC_DECOUPLED, "trainer.n_gpus_per_node=4", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.test_freq=2", "trainer.val_before_train=false"]),
    # --- tests/test_train_ppo_split.py: collocated 2-rank runs above as 2 trainers + 2 rollout ranks at staleness 0
    # (4 launched ranks, LAUNCHES["w4"]), whose metrics must be theirs bit for bit: at TP 2 (one engine in the pool,
    # rc_decoupled's, which serves it) resume_smaller's, which resumes rc_decoupled's checkpoint of 4 collocated
    # ranks as the split, and grpo_tp2's (dynamic sampling on the pool; no checkpoint); at TP 1 (two engines: the
    # launch builds them anew, run_cases.py) rc_bypass's
    "split_resume_tp2": ("configs/tiny_cpu.yaml", [*RESUME_SMALLER, *SPLIT_2_2, f"{V1}.separate_async.parameter_sync_step=2"]),
    "split_grpo_tp2": ("configs/tiny_cpu.yaml", [*GRPO_TP2, *SPLIT_2_2, f"{V1}.separate_async.parameter_sync_step=2"]),
    "split_bypass_tp1": ("configs/tiny_cpu.yaml", [*RC_BYPASS, *SPLIT_2_2, f"{V1}.separate_async.parameter_sync_step=1"]),
    # --- tests/test_train_ppo.py: verl's losses, estimator, aggregation and KL forms, 2 steps each; two mini
    # batches per step, so the second trains off policy and the trust regions see ratios other than 1
    **{f"verl_{name}": ("configs/tiny_cpu.yaml", [*TWO_STEPS, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                                                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                                                 "actor_rollout_ref.actor.use_kl_loss=true", *mode])
       for name, mode in {
           "gpg": ["actor_rollout_ref.actor.policy_loss.loss_mode=gpg", "algorithm.adv_estimator=gpg"],
           "sapo": ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=1.5",
                    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
           "geo_mean_grpo_passk": ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
                                   "algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.actor.kl_loss_type=abs+"],
           "dppo_tv": ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv", "actor_rollout_ref.actor.clip_ratio=0.15",
                       "actor_rollout_ref.actor.kl_loss_type=k2+"],
           "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline",
                                      "actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
           "gdpo": ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]",
                    "reward_model.reward_manager=dapo"],
           "tir_optimal_token_baseline_dro": ["algorithm.adv_estimator=tir_optimal_token_baseline",
                                              "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                                              "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                              "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
           "dppo_kl_token_sum": ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl",
                                 "actor_rollout_ref.actor.clip_ratio=0.05", "actor_rollout_ref.actor.kl_loss_type=mse+",
                                 "actor_rollout_ref.actor.loss_agg_mode=token-sum"],
       }.items()},
}

ALGORITHM_CASES = ("dapo", "gspo", "drgrpo", "remax_clip_cov", "opo_cispo", "gpg_kl_cov", "reinforce_plus_plus_baseline")
VERL_CASES = tuple(name for name in CASES if name.startswith("verl_"))


# The launches, in this order (a case can read an earlier launch's files): (processes, the cases).
# Cases not named here run in "tp1"; within a launch they run in CASES' order.
LAUNCHES: dict[str, tuple[int, tuple[str, ...]]] = {
    "w4": (4, ("rc_decoupled", "split_resume_tp2", "split_grpo_tp2", "split_bypass_tp1")),
    "tp2": (2, ("multi_turn", "grpo_tp2", "ulysses", "resume_smaller", "async_tp2")),
    "moe": (2, ("moe_tp2",)),
    # TP 1 runs that tests also compare with the TP 2 runs above (every key read): apart from the long TP 1
    # launch, so that its group (conftest.short_run_groups) stays its own
    "tp1_beside": (2, ("gae_kl", "rc_bypass")),
    "tp1": (2, ()),
}
# cases that stop with an error, as their tests expect: each rank's is written to <name>/error.rank<r>.txt
EXPECTED_ERRORS = {"reward_raises", "non_finite"}
# cases that read another case's files ({root}/<name>): selecting one runs the other too
NEEDS = {"resume_smaller": ("rc_decoupled",), "split_resume_tp2": ("rc_decoupled",), "async_resume": ("async_w1",)}


def launch_of(name: str) -> str:
    return next((launch for launch, (_, names) in LAUNCHES.items() if name in names), "tp1")


def code_rows(n: int) -> list[dict]:
    """Rows of a code data set (data_source apps) with one test, no input. Even rows expect no output: a
    response passes when, run as a program, it exits 0 and prints nothing (`#### 7`, `7` do; `1+` does
    not). Odd rows expect `never`, which no response of the tiny model prints."""
    return [{"data_source": "apps", "prompt": [{"role": "user", "content": f"{i % 10}+{i // 10}="}],
             "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": [""],
                                                                           "outputs": ["" if i % 2 == 0 else "never"]})},
             "extra_info": {"index": i}} for i in range(n)]


def launch(names: list[str], assets: dict, model: Path, root: Path,
           reward_model: Callable[[], Path] | None = None, student: Callable[[], Path] | None = None) -> Path:
    """Run the named cases (and those they need) in LAUNCHES' launches; root/<name> is each run's
    directory, root/<launch>.out a launch's output. Placeholders in a case's overrides: `{root}`,
    `{tests}` (this directory), `{untrained}` (the untrained tiny model), `{teacher}`
    (`model`, the warmed one), `{code_val}` (a parquet of code_rows(16)), `{reward_server}`
    (tests/reward_server.py's URL, which logs the items it scores to root/<name>.scored.jsonl),
    `{reward_model}` (the path reward_model() returns: the conftest fixture builds it then,
    tests/demo_reward_model.py), `{student}` (the path student() returns: the model 15 supervised steps
    in, conftest's early_sft_model), `{moe}` (an untrained tiny Qwen2-MoE, make_assets.build_moe_assets). A launch
    that fails is recorded in root/<launch>.failed, and the next launch still runs: only the tests of
    its cases fail (conftest.short_run)."""
    import datasets
    from conftest import clean_env, run, start_reward_server, torchrun_cmd

    names = set(names) | {need for name in names for need in NEEDS.get(name, ())}
    unknown = names - set(CASES)
    assert not unknown, f"no such short run: {sorted(unknown)}"
    fixed = {"{root}": str(root), "{tests}": str(Path(__file__).parent), "{untrained}": str(assets["tiny-qwen2"]),
             "{teacher}": str(model)}
    for key, build in (("reward_model", reward_model), ("student", student)):  # built only when a case names it
        if any(f"{{{key}}}" in o for name in names for o in CASES[name][1]):
            assert build is not None, f"a selected short run needs {{{key}}}: pass launch({key}=...)"
            fixed[f"{{{key}}}"] = str(build())
    if any("{moe}" in o for name in names for o in CASES[name][1]):  # tiny MoE models (make_assets.py --moe)
        import make_assets

        fixed["{moe}"] = str(make_assets.build_moe_assets(root / "moe_assets")["qwen2_moe"])
    if any("{code_val}" in o for name in names for o in CASES[name][1]):
        fixed["{code_val}"] = str(root / "code_val.parquet")
        datasets.Dataset.from_list(code_rows(16)).to_parquet(fixed["{code_val}"])
    env = clean_env(SCRIPTED_USER_LOG=str(root / "multi_turn_users"))  # tests/multi_turn_env.py's log
    (root / "multi_turn_users").mkdir()
    servers = []
    try:
        for launch_name, (nproc, _) in LAUNCHES.items():
            cases = []
            for name, (config, overrides) in CASES.items():
                if name not in names or launch_of(name) != launch_name:
                    continue
                if any("{reward_server}" in o for o in overrides):
                    server, url = start_reward_server(root / f"{name}.scored.jsonl")
                    servers.append(server)
                    overrides = [o.replace("{reward_server}", url) for o in overrides]
                for key, value in fixed.items():
                    overrides = [o.replace(key, value) for o in overrides]
                cases.append([name, ["--config", config, f"actor_rollout_ref.model.path={model}",
                                     f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
                                     f"trainer.default_local_dir={root / name}", *overrides], name in EXPECTED_ERRORS])
            if not cases:
                continue
            # a deadline against a hung launch, not a speed target: LoRA's 160 steps alone took 6 minutes
            # on a busy 2-core machine under ATen's default (unvectorised) kernels
            proc = run(torchrun_cmd(nproc, "tests/run_cases.py", json.dumps(cases)), timeout=600 * len(cases),
                       env=env, check=False)
            (root / f"{launch_name}.out").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                (root / f"{launch_name}.failed").write_text(proc.stdout[-4000:] + proc.stderr[-6000:])
    finally:
        for server in servers:
            server.kill()
            server.wait()
    return root
