"""train_ppo.py end to end with trainer.v1.trainer_mode=colocate_async (verl V1's collocated partial rollouts):
real torchrun / gloo ranks, the real vLLM CPU engine, the warmed model (tests/short_runs.py's async_* cases).

  async_w0 against async_sync_reference, in one launch: no batch ahead, so every group dispatched is
      trained in its step and nothing is cut; the stream must then be the sync run, metric for metric.
  async_w1: a batch of groups ahead, bound 2 versions, decoupled PPO, 2 rollout dp groups: the cut
      carries samples, some trained tokens come from the weights before the last update, none older;
      the sync check on the fresh tokens stays as tight as the sync run's, while the stale ones drift.
      Its dumps (trainer.rollout_data_dir) hold each token's weight version, the engine's and the old actor's
      log-probs and the IS weight applied: the weights recomputed from them are the trainer's.
  async_resume: async_w1 resumed from its step-2 checkpoint (the carried samples with it) repeats its
      steps 3 and 4 exactly, metrics and dumped samples.
  async_tp2: one TP=2 engine, strategy drop, decoupled: its ranks cut alike (the trainer compares their
      carried samples after each cut and raises otherwise), and its dumps give its IS weights, as async_w1's.
  async_bypass: bypass mode (the engine's log-probs as the old policy), strategy drop.
"""
import json
from pathlib import Path

import pytest
import torch
from conftest import short_run
from test_checkpoint import compared
from test_train_ppo import assert_common, step_rows

OFF = "training/off_policy/"
RC = "rollout_corr/rollout_is"


@pytest.mark.short_run("async_sync_reference", "async_w0")
def test_colocate_async_without_a_batch_ahead_is_the_sync_run(short_runs):
    sync, stream = (step_rows(short_run(short_runs, name)) for name in ("async_sync_reference", "async_w0"))
    assert [r["step"] for r in sync] == [r["step"] for r in stream] == [1, 2]
    for a, b in zip(sync, stream, strict=True):
        assert {k: b[k] for k in compared(a)} == compared(a), a["step"]  # bit for bit (same launch, same kernels)
        assert b[f"{OFF}stale_token_fraction"] == 0 and b["rollout/aborted_samples"] == 0
        assert b["rollout/carried_groups"] == 0


