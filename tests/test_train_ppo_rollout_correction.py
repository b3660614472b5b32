"""train_ppo.py end to end with algorithm.rollout_correction: real torchrun / gloo ranks, the real vLLM
CPU engine, the warmed model, 2 steps each. Every step syncs the actor into the engine and checks
that it landed, so at the start of a step the two hold identical weights and every importance
weight must be 1 (within float32 error), whatever the sampler truncates:

  decoupled, top_k=20 and top_p=0.9, on 4 ranks: FSDP groups of 2 (HSDP), vLLM TP=2, RLOO, 2 shuffled
      PPO epochs. The engine's log-probs are of the cut distribution; the actor's side of the
      correction (and of the sync check) is computed under the same cut (without it the weights are
      the kept mass, ~0.77-1.0 on this model, and half of the tokens fall outside a 0.1% band)
  bypass, the full vocabulary: no old-log-prob forward; pi_theta against the engine in the loss,
      one optimizer step per step, so pi_theta still equals the synced weights in every micro batch
"""
import json
import math
from pathlib import Path

import pytest
from conftest import short_run
from test_train_ppo import assert_common, assert_learning_signal, step_rows

RC = "algorithm.rollout_correction"


def assert_weights_one(rows: list[dict]) -> None:
    for r in rows:
        for key in ("rollout_is_max", "rollout_is_min", "rollout_is_mean", "rollout_is_seq_mean", "ppl_ratio"):
            assert r[f"rollout_corr/{key}"] == pytest.approx(1.0, abs=1e-4), (r["step"], key)
        for key in ("kl", "k3_kl", "chi2_token", "log_ppl_abs_diff", "rollout_rs_masked_fraction"):
            assert abs(r[f"rollout_corr/{key}"]) < 1e-4, (r["step"], key)


@pytest.fixture
def decoupled_top_p(short_runs) -> Path:
    return short_run(short_runs, "rc_decoupled")


@pytest.fixture
def bypass(short_runs) -> Path:
    return short_run(short_runs, "rc_bypass")


@pytest.mark.slow
@pytest.mark.short_run("rc_decoupled")
def test_decoupled_weights_are_one_under_top_k_top_p_rloo_hsdp(decoupled_top_p):
    rows = step_rows(decoupled_top_p)
    assert [r["step"] for r in rows] == [1, 2]
    # the sync check compares the engine's log-probs with the actor's under the same cut: exact, too
    assert_common(rows, prompts=32, samples=256)
    assert_learning_signal(rows)
    assert_weights_one(rows)
    for r in rows:
        assert r["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0, abs=1e-4)
        assert r["rollout_corr/rollout_rs_token_k1_seq_masked_fraction"] == 0
        assert math.isfinite(r["timing_s/rollout_corr"]) and r["timing_s/old_log_prob"] > 0
    layouts = [json.loads((decoupled_top_p / "layout" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [lay["fsdp_group"] for lay in layouts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [lay["rollout_tp_group"] for lay in layouts] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.slow
@pytest.mark.short_run("rc_bypass")
def test_bypass_mode_skips_the_old_log_prob_forward(bypass):
    rows = step_rows(bypass)
    assert [r["step"] for r in rows] == [1, 2]
    assert_learning_signal(rows)
    assert_weights_one(rows)
    for r in rows:
        assert "timing_s/old_log_prob" not in r and "rollout/logprob_diff_max" not in r  # no such forward
        assert "actor/pg_clipfrac" not in r  # reinforce: no clipping
        assert abs(r["actor/ppo_kl"]) < 1e-4  # pi_theta against the engine, in the loss
        assert r["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == 0


@pytest.mark.slow
@pytest.mark.short_run("rc_decoupled", "rc_bypass")
def test_every_rollout_correction_key_is_read(decoupled_top_p, bypass):
    """tests/test_train_ppo.py's every-key check leaves algorithm.rollout_correction to these two runs."""
    unread = [set(json.loads((out / "config_unread.json").read_text())) for out in (decoupled_top_p, bypass)]
    assert not {k for k in set.intersection(*unread) if k.startswith(RC)}
