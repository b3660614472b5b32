"""train_ppo.py's step functions on real gloo process groups, against references computed another way:

  compute_advantages   GRPO / RLOO baselines over the whole rollout group, when a prompt's samples
                       sit on both TP ranks of the group, equal the estimator run on all samples in one
                       process; GAE whitening spans every rank's share
  update_actor         the gradient of a mini batch does not depend on how it is cut into micro batches
                       (the loss is scaled by the mini batch's global token count), nor on whether they are
                       cut by token budget (use_dynamic_bsz) or run packed (use_remove_padding); checked
                       through the parameters after one SGD step, which Adam's scale invariance would hide
"""

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo

import config
import ppo_core

WORLD = 2


def _init(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)


def _group_batch(seed: int) -> dict[str, torch.Tensor]:
    """One rollout group's 6 samples (3 prompts x n=2, prompt-major), as generate() returns them."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None, :] < torch.randint(1, 6, (6, 1), generator=g)).long()  # (6, 5) ragged
    scores = torch.randint(0, 2, (6,), generator=g).float()
    scores[4] = 1 - scores[5]  # prompt 2's two samples disagree: a non-zero advantage
    scores[2], scores[3] = 0.0, 1.0  # prompt 1 is split over the two TP ranks, and not uniform
    token_scores = torch.zeros(6, 5)
    token_scores[torch.arange(6), mask.sum(-1) - 1] = scores
    return {"response_mask": mask, "token_level_scores": token_scores, "prompt_index": torch.tensor([7, 7, 3, 3, 9, 9]),
            "values": torch.randn(6, 5, generator=g)}


def _advantages_worker(rank: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import train_ppo

    _init(rank, init_file)
    try:
        rollout_mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "infer_tp"))  # one TP=2 group
        result = {}
        for estimator in ("grpo", "rloo", "gae"):
            cfg = config.load_config(None, [f"algorithm.adv_estimator={estimator}", "algorithm.lam=0.95"])
            group = _group_batch(seed=0)
            mine = {k: v[rank * 3:(rank + 1) * 3] for k, v in group.items()}  # split_for_training's slice
            train_ppo.compute_advantages(mine, cfg.algorithm, ppo_core.FixedKLController(0.0), rollout_mesh, 6, 2)
            result[estimator] = mine["advantages"]
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_advantages_use_the_whole_rollout_group(tmp_path):
    run_gloo(_advantages_worker, WORLD, str(tmp_path / "pg"), str(tmp_path / "adv"), timeout_s=120)
    ranks = [torch.load(tmp_path / f"adv.{r}") for r in range(WORLD)]
    group = _group_batch(seed=0)
    mask = group["response_mask"].float()
    reference = {
        "grpo": ppo_core.compute_grpo_outcome_advantage(group["token_level_scores"], mask, group["prompt_index"])[0],
        "rloo": ppo_core.compute_rloo_outcome_advantage(group["token_level_scores"], mask, group["prompt_index"])[0],
        "gae": ppo_core.compute_gae_advantage_return(group["token_level_scores"], group["values"], mask, 1.0, 0.95)[0],
    }
    for estimator, want in reference.items():
        got = torch.cat([ranks[r][estimator] for r in range(WORLD)])
        assert got[2:4].abs().sum() > 0 or estimator == "gae", "the split prompt's advantages are all 0"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=estimator)


def _update_worker(rank: int, init_file: str, model_path: str, mode: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import models
    import train_ppo

    _init(rank, init_file)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own samples
        prompt_len, response_len, samples = 6, 7, 8
        ids = torch.randint(4, 100, (samples, prompt_len + response_len), generator=g)
        attention = torch.ones_like(ids)
        lengths = torch.tensor([7, 1, 3, 7, 2, 6, 5, 1]) if rank == 0 else torch.tensor([1, 1, 2, 7, 7, 7, 4, 3])
        response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()  # ragged: counts matter
        attention[:, prompt_len:] = response_mask
        if rank == 1:  # left-padded prompts: fewer tokens, so fewer token-budget micro batches alone
            attention[:4, :3] = 0
        batch = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                 "responses": ids[:, prompt_len:], "response_mask": response_mask,
                 "advantages": torch.randn(samples, response_len, generator=g) * response_mask}
        params = {}
        # (samples per micro batch, token budget per micro batch, packed)
        cuts = {8: (8, None, False), 2: (2, None, False), 3: (3, None, False), "dynamic": (8, 25, False),
                "packed_dynamic": (8, 25, True)}
        for cut, (micro, max_token_len, packed) in cuts.items():
            actor = models.load_causal_lm(model_path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                          reduce_dtype=torch.float32)
            params["initial"] = {n: p.full_tensor() for n, p in actor.named_parameters()}
            with torch.no_grad():
                batch["old_log_probs"] = models.compute_log_probs(actor, batch, 1.0, samples)[0] - 0.01
            cfg = config.load_config(None, ["actor_rollout_ref.actor.grad_clip=1e9",
                                            f"actor_rollout_ref.actor.loss_agg_mode={mode}"]).actor_rollout_ref.actor
            train_ppo.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=1.0), batch, cfg, temperature=1.0,
                                   mini_batch_size=samples, micro_batch_size=micro, dp_size=WORLD,
                                   loss_scale_factor=response_len, generator=torch.Generator().manual_seed(0),
                                   max_token_len=max_token_len, use_remove_padding=packed)
            params[cut] = {n: p.full_tensor() for n, p in actor.named_parameters()}
        torch.save(params, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", config.LOSS_AGG_MODES)
def test_micro_batch_cut_does_not_change_the_update(mode, tiny_assets, tmp_path):
    run_gloo(_update_worker, WORLD, str(tmp_path / "pg"), str(tiny_assets["tiny-qwen2"]), mode, str(tmp_path / "upd"),
             timeout_s=180)
    params = torch.load(tmp_path / "upd.0")
    moved = max((params[8][n] - params["initial"][n]).abs().max().item() for n in params[8])
    assert moved > 1e-4, "the update did not move the weights: the test would pass vacuously"
    for micro in (2, 3, "dynamic", "packed_dynamic"):
        for name, whole in params[8].items():
            torch.testing.assert_close(params[micro][name], whole, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, k=micro: f"{mode}, micro {k}, {n}: {m}")