@pytest.mark.short_run("async_w1")
def test_carried_tokens_stay_within_the_bound_and_fresh_ones_match_the_engine(short_runs):
    rows = step_rows(short_run(short_runs, "async_w1"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_common(rows, prompts=8, samples=32)
    for r in rows:
        # verl's span: at most max_off_policy_threshold=2 versions; staleness against the weights synced
        assert r[f"{OFF}trajectory_staleness_worst/max"] <= 1 and r[f"{OFF}trajectory_spans/max"] <= 2
        assert r["rollout/logprob_diff_max"] < 1e-4, r["step"]  # the fresh tokens: the sync check holds
    assert rows[0][f"{OFF}stale_token_fraction"] == 0  # step 1: nothing was carried yet
    later = rows[1:]
    assert all(r["rollout/carried_groups"] > 0 for r in rows), "nothing carried: the cut is untested"
    assert sum(r["rollout/reprefilled_tokens"] for r in later) > 0 and all(r[f"{OFF}stale_token_fraction"] > 0
                                                                            for r in later)
    # the stale tokens did drift (the update moved the actor): counted with the fresh ones, the sync check
    # would fail, and the versions decide which is which
    assert max(r["rollout/stale_logprob_diff_max"] for r in later) > 1e-3


def dumped(out: Path, name: str, step: int) -> list[dict]:
    """A step's samples as trainer.rollout_data_dir (<root>/<name>_rollouts, tests/short_runs.py) holds them."""
    path = out.parent / f"{name}_rollouts" / f"{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_is_weights_recomputed(out: Path, name: str, samples: int) -> None:
    """Decoupled rollout correction, token level, rollout_is_threshold=2 (TIS): w = min(pi_old / pi_engine, 2) on
    every trained token, recomputed here in float64 from the dumped log-probs and compared with the weights the
    trainer applied (dumped beside them) and with its rollout_corr/* metrics of the whole step batch. The fresh
    tokens (version step - 1) have weights of 1 (the sync check); the stale ones do not, so the dumped versions
    tell the two apart."""
    stale_deviation = []
    for m in step_rows(out):
        step = m["step"]
        records = dumped(out, name, step)
        assert len(records) == samples and {r["step"] for r in records} == {step}
        # every response token is trained (no tool replies, no rejection): the stale ones too, weighted
        assert all(set(r["mask"]) == {1} for r in records)
        old, engine, applied, versions = (torch.tensor([x for r in records for x in r[key]], dtype=torch.float64)
                                          for key in ("old_log_probs", "rollout_log_probs", "rollout_is_weights",
                                                      "versions"))
        assert len(old) == sum(len(r["tokens"]) for r in records) == pytest.approx(m["response_length/mean"] * samples)
        weights = (old - engine).exp().clamp(max=2.0)
        assert torch.allclose(weights, applied, rtol=1e-5, atol=0), (step, (weights - applied).abs().max())
        assert m[f"{RC}_mean"] == pytest.approx(weights.mean().item(), rel=1e-5)
        assert m[f"{RC}_max"] == pytest.approx(weights.max().item(), rel=1e-5)
        assert m[f"{RC}_min"] == pytest.approx(weights.min().item(), rel=1e-5)
        assert m[f"{RC}_std"] == pytest.approx(weights.std(correction=0).item(), rel=1e-3, abs=1e-3)  # float32 E[w^2] - E[w]^2
        fresh = versions == step - 1
        assert ((versions >= step - 2) & (versions <= step - 1)).all()  # bound 2: this step's weights or the last
        assert (weights[fresh] - 1).abs().max() < 1e-4, step
        assert fresh.double().mean().item() == pytest.approx(1 - m[f"{OFF}stale_token_fraction"], abs=1e-9)
        stale_deviation.append((weights[~fresh] - 1).abs().max().item() if (~fresh).any() else 0.0)
    # carried tokens, sampled before the last update: weighted by how far the actor moved since (on some steps
    # only a few confident tokens are stale, and they hardly move)
    assert stale_deviation[0] == 0 and max(stale_deviation) > 1e-3, stale_deviation


@pytest.mark.short_run("async_w1")
def test_is_weights_recomputed_from_the_dumps_equal_the_trainers(short_runs):
    assert_is_weights_recomputed(short_run(short_runs, "async_w1"), "async_w1", samples=32)


@pytest.mark.short_run("async_w1", "async_resume")
def test_resume_with_carried_samples_repeats_the_run(short_runs):
    reference = {r["step"]: r for r in step_rows(short_run(short_runs, "async_w1"))}
    resumed = step_rows(short_run(short_runs, "async_resume"))
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert compared(r) == compared(reference[r["step"]]), r["step"]
        # the same samples, tokens, versions and log-probs (carried ones included)
        assert dumped(short_run(short_runs, "async_resume"), "async_resume", r["step"]) == \
            dumped(short_run(short_runs, "async_w1"), "async_w1", r["step"])


@pytest.mark.slow  # the TP=2 launch runs in the full suite only
@pytest.mark.short_run("async_tp2")
def test_tp_ranks_cut_alike_and_drop_keeps_the_bound(short_runs):
    """One TP=2 engine (one rollout dp group), decoupled PPO: the trainer compares its TP ranks' decisions at each
    engine step and their carried samples after each cut (and raises otherwise); every trained token within the
    bound, the fresh ones' sync check as tight as at TP 1, the IS weights recomputed from the dumps."""
    out = short_run(short_runs, "async_tp2")
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r[f"{OFF}trajectory_staleness_worst/max"] <= 1 and r[f"{OFF}trajectory_spans/max"] <= 2
        assert r["actor/on_policy_shortcut"] == 0
        assert r["rollout/logprob_diff_max"] < 1e-4, r["step"]  # the fresh tokens
    assert all(r["rollout/carried_groups"] > 0 for r in rows) and rows[-1][f"{OFF}stale_token_fraction"] > 0
    assert_is_weights_recomputed(out, "async_tp2", samples=32)


@pytest.mark.short_run("async_bypass")
def test_bypass_mode_trains_carried_samples_without_an_old_policy_forward(short_runs):
    """Bypass mode (the engine's log-probs are the old policy), strategy drop: no old-log-prob forward, no shortcut,
    carried samples trained within the bound."""
    rows = step_rows(short_run(short_runs, "async_bypass"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # no old-log-prob forward: no sync check to read, no phase timed
        assert r[f"{OFF}trajectory_staleness_worst/max"] <= 1 and r[f"{OFF}trajectory_spans/max"] <= 2
        assert r["actor/on_policy_shortcut"] == 0 and "timing_s/old_log_prob" not in r
    assert all(r["rollout/carried_groups"] > 0 for r in rows) and rows[-1][f"{OFF}stale_token_fraction"] > 0
