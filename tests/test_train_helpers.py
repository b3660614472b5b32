"""Small training helpers of train_ppo.py, without an engine."""

import math
import socket

import pytest
import torch
import torch.distributed as dist


def test_optimizer_step_skips_non_finite_gradients():
    """A NaN gradient must leave the FSDP2 parameters untouched and be counted."""
    from torch.distributed.fsdp import fully_shard

    import models

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
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
    finally:
        dist.destroy_process_group()


def test_lr_schedule_matches_the_formula():
    import models

    cfg = {"lr_warmup_steps": 4, "lr_warmup_steps_ratio": 0.0, "warmup_style": "cosine", "min_lr_ratio": 0.1}
    fn = models.lr_lambda(cfg, total_steps=14)
    assert [fn(s) for s in range(4)] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert fn(4) == pytest.approx(1.0) and fn(14) == pytest.approx(0.1)
    assert fn(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
