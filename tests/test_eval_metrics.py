"""eval_metrics against hand-computed cases, an enumeration of every k-subset (pass@k), and verl
0.9.1's bootstrap written out as a plain loop over numpy's seeded draws."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest

import eval_metrics as em


def test_subset_sizes_are_powers_of_two_below_n_then_n():
    assert [em.subset_sizes(n) for n in (0, 1, 2, 3, 4, 5, 8, 10)] == [
        [], [], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8], [2, 4, 8, 10]]


def test_pass_at_k_by_hand_and_by_enumerating_every_subset():
    assert em.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) / C(4,2)
    assert em.pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the fraction correct
    assert em.pass_at_k(4, 0, 4) == 0.0 and em.pass_at_k(4, 3, 2) == 1.0  # n - c < k: every subset passes
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert em.pass_at_k(n, c, k) == pytest.approx(sum(map(max, subsets)) / len(subsets))
    with pytest.raises(ValueError, match="n=3, c=4"):
        em.pass_at_k(3, 4, 1)


def verl_bootstrap_loop(data, k, reduce_fn, n_bootstrap=1000, seed=42):
    """verl's bootstrap_metric for one function, as a loop: seed numpy's global generator, draw every index
    matrix at once, reduce each row's items."""
    np.random.seed(seed)
    draws = np.random.choice(len(data), size=(n_bootstrap, k), replace=True)
    results = []
    for row in draws:
        results.append(reduce_fn([data[i] for i in row]))
    mean = sum(results) / len(results)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in results) / len(results))


def verl_majority(pairs):
    counts = Counter(pred for pred, _ in pairs)
    top = max(counts.values())
    return next(value for pred, value in pairs if counts[pred] == top)  # the first sample of the first top pred


def test_bootstrap_equals_verls_loop_and_a_hand_expectation():
    values = [0.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    for k in (2, 3, 6):
        (best, best_std), (worst, worst_std) = em.bootstrap_metric(values, k, [np.max, np.min])
        assert (best, best_std) == pytest.approx(verl_bootstrap_loop(values, k, max), abs=1e-12)
        assert (worst, worst_std) == pytest.approx(verl_bootstrap_loop(values, k, min), abs=1e-12)
    # best of 2 draws from {0, 1}: P(at least one 1) = 3/4, within 4 standard errors of 1000 draws
    (best, std), = em.bootstrap_metric([0.0, 1.0], 2, [np.max])
    assert abs(best - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 1000) and std == pytest.approx(math.sqrt(best * (1 - best)))
    assert em.bootstrap_metric([0.25] * 4, 4, [np.max]) == [(0.25, 0.0)]
    assert em.bootstrap_metric(values, 3, [np.max], seed=1) != em.bootstrap_metric(values, 3, [np.max])


def test_majority_vote_takes_the_first_sample_of_the_most_frequent_answer():
    assert em.majority_value([("A", 0.9), ("B", 0.8), ("A", 0.7)]) == 0.9
    assert em.majority_value([("B", 0.0), ("A", 1.0), ("A", 1.0), ("B", 0.5)]) == 0.0  # a tie: B came first
    pairs = [("7", 1.0), ("3", 0.0), ("7", 0.0), ("5", 0.0), ("3", 0.0)]
    mean, std = verl_bootstrap_loop(pairs, 4, verl_majority)
    [(got, got_std)] = em.bootstrap_metric(pairs, 4, [em.majority_value])
    assert (got, got_std) == pytest.approx((mean, std), abs=1e-12)


def test_prompt_metrics_names_values_and_when_maj_and_pass_appear():
    values, preds = [1.0, 0.0, 1.0, 0.0, 0.0], ["8", "9", "8", "9", "9"]
    got = em.prompt_metrics(values, preds, unbiased_pass=True)
    ks = (2, 4, 5)
    assert set(got) == {"mean@5", "std@5", *(f"{m}@{k}/{s}" for k in ks for m in ("best", "worst", "maj")
                                              for s in ("mean", "std")), *(f"pass@{k}" for k in ks)}
    assert got["mean@5"] == pytest.approx(0.4) and got["std@5"] == pytest.approx(math.sqrt(0.24))
    assert got["pass@2"] == pytest.approx(1 - 3 / 10) and got["pass@4"] == 1.0  # C(3,2)/C(5,2); 3 wrong < 4
    for k in ks:
        assert (got[f"best@{k}/mean"], got[f"best@{k}/std"]) == pytest.approx(verl_bootstrap_loop(values, k, max))
        pairs = list(zip(preds, values, strict=True))
        assert got[f"maj@{k}/mean"] == pytest.approx(verl_bootstrap_loop(pairs, k, verl_majority)[0])
    assert not any(m.startswith(("maj", "pass")) for m in em.prompt_metrics(values, [*preds[:4], None]))
    assert em.prompt_metrics([0.5]) == {"mean@1": 0.5}  # one sample: verl logs its mean only


def test_names_follow_verls_core_and_aux_split():
    means = {("gsm8k", "reward", "mean@4"): 0.5, ("gsm8k", "reward", "std@4"): 0.1,
             ("gsm8k", "reward", "best@2/mean"): 0.7, ("gsm8k", "reward", "best@4/mean"): 0.9,
             ("gsm8k", "reward", "worst@4/mean"): 0.1, ("gsm8k", "reward", "pass@4"): 0.95,
             ("openai/math", "acc", "mean@4"): 0.3, ("openai/math", "acc", "maj@4/mean"): 0.4,
             ("openai/math", "reward", "mean@4"): -0.4}
    assert em.name_metrics(means) == {
        "val-core/gsm8k/reward/mean@4": 0.5, "val-aux/gsm8k/reward/std@4": 0.1,
        "val-aux/gsm8k/reward/best@2/mean": 0.7, "val-core/gsm8k/reward/best@4/mean": 0.9,
        "val-aux/gsm8k/reward/worst@4/mean": 0.1, "val-unbiased/gsm8k/reward/pass@4": 0.95,
        # a source whose reward function returns `acc`: acc is its core variable, the reward goes to val-aux
        "val-core/openai/math/acc/mean@4": 0.3, "val-core/openai/math/acc/maj@4/mean": 0.4,
        "val-aux/openai/math/reward/mean@4": -0.4}
