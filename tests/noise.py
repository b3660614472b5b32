"""The noise of what a learning test measures, so that its margin is set in standard errors of it.

A learning test asserts that something moved: a score rose, a KL fell, an accuracy stands above chance.
The same seeds do not give the same samples on every CPU: ATen, MKL and oneDNN pick their kernels by
instruction set, the floats of a matmul differ in the last bits, and a sampled token or a greedy argmax
flips a few steps later. A threshold tuned on one machine's run is inside the noise on the next one.
So each learning test estimates the standard error of its quantity from the data it already has and
asserts the effect by MARGIN of them:

  * a score logged every step: the steps are the units (a step's samples share its prompts and its
    policy, so they are not independent draws); two windows of steps are compared by their means;
  * a held-out set scored twice (before and after): the prompts are the units, paired;
  * an accuracy over pairs: the prompts are the units again (a prompt's pairs share its answers).

Beside each threshold its test's docstring gives the effect measured in these units on the machine's own
kernels and under the capped ones (`make learning-caps`), so the margin of the right code above the
threshold is on record too.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Hashable, Mapping, Sequence

MARGIN = 4.0  # standard errors


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean of independent units and its standard error (the sample standard deviation / sqrt(n))."""
    assert len(values) >= 2, f"a standard error needs two units or more, got {len(values)}"
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def shift(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """mean(after) - mean(before) over two independent sets of units, and its standard error (Welch's)."""
    (m0, se0), (m1, se1) = mean_and_se(before), mean_and_se(after)
    return m1 - m0, math.hypot(se0, se1)


def paired_shift(before: Mapping[Hashable, float], after: Mapping[Hashable, float]) -> tuple[float, float]:
    """The mean over units of after[u] - before[u] (the same units scored twice), and its standard error."""
    assert before.keys() == after.keys(), "paired scores need the same units before and after"
    return mean_and_se([after[u] - before[u] for u in before])


def by_unit(records: Sequence[Mapping], unit: str, value: str) -> dict[Hashable, float]:
    """The mean of record[value] over the records of each record[unit] (e.g. a prompt's samples)."""
    groups: dict[Hashable, list[float]] = {}
    for record in records:
        groups.setdefault(record[unit], []).append(float(record[value]))
    return {key: statistics.fmean(values) for key, values in groups.items()}


def assert_above(effect: float, se: float, floor: float, what: str) -> float:
    """effect >= floor + MARGIN * se; returns the margin in standard errors, (effect - floor) / se. With
    NOISE_LOG set (tests/kernel_caps.sh sets it), each check is also appended there as a JSON line."""
    margin = (effect - floor) / se if se > 0 else math.copysign(math.inf, effect - floor) if effect != floor else 0.0
    if log := os.environ.get("NOISE_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "effect": effect, "se": se, "floor": floor,
                                "margin": margin}) + "\n")
    assert margin >= MARGIN, (f"{what}: {effect:.4f} is {margin:.1f} standard errors ({se:.4f}) above {floor}, "
                              f"need {MARGIN:.0f}")
    return margin


def trend(values: Sequence[float]) -> tuple[float, float]:
    """The change over a run of per-step values by their least-squares line (the slope times the steps
    between the first and the last), and its standard error from the residuals: the steps are the units,
    and a steady trend is not counted as noise, as it would be in the spread of a window of steps."""
    n = len(values)
    assert n >= 4, f"a trend needs four steps or more, got {n}"
    xs = range(n)
    x_mean, y_mean = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, values, strict=True)) / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in zip(xs, values, strict=True)) / (n - 2)
    return slope * (n - 1), math.sqrt(residual / sxx) * (n - 1)
