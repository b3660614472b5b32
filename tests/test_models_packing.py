"""Packed forwards (use_remove_padding) and token-budget micro batches (use_dynamic_bsz) of
models.compute_log_probs / compute_values on 2 real gloo ranks with FSDP2, against the padded
forward in fixed micro batches of the same sharded model: log-probs, entropies and values on every
real response token within 1e-5 in float32 (and sum_v pi(v)^2, also against one plain forward), for an untied Qwen2 and a tied Llama. The two ranks hold
different lengths, so one of them needs more token-budget micro batches on its own than the other,
and the count they agree on is checked."""

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo

import ppo_core

WORLD = 2
MODELS = ("tiny-qwen2", "tiny-llama-tied")
PROMPT, RESPONSE = 6, 7


def _batch(rank: int, vocab: int) -> dict[str, torch.Tensor]:
    """6 samples with ragged left-padded prompts and ragged right-padded responses, different per rank."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, vocab, (6, PROMPT + RESPONSE), generator=g)
    prompt_lens = torch.tensor([6, 2, 4, 1, 5, 3]) if rank == 0 else torch.tensor([1, 1, 2, 3, 2, 1])
    response_lens = torch.tensor([7, 1, 3, 5, 2, 7]) if rank == 0 else torch.tensor([1, 2, 7, 1, 3, 2])
    mask = torch.cat([torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None],
                      torch.arange(RESPONSE)[None] < response_lens[:, None]], dim=1).long()  # (6, P+R)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:]}


def _worker(rank: int, paths: dict[str, str], init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import models

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        kwargs = dict(device=torch.device("cpu"), param_dtype=torch.float32, reduce_dtype=torch.float32)
        budget = 20  # rank 0 holds 46 tokens (3 micro batches alone), rank 1 holds 26 (2 alone)
        result: dict = {"num_micro_batches": len(models.token_budget_micro_batches(
            _batch(rank, 100)["attention_mask"], budget))}
        for name, path in paths.items():
            actor = models.load_causal_lm(path, mesh, **kwargs).eval()
            critic = models.load_value_model(path, mesh, **kwargs).eval()
            with torch.no_grad():  # the value head starts at zero: values would be 0 on both paths
                g = torch.Generator().manual_seed(100 + rank)
                for p in critic.parameters():
                    p.to_local().add_(torch.randn(p.to_local().shape, generator=g) * 0.02)
            batch = _batch(rank, actor.config.vocab_size)
            runs = {"padded": dict(micro_batch_size=2), "packed": dict(micro_batch_size=4, use_remove_padding=True),
                    "packed_dynamic": dict(micro_batch_size=1, use_remove_padding=True, max_token_len=budget),
                    "padded_dynamic": dict(micro_batch_size=1, max_token_len=budget)}
            result[name] = {}
            with torch.no_grad():
                for run, options in runs.items():
                    forward = models.compute_log_probs(actor, batch, 0.7, calc_entropy=True, calc_sum_pi_squared=True,
                                                       **options)
                    log_probs, entropy, sum_sq = forward.log_probs, forward.entropy, forward.sum_pi_squared
                    values = models.compute_values(critic, batch, **options)
                    result[name][run] = {"log_probs": log_probs, "entropy": entropy, "values": values,
                                         "sum_pi_squared": sum_sq}
                # sum_v pi(v)^2 straight from one whole forward: softmax, square, sum
                logits = actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]).logits[:, PROMPT - 1:-1] / 0.7  # (6, R, V)
                result[name]["direct_sum_pi_squared"] = torch.softmax(logits.double(), -1).pow(2).sum(-1)
        result["mask"] = _batch(rank, 100)["attention_mask"][:, PROMPT:].bool()
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tiny_assets, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("packing")
    paths = {name: str(tiny_assets[name]) for name in MODELS}
    run_gloo(_worker, WORLD, paths, str(tmp / "pg"), str(tmp / "result"), timeout_s=300)
    return [torch.load(tmp / f"result.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("run", ["packed", "packed_dynamic", "padded_dynamic"])
def test_packed_and_dynamic_equal_padded(ranks, name, run):
    for rank, result in enumerate(ranks):
        mask = result["mask"]  # (6, R) real response tokens
        want, got = result[name]["padded"], result[name][run]
        for key in ("log_probs", "entropy", "values", "sum_pi_squared"):
            assert want[key][mask].abs().max() > 1e-3, f"{key} is ~0: the comparison would be vacuous"
            torch.testing.assert_close(got[key][mask], want[key][mask], rtol=0, atol=1e-5,
                                       msg=lambda m, k=key, r=rank: f"{name} {run} rank {r} {k}: {m}")
            if run.startswith("packed"):  # nothing is computed past a response's end
                assert not got[key][~mask].any(), key


@pytest.mark.parametrize("name", MODELS)
def test_sum_pi_squared_is_that_of_the_softmax(ranks, name):
    for result in ranks:
        mask = result["mask"]  # (6, R)
        got, want = result[name]["padded"]["sum_pi_squared"][mask], result[name]["direct_sum_pi_squared"][mask]
        assert (want > 0).all() and (want < 1).all()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_ranks_agree_on_the_number_of_micro_batches(ranks):
    # alone, rank 0 needs ceil(46 / 20) = 3 micro batches and rank 1 ceil(26 / 20) = 2: FSDP's
    # all-gathers in each forward would deadlock unless both run the larger count
    assert [r["num_micro_batches"] for r in ranks] == [3, 3]


def test_token_budget_partitions():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        lens = torch.randint(1, 30, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        budget = max(lens) + int(torch.randint(0, 60, (1,), generator=g))
        min_parts = int(torch.randint(1, 5, (1,), generator=g))
        parts = ppo_core.token_budget_partitions(lens, budget, min_parts)
        assert sorted(i for p in parts for i in p) == list(range(len(lens))), trial  # each sample once
        assert all(p == sorted(p) and p for p in parts), trial  # batch order, none empty
        loads = [sum(lens[i] for i in p) for p in parts]
        assert max(loads) <= budget, (trial, loads, budget)
        assert len(parts) >= -(-sum(lens) // budget), trial
        assert len(parts) >= min(len(lens), min_parts), trial
    assert ppo_core.token_budget_partitions([9, 1, 8, 2], 10) == [[0, 1], [2, 3]]  # 10 and 10 tokens
    with pytest.raises(ValueError, match="more than the micro batch budget"):
        ppo_core.token_budget_partitions([11], 10)
