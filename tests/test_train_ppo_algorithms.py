"""The algorithm recipes end to end: each of configs/gsm8k_{dapo,gspo,drgrpo}_1node_6gpu.yaml runs 2
steps on 2 CPU ranks as shipped but for a tiny warmed model, short lengths and small batches, plus one
run each of what no recipe uses (ReMax's greedy baseline generation and the clip_cov loss, OPO with
CISPO, GPG with KL-Cov, REINFORCE++-baseline). All of them run in one torchrun launch, one after
another, sharing the vLLM engine (tests/run_cases.py): a short run's time is mostly the imports and
the engine start-up. The maths is checked in test_ppo_core.py and the step functions in
test_train_ppo_steps.py."""

import json
import math
from pathlib import Path

import pytest
from conftest import torchrun
from test_train_ppo import assert_common, step_rows, tiny

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

CASES = {
    # generation batches of train_batch_size, so a uniform group costs another batch; the overlong
    # buffer over all 12 tokens, so every response pays length / 12
    "dapo": ("configs/gsm8k_dapo_1node_6gpu.yaml", ["data.gen_batch_size=8", "reward_model.overlong_buffer.len=12",
                                                     "reward_model.overlong_buffer.log=true"]),
    "gspo": ("configs/gsm8k_gspo_1node_6gpu.yaml", []),
    "drgrpo": ("configs/gsm8k_drgrpo_1node_6gpu.yaml", []),
    "remax_clip_cov": ("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=remax",
                                                 "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                                                 "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05"]),
    # every other estimator and loss mode, paired so that each runs end to end once
    "opo_cispo": ("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=opo",
                                            "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"]),
    "gpg_kl_cov": ("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=gpg",
                                             "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
                                             "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.05"]),
    "reinforce_plus_plus_baseline": ("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=reinforce_plus_plus_baseline"]),
}


@pytest.fixture(scope="module")
def recipe_runs(tiny_assets, sft_model, tmp_path_factory) -> Path:
    """Every case, 2 steps each, in one launch: <dir>/<case> is each run's directory."""
    runs = tmp_path_factory.mktemp("recipes")
    cases = [[case, ["--config", config, *tiny(tiny_assets, runs / case, sft_model), *TINY, *extra]]
             for case, (config, extra) in CASES.items()]
    torchrun(2, "tests/run_cases.py", json.dumps(cases), timeout=1500)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_recipe_runs_two_steps(case, recipe_runs):
    out = recipe_runs / case
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert_common(rows, prompts=8, samples=32)
    unread = set(json.loads((out / "config_unread.json").read_text()))
    for r in rows:
        assert math.isfinite(r["actor/ppo_kl"]) and math.isfinite(r["actor/grad_norm"]), r
        assert case == "gpg_kl_cov" or math.isfinite(r["actor/pg_clipfrac"]), r  # kl_cov clips nothing
    if case == "dapo":
        for r in rows:
            assert 0 <= r["train/uniform_group_fraction"] < 1, r
            assert r["train/num_gen_batches"] >= (2 if r["train/uniform_group_fraction"] > 0 else 1), r
            assert 0 <= r["reward_extra/acc"] <= 1 and r["reward_extra/overlong_reward"] < 0, r
            # the score is acc plus a penalty in [-1, 0]
            assert r["critic/score/min"] >= -1.0 and r["critic/score/max"] <= 1.0, r
            # trained only on groups whose acc differs: every group has a positive and a negative advantage
            assert r["critic/advantages/max"] > 0 > r["critic/advantages/min"], r
        assert not {"algorithm.filter_groups.metric", "reward_model.overlong_buffer.len", "data.gen_batch_size",
                    "actor_rollout_ref.actor.clip_ratio_high"} & unread
    if case == "gspo":
        assert "actor_rollout_ref.actor.policy_loss.loss_mode" not in unread
    if case == "remax_clip_cov":
        assert "actor_rollout_ref.actor.policy_loss.clip_cov_ratio" not in unread
        assert all(r["actor/pg_clipfrac"] > 0 for r in rows)  # clip_cov cut some tokens' gradients
