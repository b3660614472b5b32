"""A reward function that raises on rank 1 only (tests/short_runs.py's reward_raises case)."""

import os


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    return {"score": 1.0} if os.environ["RANK"] == "0" else 1 / 0
