"""Rule rewards: a score per response, chosen by data source or given by the user.

A reward function has verl's signature

    compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float

Built in: GSM8K's rule (the number after the last `####` must equal the ground truth) and the demo
arithmetic task (the same rule). A user function comes from `custom_reward_function.path` (a .py
file) and `.name`. A function that raises stops the run and shows the sample it failed on: a
reward bug silently scored 0 would look like a model that cannot learn.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config import ConfigError

RewardFn = Callable[..., float]

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the last `####`, commas removed; None when there is none."""
    matches = _ANSWER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def gsm8k_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """1 for the right number after `####`, `format_score` for a wrong one, 0 for none."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        return score if float(answer) == float(str(ground_truth).replace(",", "")) else format_score
    except ValueError:
        return format_score


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """Dispatch on the row's data_source, as verl's default reward does."""
    if data_source in ("openai/gsm8k", "gsm8k", "arithmetic"):
        return gsm8k_score(solution_str, ground_truth)
    raise ValueError(
        f"no built-in reward for data_source={data_source!r} (built in: openai/gsm8k, arithmetic); "
        f"set custom_reward_function.path and custom_reward_function.name."
    )


def load_reward_fn(path: str | None, name: str) -> RewardFn:
    """The built-in dispatcher, or `name` from the Python file at `path`."""
    if path is None:
        return default_compute_score
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"custom_reward_function.path={path!r} does not exist.")
    spec = importlib.util.spec_from_file_location("custom_reward", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise ConfigError(
            f"custom_reward_function.name={name!r} is not a function in {path}; functions there: {found}."
        )
    return fn


class RewardError(RuntimeError):
    """A reward function failed; the message shows the sample."""


def score_responses(
    fn: RewardFn, data_sources: list[str], responses: list[str], ground_truths: list[Any], prompts: list[str]
) -> list[float]:
    """Score each response; any exception or non-number stops the run with the offending sample."""
    scores = []
    for source, response, truth, prompt in zip(data_sources, responses, ground_truths, prompts, strict=True):
        try:
            value = fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=None)
            if isinstance(value, dict):  # verl allows {"score": ..., ...}
                value = value["score"]
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}, not a finite number")
        except Exception as e:
            raise RewardError(
                f"reward function {getattr(fn, '__name__', fn)} failed: {type(e).__name__}: {e}\n"
                f"  data_source={source!r}\n  prompt={prompt!r}\n  response={response!r}\n  ground_truth={truth!r}"
            ) from e
        scores.append(value)
    return scores



def score_batch(reward_fn: RewardFn, tokenizer: Any, responses: Any, response_mask: Any,
                prompts: list[Any]) -> tuple[list[str], list[float], dict[str, list[float]]]:
    """TEMPORARY"""
    texts = tokenizer.batch_decode([r[m.bool()] for r, m in zip(responses, response_mask, strict=True)],
                                   skip_special_tokens=True)
    scores = score_responses(reward_fn, [p.data_source for p in prompts], texts, [p.ground_truth for p in prompts],
                             [p.text for p in prompts])
    return texts, scores, {}
