"""A reward function for the tests' validation runs: the demo's `#### N` rule, and the answer it read as
`pred` (verl's key for maj@k); "" when there is none."""

from typing import Any

from rewards import gsm8k_answer, gsm8k_score


def score_with_pred(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    return {"score": gsm8k_score(solution_str, ground_truth), "pred": gsm8k_answer(solution_str) or ""}
