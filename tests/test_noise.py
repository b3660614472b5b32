"""tests/noise.py, the learning tests' standard errors, against references computed another way."""

import math
import random
import statistics

import noise
import numpy as np
import pytest


def test_trend_is_the_least_squares_line_and_its_standard_error():
    rng = random.Random(0)
    ys = [0.01 * t + rng.gauss(0, 0.05) for t in range(40)]
    change, se = noise.trend(ys)
    fit = statistics.linear_regression(range(40), ys)
    assert change == pytest.approx(fit.slope * 39, rel=1e-12)
    x = np.arange(40.0)
    design = np.stack([np.ones_like(x), x], 1)
    beta, residual, *_ = np.linalg.lstsq(design, np.array(ys), rcond=None)
    cov = residual[0] / (40 - 2) * np.linalg.inv(design.T @ design)
    assert se == pytest.approx(math.sqrt(cov[1, 1]) * 39, rel=1e-9)


def test_a_flat_run_is_not_a_rise_and_a_steady_one_is():
    rng = random.Random(1)
    flat = [0.3 + rng.gauss(0, 0.05) for _ in range(80)]
    rising = [0.3 + 0.004 * t + rng.gauss(0, 0.05) for t in range(80)]
    with pytest.raises(AssertionError, match="standard errors"):
        noise.assert_above(*noise.trend(flat), 0.0, "flat")
    assert noise.assert_above(*noise.trend(rising), 0.0, "rising") > 4


def test_shifts_and_units():
    before, after = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]
    diff, se = noise.shift(before, after)
    assert diff == pytest.approx(5.0 - 2.0)
    assert se == pytest.approx(math.hypot(statistics.stdev(before) / 3 ** 0.5, statistics.stdev(after) / 2))
    records = [{"p": "a", "s": 0.0}, {"p": "a", "s": 1.0}, {"p": "b", "s": 1.0}]
    assert noise.by_unit(records, "p", "s") == {"a": 0.5, "b": 1.0}
    assert noise.paired_shift({"a": 0.5, "b": 1.0}, {"a": 1.0, "b": 1.0}) == pytest.approx((0.25, 0.25))


def test_no_spread_passes_only_a_real_effect():
    assert noise.assert_above(1.0, 0.0, 0.0, "every unit moved alike") == math.inf
    for effect in (0.0, -1.0):
        with pytest.raises(AssertionError):
            noise.assert_above(effect, 0.0, 0.0, "nothing moved")

