"""train_ppo.py's step functions on real gloo process groups, against references computed another way:

  compute_advantages   every registered estimator, when a prompt's samples sit on both ranks, equals the
                       estimator run on all samples in one process: the group ones (GRPO, RLOO, ...) see the
                       whole group, GAE's and REINFORCE++'s whitening spans every rank's share, ReMax uses
                       each sample's baseline; the same after balance_batch has dealt the rows anew
  balance_batch        each rank keeps the rows the partition plans for it, whole, with their reward extras
                       (check_generated_layout accepts the generated order and refuses the dealt one)
  dynamic_sampling     DAPO's filter keeps the first train_batch_size prompts whose groups differ, over
                       several generation batches, the same on every rank, each rank getting its slice
                       of them in prompt-major order (against a plain loop over the whole data)
  update_actor         the gradient of a mini batch does not depend on how it is cut into micro batches
                       (the loss is scaled by the mini batch's global token count), nor on whether they are
                       cut by token budget (use_dynamic_bsz) or run packed (use_remove_padding); checked
                       through the parameters after one SGD step, which Adam's scale invariance would hide
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo

import config
import ppo_core
from mesh_utils import UpdateSpec

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
            "values": torch.randn(6, 5, generator=g), "reward_baselines": torch.rand(6, generator=g),
            # the old policy's per-token statistics (optimal_token_baseline reads them)
            "old_log_probs": -torch.rand(6, 5, generator=g), "sum_pi_squared": torch.rand(6, 5, generator=g) * 0.5}


ESTIMATORS = tuple(ppo_core.ADV_ESTIMATORS)  # a new estimator is checked here with no edit


# tokens per sample (attention_mask.sum(-1)): prompt-major, rank 0 holds 27 and rank 1 6; balanced, 18 and 15
# (Karmarkar-Karp: rows 1, 2, 5 and 0, 3, 4; no split of 3 and 3 does better)
SAMPLE_TOKENS = [10, 9, 8, 2, 3, 1]


def _advantages_worker(rank: int, init_file: str, out: str) -> None:
    import train_ppo

    _init(rank, init_file)
    try:
        result: dict = {"prompt_major": {}, "balanced": {}}
        group = _group_batch(seed=0)
        group["attention_mask"] = (torch.arange(12)[None, :] < torch.tensor(SAMPLE_TOKENS)[:, None]).long()  # (6, 12)
        group["row"] = torch.arange(6)
        mine = {k: v[rank * 3:(rank + 1) * 3] for k, v in group.items()}  # split_for_training's slice
        extras = [{"row": float(i)} for i in mine["row"].tolist()]
        balanced, result["extras"], result["metrics"] = train_ppo.balance_batch(mine, extras, dist.group.WORLD)
        result["rows"] = balanced
        train_ppo.check_generated_layout(mine["prompt_index"], 2, dist.group.WORLD)  # as generated: passes
        try:  # balanced: no longer prompt-major
            train_ppo.check_generated_layout(balanced["prompt_index"], 2, dist.group.WORLD)
        except RuntimeError as e:
            result["layout_error"] = str(e)
        for estimator in ESTIMATORS:
            cfg = config.load_config(None, [f"algorithm.adv_estimator={estimator}", "algorithm.lam=0.95"])
            for layout, rows in (("prompt_major", mine), ("balanced", balanced)):
                rows = dict(rows)
                # gdpo's reward components (the reward function's extras): two per row, travelling with it
                components = _components(rows["row"]) if estimator == "gdpo" else None  # (3, 2)
                train_ppo.compute_advantages(rows, cfg.algorithm, ppo_core.FixedKLController(0.0), dist.group.WORLD, 6, 2,
                                             reward_components=components)
                result[layout][estimator] = rows["advantages"]
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def advantage_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's advantages of _group_batch's samples, prompt-major and after balance_batch, and what
    balance_batch returned."""
    tmp = tmp_path_factory.mktemp("advantages")
    run_gloo(_advantages_worker, WORLD, str(tmp / "pg"), str(tmp / "adv"), timeout_s=120)
    return [torch.load(tmp / f"adv.{r}") for r in range(WORLD)]


