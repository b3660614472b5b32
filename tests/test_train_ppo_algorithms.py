"""The algorithm recipes end to end: each of configs/gsm8k_{dapo,gspo,drgrpo}_1node_6gpu.yaml runs 2
steps on 2 CPU ranks as shipped but for a tiny warmed model, short lengths and small batches, plus one
run each of what no recipe uses (ReMax's greedy baseline generation and the clip_cov loss, OPO with
CISPO, GPG with KL-Cov, REINFORCE++-baseline). The cases are tests/short_runs.py's, run in one launch with the
other short runs. The maths is checked in test_ppo_core.py and the step functions in
test_train_ppo_steps.py."""

import json
import math

import pytest
from conftest import short_run
from short_runs import ALGORITHM_CASES
from test_train_ppo import assert_common, step_rows


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.short_run(case)) for case in ALGORITHM_CASES])
def test_recipe_runs_two_steps(case, short_runs):
    out = short_run(short_runs, case)
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
