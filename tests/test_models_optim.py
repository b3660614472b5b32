"""Small training helpers of train_ppo.py, without an engine."""

import math

import pytest
import torch
from conftest import one_rank_process_group


def test_optimizer_step_skips_non_finite_gradients():
    """A NaN gradient must leave the FSDP2 parameters untouched and be counted."""
    from torch.distributed.fsdp import fully_shard

    import models

    with one_rank_process_group():
        model = fully_shard(torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.ones(1, 4)).sum().mul(float("nan")).backward()
        metrics = {}
        assert models.optimizer_step(model, opt, 1.0, "actor", metrics) is False
        assert metrics["actor/skipped_steps"] == 1 and math.isnan(metrics["actor/grad_norm"])
        assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters(), strict=True))
        model(torch.ones(1, 4)).sum().backward()
        assert models.optimizer_step(model, opt, 1.0, "actor", metrics) is True
        assert not all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters(), strict=True))


def verl_factor(step: int, warmup: int, total: int, kind: str, floor: float) -> float:
    """verl 0.9.1's schedule (torch_functional.get_{constant,cosine}_schedule_with_warmup), written out."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return max(floor, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("kind_key", ["lr_scheduler_type", "warmup_style"])
def test_lr_schedule_is_verls(kind_key):
    import models

    base = {"lr_warmup_steps": 4, "lr_warmup_steps_ratio": 0.0, "lr_scheduler_type": "constant",
            "warmup_style": None, "min_lr_ratio": 0.1, "total_training_steps": -1}
    cfg = {**base, kind_key: "cosine"}
    fn = models.lr_lambda(cfg, total_steps=14)
    assert [fn(s) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]  # verl's warmup starts from 0
    for step in range(20):  # past the end, too (verl does not clamp the cosine there)
        assert fn(step) == pytest.approx(verl_factor(step, 4, 14, "cosine", 0.1), abs=1e-12)
    assert fn(14) == pytest.approx(0.1)
    # warmup from the ratio when lr_warmup_steps <= 0; optim.total_training_steps sets the length
    ratio = models.lr_lambda({**cfg, "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.25,
                              "total_training_steps": 40}, total_steps=14)
    assert [ratio(s) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]
    assert ratio(40) == pytest.approx(0.1)
    constant = models.lr_lambda({**base, "lr_warmup_steps": 0}, total_steps=14)
    assert {constant(s) for s in range(20)} == {1.0}
