"""train_ppo.py end to end with packed forwards and token-budget micro batches, against the padded
run: GAE with a reference model and a critic, so every training forward (old and reference
log-probs, values, the critic's and the actor's updates) runs packed and cut by tokens. Real torchrun
/ gloo ranks and the real vLLM CPU engine, 3 steps each, compared through their metrics files.

One mini batch per step, so the packed run takes its old log-probs from the actor update's own
forward (train_ppo.old_log_prob_source); the padded run is kept off that path by a rollout rejection
band no token comes near (ratios 0.5-2 where the engine and the actor agree to 1e-5), which changes
no number but needs the old log-probs before the update: the shortcut is checked against the
separate forward, too."""

import pytest
from conftest import short_run
from test_train_ppo import assert_common, step_rows

# what is expected to differ: wall-clock times, throughput, memory, and the padding itself
NOT_COMPARED = ("timing_s/", "perf/", "actor/on_policy_shortcut", "rollout_corr/rollout_rs")
# logged as the mean of the micro batches' values (train_ppo.run_updates), so they move with the cut
MICRO_BATCH_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")


@pytest.mark.slow
@pytest.mark.short_run("padded", "packed")
def test_packed_dynamic_run_equals_padded_run(short_runs):
    """tests/short_runs.py's padded and packed cases."""
    padded, packed = (step_rows(short_run(short_runs, name)) for name in ("padded", "packed"))
    assert_same_run(padded, packed)
    for want, got in zip(padded, packed, strict=True):
        assert want["actor/on_policy_shortcut"] == 0 and "timing_s/old_log_prob" in want
        assert want["rollout_corr/rollout_rs_token_k1_masked_fraction"] == 0  # the band rejected nothing
        assert got["actor/on_policy_shortcut"] == 1 and "timing_s/old_log_prob" not in got


def assert_same_run(padded: list[dict], packed: list[dict]) -> None:
    assert [r["step"] for r in packed] == [r["step"] for r in padded] == [1, 2, 3]
    for rows in (padded, packed):
        assert_common(rows, prompts=32, samples=256)  # includes rollout/logprob_diff_max < 1e-3
    for want, got in zip(padded, packed, strict=True):
        assert want["perf/padding_fraction"] > 0.02 and got["perf/padding_fraction"] == 0.0
        keys = [k for k in want if not k.startswith(NOT_COMPARED)]
        assert set(keys) <= set(got), sorted(set(keys) - set(got))
        for key in keys:
            # means over micro batches depend on the cut (a mean of means), by design; all else
            # (losses, gradient norms, values, advantages, the weights' effect on the next step) must not
            tolerance = dict(abs=1e-3) if key in MICRO_BATCH_MEANS else dict(rel=1e-4, abs=1e-5)
            assert got[key] == pytest.approx(want[key], **tolerance), (want["step"], key, want[key], got[key])