def _reference_advantages() -> dict[str, torch.Tensor]:
    group = _group_batch(seed=0)
    mask = group["response_mask"].float()
    return {name: ppo_core.compute_advantage(
        name, token_level_rewards=group["token_level_scores"], response_mask=mask, index=group["prompt_index"],
        values=group["values"], gamma=1.0, lam=0.95, reward_baselines=group["reward_baselines"],
        old_log_probs=group["old_log_probs"], sum_pi_squared=group["sum_pi_squared"],
        reward_components=_components(torch.arange(6)))[0]
        for name in ESTIMATORS}


def _components(row: torch.Tensor) -> torch.Tensor:
    """gdpo's reward components of rows `row` (the reward function's extras): two per row, (B, 2)."""
    return torch.stack([row.float(), (row % 2).float()], -1)


def test_advantages_use_the_whole_rollout_group(advantage_ranks):
    for estimator, want in _reference_advantages().items():
        got = torch.cat([advantage_ranks[r]["prompt_major"][estimator] for r in range(WORLD)])
        assert got[2:4].abs().sum() > 0, f"{estimator}: the split prompt's advantages are all 0"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=estimator)


def test_balance_batch_deals_the_rows_by_tokens_and_the_advantages_follow_them(advantage_ranks):
    """balance_batch: each rank ends with the rows ppo_core.balanced_partitions plans for it (tokens 18 and
    15, where the generated layout had 27 and 6), each row whole and with its own reward extras, verl's
    global_seqlen metrics the same on both ranks; every estimator, on rows in that order, gives each row
    the advantage it has in one process."""
    group = _group_batch(seed=0)
    group["attention_mask"] = (torch.arange(12)[None, :] < torch.tensor(SAMPLE_TOKENS)[:, None]).long()
    plan = ppo_core.balanced_partitions(SAMPLE_TOKENS, WORLD)
    assert plan == [[1, 2, 5], [0, 3, 4]]
    for rank, got in enumerate(advantage_ranks):
        rows = got["rows"]
        assert rows["row"].tolist() == plan[rank]
        for key, want in group.items():
            torch.testing.assert_close(rows[key], want[plan[rank]], rtol=0, atol=0, msg=key)
        assert [e["row"] for e in got["extras"]] == [float(i) for i in plan[rank]]
        assert got["layout_error"] == ("generation must give the step's samples in prompt-major order, rollout.n=2 per "
                                       "prompt; got prompt indices [7, 3, 9, 7, 3, 9]...")
        assert got["metrics"] == {"global_seqlen/min": 6, "global_seqlen/max": 27, "global_seqlen/minmax_diff": 21,
                                  "global_seqlen/balanced_min": 15, "global_seqlen/balanced_max": 18,
                                  "global_seqlen/mean": 16.5}
    for estimator, want in _reference_advantages().items():
        for rank, got in enumerate(advantage_ranks):
            torch.testing.assert_close(got["balanced"][estimator], want[plan[rank]], rtol=1e-5, atol=1e-6,
                                       msg=estimator)


# Two generation batches of 4 prompts x n=2, each sample's metric; uniform groups: 0, 2 and 10.
SAMPLING_METRIC = {0: [1, 1], 1: [0, 1], 2: [0, 0], 3: [1, 0], 10: [1, 1], 11: [0, 1], 12: [1, 0], 13: [0, 1]}


def _generation_batch(gen_batch: int, rank: int) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """Rank `rank`'s slice of generation batch `gen_batch`, prompt-major, as generate_and_score returns it."""
    prompts = [10 * gen_batch + p for p in range(4)]
    rows = [(p, s) for p in prompts for s in range(2)][rank * 4:(rank + 1) * 4]
    share = {"prompt_index": torch.tensor([p for p, _ in rows]),
             "responses": torch.tensor([[100 * p + s] for p, s in rows]),  # identifies the sample
             "scores": torch.tensor([float(SAMPLING_METRIC[p][s]) + 0.5 * s for p, s in rows])}  # all groups differ
    share["fn_scores"] = share["scores"]  # the reward function's own (no overlong penalty here)
    return share, [{"acc": float(SAMPLING_METRIC[p][s])} for p, s in rows]


