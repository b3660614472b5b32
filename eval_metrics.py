"""The numbers papers report from validation with several samples per prompt
(actor_rollout_ref.rollout.val_kwargs.n > 1): verl's bootstrapped best@k / worst@k / maj@k and this
project's unbiased pass@k. Pure functions of plain lists; train_ppo.run_validation computes them per
prompt on the rank that holds the prompt's samples, averages them over prompts and names them.

Per prompt and per variable (the reward, and each numeric extra the reward function returns), as
verl 0.9.1's `process_validation_metrics`:
  mean@n, std@n                 over the prompt's n samples (std: population, numpy's default)
  best@k/mean, best@k/std       mean and std, over 1000 bootstrap draws of k samples with replacement
  worst@k/mean, worst@k/std     (numpy's RandomState(42), the same draws for every prompt), of their max / min
  maj@k/mean, maj@k/std         of the value of the majority answer's first sample in the draw, where the
                                reward function returns a `pred` (its extracted answer) for every sample
for k in 2, 4, 8, ... below n, and n. This project adds pass@k: 1 - C(n-c, k) / C(n, k) with c the
samples that count as correct (value >= 1), the unbiased estimator of Chen et al. 2021, not a maximum
over subsamples.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP, BOOTSTRAP_SEED = 1000, 42  # verl's
CORRECT_AT = 1.0  # pass@k: a sample whose value reaches this is correct (1 is a right answer in every built-in rule)


def subset_sizes(n: int) -> list[int]:
    """verl's k values for n samples: the powers of 2 from 2 below n, then n; none for n <= 1."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def bootstrap_metric(data: Sequence[Any], subset_size: int, reduce_fns: Sequence[Callable[[np.ndarray], float]],
                     n_bootstrap: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED) -> list[tuple[float, float]]:
    """(mean, std) of each reduce_fn over n_bootstrap subsets of subset_size items drawn with replacement,
    the draws those of numpy's legacy generator seeded with `seed` (verl seeds the global one alike)."""
    items = np.empty(len(data), dtype=object)
    items[:] = list(data)  # an object array of the items themselves, even when they are tuples
    draws = np.random.RandomState(seed).choice(len(items), size=(n_bootstrap, subset_size), replace=True)
    results = np.array([[fn(items[idx]) for idx in draws] for fn in reduce_fns], dtype=np.float64)  # (fns, draws)
    return [(float(r.mean()), float(r.std())) for r in results]


def majority_value(votes: Sequence[tuple[Hashable, float]]) -> float:
    """The value of the first (pred, value) pair whose pred is the most frequent; ties go to the pred
    seen first (verl's calc_maj_val)."""
    values: dict[Hashable, list[float]] = defaultdict(list)
    for pred, value in votes:
        values[pred].append(value)
    top = max(values, key=lambda pred: len(values[pred]))  # the first of equal counts
    return values[top][0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_metrics(values: Sequence[float], preds: Sequence[Hashable | None] | None = None, *,
                   unbiased_pass: bool = False, seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """One prompt's metrics of one variable (module docstring) from its samples' values, and their
    predicted answers when every sample has one (maj@k); pass@k (this project's) with unbiased_pass."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    with_preds = preds is not None and len(preds) == n and all(p is not None for p in preds)
    correct = sum(v >= CORRECT_AT for v in values)
    for k in subset_sizes(n):
        (best, best_std), (worst, worst_std) = bootstrap_metric(values, k, [np.max, np.min], seed=seed)
        out.update({f"best@{k}/mean": best, f"best@{k}/std": best_std,
                    f"worst@{k}/mean": worst, f"worst@{k}/std": worst_std})
        if with_preds:
            [(maj, maj_std)] = bootstrap_metric(list(zip(preds, values, strict=True)), k, [majority_value], seed=seed)
            out.update({f"maj@{k}/mean": maj, f"maj@{k}/std": maj_std})
        if unbiased_pass:
            out[f"pass@{k}"] = pass_at_k(n, correct, k)
    return out


def per_prompt_metrics(prompt_ids: Sequence[Hashable], data_sources: Sequence[str],
                       variables: dict[str, Sequence[float | None]], preds: Sequence[Hashable | None],
                       seed: int = BOOTSTRAP_SEED) -> dict[tuple[str, str, str], list[float]]:
    """{(data_source, var, metric): one value per prompt} for the samples given (sample i of prompt
    prompt_ids[i]; each of a prompt's samples must be here). variables: per name, a value per sample
    (None where the sample has none: the prompt's metric is over those that do); preds: the answer per
    sample, or None. pass@k for `reward` and `acc`."""
    samples: dict[Hashable, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompt_ids):
        samples[prompt].append(i)
    out: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for members in samples.values():
        prompt_preds = [preds[i] for i in members]
        for var, values in variables.items():
            present = [values[i] for i in members if values[i] is not None]
            if not present:
                continue
            for metric, value in prompt_metrics(present, prompt_preds, unbiased_pass=var in ("reward", "acc"),
                                                seed=seed).items():
                out[data_sources[members[0]], var, metric].append(value)
    return dict(out)


def metric_name(data_source: str, var: str, metric: str, core_var: str, n_max: int) -> str:
    """verl's name of a metric averaged over a data source's prompts: val-core/<source>/<var>/<metric> for
    the core variable's mean / maj / best at the largest n, val-aux/... for the rest; pass@k (this
    project's) under val-unbiased/<source>/<var>/pass@<k>."""
    if metric.startswith("pass@"):
        return f"val-unbiased/{data_source}/{var}/{metric}"
    core = var == core_var and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
    return f"{'val-core' if core else 'val-aux'}/{data_source}/{var}/{metric}"


def name_metrics(means: dict[tuple[str, str, str], float]) -> dict[str, float]:
    """{(data_source, var, metric): mean over the source's prompts} -> verl's names (metric_name). The core
    variable of a source is `acc` where its reward function returns one, else `reward`; n_max is the
    largest n of a (source, var)'s metrics."""
    sources: dict[str, set[str]] = defaultdict(set)
    n_max: dict[tuple[str, str], int] = defaultdict(int)
    for source, var, metric in means:
        sources[source].add(var)
        n = int(metric.split("@")[-1].split("/")[0])
        n_max[source, var] = max(n_max[source, var], n)
    return {metric_name(source, var, metric, "acc" if "acc" in sources[source] else "reward", n_max[source, var]):
            value for (source, var, metric), value in means.items()}
