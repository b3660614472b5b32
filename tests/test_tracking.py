"""tracking.py: one metrics line per step, whatever restarts and merges happen."""

import json

import pytest

import tracking
from tracking import Tracker, read_metrics, summary, truncate_metrics


def tracker(out, total=5) -> Tracker:
    return Tracker(out, ["console"], "p", "e", {}, total_steps=total)


def test_one_line_per_step_across_restarts_and_merges(tmp_path, capsys):
    first = tracker(tmp_path)
    first.log(0, {"val/score": 0.25})
    for step in (1, 2, 3):
        first.log(step, {"critic/score/mean": step / 10})
    first.close()
    # a restart without a checkpoint: the trainer truncates to step 0, then logs 0, 1, ... again
    truncate_metrics(tmp_path / "metrics.jsonl", 0)
    second = tracker(tmp_path)
    second.log(0, {"val/score": 0.5, "val/num_samples": 8})  # merged into the surviving step-0 line
    second.log(1, {"critic/score/mean": 0.7})
    second.log(1, {"val/score": 0.75})  # validation after the step: same line
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0] == {"step": 0, "val/score": 0.5, "val/num_samples": 8}
    assert rows[1] == {"step": 1, "critic/score/mean": 0.7, "val/score": 0.75}
    assert "step 1/5 | score 0.700" in capsys.readouterr().out
    assert "val/score: 0.500 (step 0) -> 0.750 (step 1)" in summary(tmp_path / "metrics.jsonl")


def test_resume_truncates_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(7)))
    truncate_metrics(path, 3)
    t = tracker(tmp_path)
    t.log(3, {"val/score": 1.0})  # val_before_train on resume: the checkpoint's own step
    t.log(4, {"x": 40})
    assert read_metrics(path) == [{"step": 0, "x": 0}, {"step": 1, "x": 1}, {"step": 2, "x": 2},
                                  {"step": 3, "x": 3, "val/score": 1.0}, {"step": 4, "x": 40}]


def _mean_worker(rank: int, init_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from tracking import batch_metrics, mean_over_ranks, reduce_metrics

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # rank 0 has an "acc" for 3 samples, rank 1 for 1 and a key of its own
        values = {"acc": [1.0, 0.0, 1.0]} if rank == 0 else {"acc": [0.0], "only_here": [4.0, 6.0]}
        torch.save(mean_over_ranks(values, "reward_extra/", torch.device("cpu")), f"{out}.{rank}")
        # rollout correction rejected every token of rank 1 (it crashed on an empty max once)
        batch = _batch(seed=rank, keep=rank == 0)
        metrics = reduce_metrics(batch_metrics(batch, max_prompt_length=2, dp_group=dist.group.WORLD),
                                 torch.device("cpu"))
        torch.save(metrics, f"{out}.metrics.{rank}")
    finally:
        dist.destroy_process_group()


def _batch(seed: int, keep: bool) -> dict:
    """3 samples of 2 prompt + 4 response tokens, values and returns; keep=False: every token rejected."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]) * int(keep)
    return {"response_mask": mask, "attention_mask": torch.ones(3, 6, dtype=torch.long),
            "responses": torch.zeros(3, 4, dtype=torch.long), "token_level_scores": torch.rand(3, 4, generator=g),
            "token_level_rewards": torch.rand(3, 4, generator=g), "advantages": torch.randn(3, 4, generator=g),
            "values": torch.randn(3, 4, generator=g), "returns": torch.randn(3, 4, generator=g)}


def test_means_over_ranks_weigh_samples_and_tokens_and_survive_an_empty_rank(tmp_path):
    import torch
    from conftest import run_gloo

    run_gloo(_mean_worker, 2, str(tmp_path / "pg"), str(tmp_path / "mean"))
    for rank in range(2):
        assert torch.load(tmp_path / f"mean.{rank}") == {"reward_extra/acc": 0.5, "reward_extra/only_here": 5.0}
    # token statistics over the valid tokens of both ranks (only rank 0 has any), as verl takes them
    kept = _batch(seed=0, keep=True)
    valid = kept["response_mask"].bool()
    both = [torch.load(tmp_path / f"mean.metrics.{rank}") for rank in range(2)]
    assert both[0] == both[1]
    for key in ("advantages", "values", "returns"):
        tokens = kept[key][valid].double().tolist()  # 9 tokens
        assert both[0][f"critic/{key}/mean"] == pytest.approx(sum(tokens) / len(tokens), rel=1e-12)
        assert both[0][f"critic/{key}/max"] == pytest.approx(max(tokens))
        assert both[0][f"critic/{key}/min"] == pytest.approx(min(tokens))


def test_library_lines_reach_the_log_file_once(tmp_path):
    import logging

    root, vllm_logger = logging.getLogger(), logging.getLogger("vllm")
    saved = (list(root.handlers), root.level, list(vllm_logger.handlers))
    try:
        tracking.route_library_logs(tmp_path / "rank0.log", rank=0)
        vllm_logger.info("engine started")
        logging.getLogger("datasets.builder").warning("loaded")
        for handler in root.handlers:
            handler.flush()
        lines = (tmp_path / "rank0.log").read_text().splitlines()
        assert sum("engine started" in line for line in lines) == 1, lines
        assert sum("loaded" in line for line in lines) == 1, lines
        # a second run in the same process: its lines go to its own file, not to the first one too
        tracking.route_library_logs(tmp_path / "second" / "rank0.log", rank=0)
        vllm_logger.info("second engine")
        for handler in root.handlers:
            handler.flush()
        assert "second engine" not in (tmp_path / "rank0.log").read_text()
        assert (tmp_path / "second" / "rank0.log").read_text().count("second engine") == 1
    finally:
        for logger in (root, vllm_logger):
            for handler in list(logger.handlers):
                if isinstance(handler, logging.FileHandler):
                    logger.removeHandler(handler)
                    handler.close()
        root.handlers[:], vllm_logger.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