def _sampling_worker(rank: int, init_file: str, out: str) -> None:
    import train_ppo

    _init(rank, init_file)
    try:
        calls = []

        def generate_and_score(gen_batch: int) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
            calls.append(gen_batch)
            return _generation_batch(gen_batch, rank)

        filter_cfg = config.load_config(None, ["algorithm.filter_groups.metric=acc"]).algorithm.filter_groups
        share, extras, metrics = train_ppo.dynamic_sampling(generate_and_score, filter_cfg, train_batch_size=4)
        limited = config.load_config(None, ["algorithm.filter_groups.metric=acc",
                                            "algorithm.filter_groups.max_num_gen_batches=1"]).algorithm.filter_groups
        with pytest.raises(RuntimeError, match="max_num_gen_batches.* gave 2 of the data.train_batch_size=4"):
            train_ppo.dynamic_sampling(generate_and_score, limited, train_batch_size=4)
        torch.save({"share": share, "extras": extras, "metrics": metrics, "calls": calls}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_dynamic_sampling_keeps_the_first_groups_that_differ(tmp_path):
    run_gloo(_sampling_worker, WORLD, str(tmp_path / "pg"), str(tmp_path / "ds"), timeout_s=120)
    # the reference: walk the prompts in generation order, keep those whose samples differ, stop at 4
    kept = [p for p in sorted(SAMPLING_METRIC) if len(set(SAMPLING_METRIC[p])) > 1][:4]
    samples = [100 * p + s for p in kept for s in range(2)]  # prompt-major
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"ds.{rank}")
        assert got["calls"] == [0, 1, 0]  # two batches, then one for the run that hits its limit
        assert got["share"]["responses"].flatten().tolist() == samples[rank * 4:(rank + 1) * 4]
        assert got["share"]["prompt_index"].tolist() == [p for p in kept for _ in range(2)][rank * 4:(rank + 1) * 4]
        assert [e["acc"] for e in got["extras"]] == [float(SAMPLING_METRIC[s // 100][s % 100])
                                                     for s in samples[rank * 4:(rank + 1) * 4]]
        assert got["metrics"] == {"train/num_gen_batches": 2, "train/uniform_group_fraction": 3 / 8}


def _update_worker(rank: int, init_file: str, model_path: str, modes: list[str], out: str) -> None:
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
        updates = {}
        for mode in modes:  # every loss aggregation in one process group (a spawn costs seconds)
            params = updates[mode] = {}
            # (samples per micro batch, token budget per micro batch, packed)
            cuts = {8: (8, None, False), 2: (2, None, False), 3: (3, None, False), "dynamic": (8, 25, False),
                    "packed_dynamic": (8, 25, True)}
            for cut, (micro, max_token_len, packed) in cuts.items():
                actor = models.load_causal_lm(model_path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                              reduce_dtype=torch.float32)
                params["initial"] = {n: p.full_tensor() for n, p in actor.named_parameters()}
                with torch.no_grad():
                    batch["old_log_probs"] = models.compute_log_probs(actor, batch, 1.0, samples).log_probs - 0.01
                cfg = config.load_config(None, ["actor_rollout_ref.actor.grad_clip=1e9",
                                                f"actor_rollout_ref.actor.loss_agg_mode={mode}"])
                spec = UpdateSpec(epochs=1, mini_batch_size=samples, micro_batch_size=micro, max_token_len=max_token_len,
                                  shuffle=False, loss_agg_mode=mode, use_remove_padding=packed, grad_clip=1e9)
                loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=1.0,
                                           loss_scale_factor=response_len)
                train_ppo.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=1.0), batch, loss, spec,
                                       torch.Generator().manual_seed(0))
                params[cut] = {n: p.full_tensor() for n, p in actor.named_parameters()}
        torch.save(updates, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cut_updates(tiny_assets, tmp_path_factory) -> dict:
    """Rank 0's weights after one update of each loss aggregation mode under each micro-batch cut."""
    tmp = tmp_path_factory.mktemp("cuts")
    run_gloo(_update_worker, WORLD, str(tmp / "pg"), str(tiny_assets["tiny-qwen2"]), list(ppo_core.LOSS_AGG_MODES),
             str(tmp / "upd"), timeout_s=600)
    return torch.load(tmp / "upd.0")


@pytest.mark.parametrize("mode", ppo_core.LOSS_AGG_MODES)
def test_micro_batch_cut_does_not_change_the_update(mode, cut_updates):
    params = cut_updates[mode]
    moved = max((params[8][n] - params["initial"][n]).abs().max().item() for n in params[8])
    assert moved > 1e-4, "the update did not move the weights: the test would pass vacuously"
    for micro in (2, 3, "dynamic", "packed_dynamic"):
        for name, whole in params[8].items():
            # float32 sums in another order: within rounding of the update's own size (token-sum's is the largest)
            torch.testing.assert_close(params[micro][name], whole, rtol=1e-5, atol=max(1e-6, 3e-5 * moved),
                                       msg=lambda m, n=name, k=micro: f"{mode}, micro {k}, {n}: {m}")



def _held_grad_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of unsharded gradients FSDP2 holds for the next reduction, bytes of sharded gradients,
    HSDP's reduce-scattered shards awaiting the replicas' all-reduce included)."""
    from torch.distributed.fsdp import FSDPModule

    unsharded = sharded = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            if group._partial_reduce_output is not None:
                sharded += group._partial_reduce_output.numel() * group._partial_reduce_output.element_size()
            for fsdp_param in group.fsdp_params:
                for grad in (getattr(fsdp_param, "unsharded_accumulated_grad", None),
                             getattr(fsdp_param, "_unsharded_param", None) is not None
                             and fsdp_param._unsharded_param.grad):
                    if isinstance(grad, torch.Tensor):
                        unsharded += grad.numel() * grad.element_size()
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    sharded += grad.to_local().numel() * grad.to_local().element_size()
    return unsharded, sharded


def _accumulation_worker(rank: int, init_file: str, model_path: str, out: str) -> None:
    """The same actor update with gradients reduce-scattered after every micro batch and accumulated
    unsharded (fsdp_config.accumulate_unsharded_grads), on an FSDP mesh of 2 and an HSDP mesh of 2 x 1;
    the gradient is read at the optimizer step, and the bytes held after the first micro batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import models
    import train_ppo

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN202 (torch's signature)
            self.grads = [p.grad.full_tensor().clone() for group in self.param_groups for p in group["params"]]
            return super().step(closure)

    _init(rank, init_file)
    try:
        g = torch.Generator().manual_seed(30 + rank)
        prompt_len, response_len, samples = 6, 7, 9
        ids = torch.randint(4, 100, (samples, prompt_len + response_len), generator=g)
        lengths = torch.randint(1, response_len + 1, (samples,), generator=g)
        response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
        attention = torch.ones_like(ids)
        attention[:, prompt_len:] = response_mask
        batch = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                 "responses": ids[:, prompt_len:], "response_mask": response_mask,
                 "advantages": torch.randn(samples, response_len, generator=g) * response_mask}
        cfg = config.load_config(None, ["actor_rollout_ref.actor.grad_clip=1e9",
                                        "actor_rollout_ref.actor.entropy_coeff=0.01"])
        loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=1.0, loss_scale_factor=response_len)
        meshes = {"fsdp": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",)),
                  "hsdp": init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("ddp", "fsdp"))}
        result = {}
        for mesh_name, mesh in meshes.items():
            for accumulate in (False, True):
                actor = models.load_causal_lm(model_path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                              reduce_dtype=torch.float32)
                with torch.no_grad():
                    batch["old_log_probs"] = models.compute_log_probs(actor, batch, 1.0, samples).log_probs - 0.01
                spec = UpdateSpec(epochs=1, mini_batch_size=samples, micro_batch_size=3, max_token_len=None,
                                  shuffle=False, loss_agg_mode="token-mean", use_remove_padding=False, grad_clip=1e9,
                                  accumulate_unsharded_grads=accumulate)
                held = []
                loss_fn = functools.partial(train_ppo._actor_micro_batch, actor, loss, spec.loss_agg_mode, False,
                                            (None, None), torch.Generator().manual_seed(0), None, None)

                def measuring_loss_fn(mb, scale, loss_fn=loss_fn, actor=actor, held=held):  # noqa: ANN001, ANN202
                    held.append(_held_grad_bytes(actor))  # after the previous micro batch's backward
                    return loss_fn(mb, scale)

                optimizer = RecordingSGD(actor.parameters(), lr=1.0)
                train_ppo.run_updates(actor, optimizer, dict(batch), measuring_loss_fn, spec,
                                      torch.Generator().manual_seed(0), None, "actor")
                full = sum(p.numel() * 4 for p in actor.parameters())
                result[mesh_name, accumulate] = {"grads": optimizer.grads, "held": held, "full_bytes": full}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_gradients_reduced_per_micro_batch_equal_the_accumulated_ones(tiny_assets, tmp_path):
    """verl's way (reduce-scatter after every micro batch, the HSDP all-reduce once at the last) gives the
    gradient of accumulating the unsharded one and reducing once, up to fp32 reassociation; between
    micro batches it holds only gradient shards, where accumulation holds the whole model's in fp32."""
    run_gloo(_accumulation_worker, WORLD, str(tmp_path / "pg"), str(tiny_assets["tiny-qwen2"]), str(tmp_path / "acc"),
             timeout_s=180)
    results = [torch.load(tmp_path / f"acc.{rank}") for rank in range(WORLD)]
    for result in results:
        reference = result["fsdp", True]["grads"]
        assert max(g.abs().max().item() for g in reference) > 1e-4, "no gradient: the test would pass vacuously"
        for case in (("fsdp", False), ("hsdp", False), ("hsdp", True)):
            for got, want in zip(result[case]["grads"], reference, strict=True):
                error = (got - want).norm().item() / max(want.norm().item(), 1e-30)
                assert error < 1e-6, (case, error)
        full = result["fsdp", True]["full_bytes"]
        for (mesh_name, accumulate), case in result.items():
            unsharded, sharded = case["held"][1]  # after the first micro batch's backward
            if accumulate:
                assert unsharded == full, (mesh_name, unsharded, full)
            else:
                assert unsharded == 0, (mesh_name, unsharded)
                assert 0 < sharded <= full // (WORLD if mesh_name == "fsdp" else 1) + 4096, (mesh_name, sharded)
    for case in results[0]:  # every rank steps with the same gradient
        for got, want in zip(results[1][case]["grads"], results[0][case]["grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _on_policy_worker(rank: int, init_file: str, model_path: str, out: str) -> None:
    """One actor update both ways, from the same weights: with the old log-probs of a separate no-grad
    forward (what train_ppo.py does off policy), and with on_policy (the update's own forward)."""
    from torch.distributed.device_mesh import init_device_mesh

    import models
    import train_ppo

    _init(rank, init_file)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        g = torch.Generator().manual_seed(20 + rank)
        prompt_len, response_len, samples = 6, 7, 8
        ids = torch.randint(4, 100, (samples, prompt_len + response_len), generator=g)
        lengths = torch.randint(1, response_len + 1, (samples,), generator=g)
        response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()  # (8, 7) ragged
        attention = torch.ones_like(ids)
        attention[:, prompt_len:] = response_mask
        attention[:3, :2] = 0  # left-padded prompts
        batch = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                 "responses": ids[:, prompt_len:], "response_mask": response_mask,
                 "advantages": torch.randn(samples, response_len, generator=g) * response_mask}
        cfg = config.load_config(None, ["actor_rollout_ref.actor.grad_clip=1e9", "actor_rollout_ref.actor.shuffle=true",
                                        "actor_rollout_ref.actor.entropy_coeff=0.01"])
        temperature, truncation = 0.7, (20, 0.9)
        loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=temperature,
                                   loss_scale_factor=response_len, truncation=truncation)
        result: dict = {"response_mask": response_mask}
        # (samples per micro batch, token budget, packed): shuffled rows in micro batches of 3, and packed ones
        for case, (micro, max_token_len, packed) in {"padded": (3, None, False), "packed": (8, 40, True)}.items():
            for mode in ("separate", "on_policy"):
                actor = models.load_causal_lm(model_path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                              reduce_dtype=torch.float32)
                initial = {n: p.full_tensor() for n, p in actor.named_parameters()}
                mine, forward = dict(batch), None
                if mode == "separate":
                    actor.eval()
                    with torch.no_grad():
                        forward = models.compute_log_probs(
                            actor, batch, temperature, 4, calc_entropy=True, truncation=truncation,
                            max_token_len=max_token_len and 2 * max_token_len, use_remove_padding=packed)
                        mine["old_log_probs"], entropy, cut = forward.log_probs, forward.entropy, forward.truncated
                    seen = {"old_log_probs": mine["old_log_probs"], "entropy": entropy, "sampling_log_probs": cut}
                spec = UpdateSpec(epochs=1, mini_batch_size=samples, micro_batch_size=micro,
                                  max_token_len=max_token_len, shuffle=True, loss_agg_mode="token-mean",
                                  use_remove_padding=packed, grad_clip=1e9)
                metrics, forward = train_ppo.update_actor(
                    actor, torch.optim.SGD(actor.parameters(), lr=1.0), mine, loss, spec,
                    torch.Generator().manual_seed(0), own_old_log_probs=mode == "on_policy")
                result[case, mode] = {"params": {n: p.full_tensor() for n, p in actor.named_parameters()},
                                      "initial": initial, "metrics": metrics,
                                      "forward": vars(forward) if forward is not None else seen}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_on_policy_update_equals_the_update_after_a_separate_forward(sft_model, tmp_path):
    """The on-policy shortcut (old log-probs from the update's own forward) changes nothing: the same
    weights after the step, the same losses, and the old log-probs, entropies and cut log-probs it hands
    back (for the sync check and actor/entropy) equal the separate forward's, in batch order."""
    run_gloo(_on_policy_worker, WORLD, str(tmp_path / "pg"), str(sft_model), str(tmp_path / "op"), timeout_s=180)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"op.{rank}")
        for case in ("padded", "packed"):
            want, got = result[case, "separate"], result[case, "on_policy"]
            moved = max((want["params"][n] - want["initial"][n]).abs().max().item() for n in want["params"])
            assert moved > 1e-4, "the update did not move the weights: the test would pass vacuously"
            for name, value in want["params"].items():
                # SGD with lr 1 moves weights by up to ~5: float noise in the forwards shows at ~1e-5
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
            assert set(got["metrics"]) == set(want["metrics"])
            for key, value in want["metrics"].items():
                assert got["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (case, key)
            assert want["metrics"]["actor/grad_norm"] > 0 and want["metrics"]["actor/pg_loss"] != 0
            # past a response's end packed forwards give 0, padded ones the model's; tokens outside the cut -inf
            mask = result["response_mask"].bool()
            for key in ("old_log_probs", "entropy", "sampling_log_probs"):
                torch.testing.assert_close(got["forward"][key][mask], want["forward"][key][mask], rtol=1e-5,
                                           atol=1e-5, msg=f"{case} {key}")


def test_old_log_probs_come_from_the_update_only_where_it_is_exact():
    import train_ppo

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def why(*overrides: str, samples: int = 64, mini: int = 64, actor: torch.nn.Module = model) -> str | None:
        cfg = config.load_config(None, list(overrides))
        spec = UpdateSpec(epochs=cfg.actor_rollout_ref.actor.ppo_epochs, mini_batch_size=mini, micro_batch_size=mini,
                          max_token_len=None, shuffle=False, loss_agg_mode="token-mean", use_remove_padding=False,
                          grad_clip=1.0)
        source, reason = train_ppo.old_log_prob_source(actor, cfg.algorithm, spec, samples)
        assert (source == "update") == (reason.startswith("one epoch of one mini batch")), (source, reason)
        return None if source == "update" else reason

    assert why() is None
    assert "ppo_epochs=2" in why("actor_rollout_ref.actor.ppo_epochs=2")
    assert "mini batches of 32" in why(mini=32)
    assert "use_kl_in_reward" in why("algorithm.use_kl_in_reward=true")
    assert "rollout_is" in why("algorithm.rollout_correction.rollout_is=token")
    assert "rollout_rs" in why("algorithm.rollout_correction.rollout_rs=token_k1",
                               "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0")
    assert "bypass_mode" in why("algorithm.rollout_correction.bypass_mode=true")
    assert "dropout" in why(actor=torch.nn.Sequential(torch.nn.Dropout(0.1)))
    # the critic (GAE), the KL loss and dynamic sampling need no old log-probs before the update
    assert why("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
               "algorithm.filter_groups.enable=true") is None


def test_the_score_sits_on_the_last_sampled_token():
    """Multi-turn rows have holes in the loss mask (tool replies): the score goes to the last token the
    policy sampled, not to position mask.sum() - 1 (inside the reply here); an empty row keeps it at 0."""
    import train_ppo

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8])
    placed = train_ppo.place_scores(torch.tensor([2.0, 3.0, 5.0]), mask)
    assert placed.nonzero().tolist() == [[0, 5], [1, 2], [2, 0]]
    assert placed.sum(-1).tolist() == [2.0, 3.0, 5.0]
