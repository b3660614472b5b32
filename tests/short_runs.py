"""The short 2-rank runs that several test modules check, launched together.

Each case is a train_ppo run on 2 CPU ranks at TP 1 with configs/tiny_cpu.yaml's lengths, the warmed
(SFT) tiny model and the demo data; its test checks the files it leaves in <dir>/<name>. All the
cases the selected tests use (`@pytest.mark.short_run("name")`) run in one torchrun launch, one after
another, sharing the vLLM engine (tests/run_cases.py): most of a short run's time on a CPU is the
imports and the engine start-up, which the launch pays once. The `short_runs` fixture (conftest.py)
starts it.
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
# the learned reward model's run (learn_rm): greedy validation 0.11 at step 0; 0.27, 0.21, 0.25, 0.35 at steps
# 5, 10, 15, 20; 0.39 at 40 (the rule's own run, `learn`, needs 40 steps for +0.1)
LEARN_RM_STEPS = 20

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
    # the demo's task, shortened: after 40 GRPO steps the greedy validation score is clearly higher
    "learn": ("configs/tiny_cpu.yaml", ["trainer.total_training_steps=40", "trainer.test_freq=40"]),
    # --- tests/test_reward_model.py: the demo's task trained on a learned reward model's scores
    # (tests/demo_reward_model.py) instead of the rule's; validation scores with the rule, as in verl: after
    # LEARN_RM_STEPS GRPO steps the greedy validation score is clearly higher
    "learn_rm": ("configs/tiny_cpu.yaml", [
        f"trainer.total_training_steps={LEARN_RM_STEPS}", f"trainer.test_freq={LEARN_RM_STEPS}", "reward_model.enable=true",
        "reward_model.model.path={reward_model}", "reward_model.micro_batch_size_per_gpu=64"]),
    # --- tests/test_train_ppo_rollout_correction.py
    "rc_bypass": ("configs/tiny_cpu.yaml", [
        *TWO_STEPS, f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
        f"{RC}.rollout_rs=seq_max_k2,seq_sum_k1", f"{RC}.rollout_rs_threshold=1e-6,1.001",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32"]),  # one optimizer step per step
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
           "dppo_kl_token_sum": ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl",
                                 "actor_rollout_ref.actor.clip_ratio=0.05", "actor_rollout_ref.actor.kl_loss_type=mse+",
                                 "actor_rollout_ref.actor.loss_agg_mode=token-sum"],
       }.items()},
}

ALGORITHM_CASES = ("dapo", "gspo", "drgrpo", "remax_clip_cov", "opo_cispo", "gpg_kl_cov", "reinforce_plus_plus_baseline")
VERL_CASES = tuple(name for name in CASES if name.startswith("verl_"))


def launch(names: list[str], assets: dict, model: Path, root: Path,
           reward_model: Callable[[], Path] | None = None) -> Path:
    """Run the named cases (in CASES' order) in one 2-rank launch; root/<name> is each run's directory.
    A case that names `{reward_server}` gets tests/reward_server.py's URL, which logs the items it
    scores to root/<name>.scored.jsonl; one that names `{reward_model}` gets the path reward_model()
    returns (the conftest fixture builds it then: tests/demo_reward_model.py)."""
    from conftest import start_reward_server, torchrun

    unknown = set(names) - set(CASES)
    assert not unknown, f"no such short run: {sorted(unknown)}"
    servers, cases = [], []
    for name, (config, overrides) in CASES.items():
        if name not in names:
            continue
        if any("{reward_server}" in o for o in overrides):
            server, url = start_reward_server(root / f"{name}.scored.jsonl")
            servers.append(server)
            overrides = [o.replace("{reward_server}", url) for o in overrides]
        if any("{reward_model}" in o for o in overrides):
            assert reward_model is not None, f"short run {name} needs a reward model: pass launch(reward_model=...)"
            path = str(reward_model())
            overrides = [o.replace("{reward_model}", path) for o in overrides]
        cases.append([name, ["--config", config, f"actor_rollout_ref.model.path={model}",
                             f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
                             f"trainer.default_local_dir={root / name}", *overrides]])
    try:
        if cases:
            torchrun(2, "tests/run_cases.py", json.dumps(cases), timeout=300 * len(cases))
    finally:
        for server in servers:
            server.kill()
            server.wait()
    return root
