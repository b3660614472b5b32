"""A dense reward for the VLM end-to-end test: the share of the response's characters that are digits, so that
even an untrained model's samples differ within a group and GRPO moves every weight, the vision tower's too."""

from typing import Any


def digit_share(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
