"""Ulysses sequence parallelism on 4 real gloo ranks, against the plain model (sp=1, "sdpa", same
checkpoint) on the same rows in the same process: log-probs, entropies and critic values, and the
gradients of a weighted sum of them (averaged over the sp group, as FSDP averages), for sp=2 (2 dp groups with different
rows) on the GQA Qwen2 and sp=4 on the tied Llama (both have 2 KV heads: at sp=4 they are replicated),
for a left/right-padded batch whose length no sp divides, an unpadded one (plain causal mask) and a
packed row of three sequences. (test_ulysses_training.py runs a whole training update at sp=2.)"""

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import ppo_core as core
import ulysses

WORLD = 4
SP_SIZES = (2, 4)
MODELS = ("tiny-qwen2", "tiny-llama-tied")
# each model at one sp: sp=4 > 2 KV heads is the replication case; the suite's time is short
CASES = ((2, "tiny-qwen2"), (4, "tiny-llama-tied"))
TEMPERATURE = 0.7
TOLERANCE = 1e-5  # float32: the split only reorders sums inside attention
GRAD_RTOL = 1e-4  # relative to the largest entry of each gradient


def _padded_batch(vocab: int, seed: int, length: int, pad: bool) -> dict[str, torch.Tensor]:
    """3 rows of prompts then 5 responses; with pad, row 0's prompt is left-padded and row 1's
    response right-padded, as rollouts are."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, length), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :3] = 0
        mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -5:]}


def _packed_batch(vocab: int, seed: int, lengths: tuple[int, ...] = (6, 5, 4)) -> dict[str, torch.Tensor]:
    """One row of sequences back to back, no mask; positions restart at 0 for each sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "attention_mask": None, "position_ids": positions}


def _plain_token_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the unsplit model on the whole rows, (B, T) log-prob of the next token and entropy."""
    import ppo_core as core

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits / TEMPERATURE
    labels = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
    return core.logprobs_from_logits(logits, labels), core.entropy_from_logits(logits)


def _plain_truncated_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor], top_k: int,
                               top_p: float) -> torch.Tensor:
    """The unsplit model's next-token log-probs under the top-k / top-p cut, (B, T)."""
    import ppo_core as core

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits / TEMPERATURE
    return core.truncated_log_probs(logits, torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1)), top_k, top_p)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item()


def _grad_diffs(model: torch.nn.Module, reference: torch.nn.Module, group: dist.ProcessGroup) -> dict[str, float]:
    """Per parameter: max |mean over the sp group of the grads - reference grad| / max |reference grad|
    (the mean is what FSDP's gradient average over ranks that include the sp group computes)."""
    diffs = {}
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert ref.grad is not None and ref.grad.abs().max() > 0, f"{name}: the loss does not reach it"
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)
        diffs[name] = ((grad - ref.grad).abs().max() / ref.grad.abs().max()).item()
    return diffs


def _check_one(name: str, paths: dict[str, str], critic_paths: dict[str, str], group: dist.ProcessGroup,
               seed: int) -> dict[str, object]:
    import models

    attention = ulysses.register_ulysses_attention()
    kwargs = dict(dtype=torch.float32)
    actor = AutoModelForCausalLM.from_pretrained(paths[name], attn_implementation=attention, **kwargs)
    reference = AutoModelForCausalLM.from_pretrained(paths[name], attn_implementation="sdpa", **kwargs)
    critic = AutoModelForTokenClassification.from_pretrained(critic_paths[name], attn_implementation=attention,
                                                             **kwargs)
    critic_ref = AutoModelForTokenClassification.from_pretrained(critic_paths[name], attn_implementation="sdpa",
                                                                 **kwargs)
    vocab = actor.config.vocab_size
    batches = {"padded_13": _padded_batch(vocab, seed, 13, pad=True),
               "unpadded_16": _padded_batch(vocab, seed + 1, 16, pad=False),
               "packed_15": _packed_batch(vocab, seed + 2)}
    result: dict[str, object] = {}
    with torch.no_grad():
        for case, batch in batches.items():
            log_probs, entropy = ulysses.sequence_parallel_log_probs(actor, batch, TEMPERATURE, group,
                                                                     calc_entropy=True)
            want_lp, want_entropy = _plain_token_log_probs(reference, batch)
            values = ulysses.sequence_parallel_values(critic, batch, group)
            want_values = critic_ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     position_ids=batch["position_ids"], use_cache=False).logits[..., 0]
            # the last position predicts past the end: no label, not compared
            result[f"{case}/log_probs"] = _max_diff(log_probs[:, :-1], want_lp[:, :-1])
            result[f"{case}/entropy"] = _max_diff(entropy, want_entropy)
            result[f"{case}/values"] = _max_diff(values, want_values)
            # the engine's top-k / top-p cut of the same logits (rollout correction); -inf outside the cut
            logits, labels, gather = ulysses.sequence_parallel_logits(actor, batch, TEMPERATURE, group)
            cut = gather(core.truncated_log_probs(logits, labels, 20, 0.8))  # (B, T)
            want_cut = _plain_truncated_log_probs(reference, batch, 20, 0.8)
            result[f"{case}/truncated_log_probs"] = _max_diff(cut[:, :-1].clamp_min(-1e4),
                                                              want_cut[:, :-1].clamp_min(-1e4))
        # the training helpers' own response slices, on the padded rows
        batch = batches["padded_13"]
        log_probs, _ = ulysses.sequence_parallel_log_probs(actor, batch, TEMPERATURE, group)
        want_lp = models.compute_log_probs(reference, batch, TEMPERATURE, micro_batch_size=3).log_probs
        result["padded_13/response_log_probs"] = _max_diff(log_probs[:, -6:-1], want_lp)
        values = ulysses.sequence_parallel_values(critic, batch, group)
        result["padded_13/response_values"] = _max_diff(values[:, -6:-1], models.compute_values(critic_ref, batch, 3))
        # without sp_group the registered attention is plain sdpa
        plain = actor(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        want = reference(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        result["no_sp_group_is_sdpa"] = torch.equal(plain, want)

    # A training step's gradients: backward of a weighted sum over the response tokens.
    weights = torch.linspace(-0.5, 1.0, 5)  # (R,) not symmetric in the positions, sum not 0 (the bias)
    for case in ("padded_13", "packed_15"):
        batch = batches[case]
        for model in (actor, reference, critic, critic_ref):
            model.zero_grad(set_to_none=True)
        log_probs, _ = ulysses.sequence_parallel_log_probs(actor, batch, TEMPERATURE, group)
        (log_probs[:, -6:-1] * weights).sum().backward()
        want_lp, _ = _plain_token_log_probs(reference, batch)
        (want_lp[:, -6:-1] * weights).sum().backward()
        result[f"{case}/actor_grad"] = _grad_diffs(actor, reference, group)
        values = ulysses.sequence_parallel_values(critic, batch, group)
        (values[:, -6:-1] * weights).sum().backward()
        want_values = critic_ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 position_ids=batch["position_ids"], use_cache=False).logits[..., 0]
        (want_values[:, -6:-1] * weights).sum().backward()
        result[f"{case}/critic_grad"] = _grad_diffs(critic, critic_ref, group)

    # Ranks of a group whose losses differ (each keeps its own rows, say): the mean gradient over the
    # group is the gradient of the mean loss, here (1 + sp_rank) times the weighted sum.
    batch = batches["padded_13"]
    actor.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    log_probs, _ = ulysses.sequence_parallel_log_probs(actor, batch, TEMPERATURE, group)
    ((1 + dist.get_rank(group)) * (log_probs[:, -6:-1] * weights).sum()).backward()
    want_lp, _ = _plain_token_log_probs(reference, batch)
    mean_factor = (dist.get_world_size(group) + 1) / 2
    (mean_factor * (want_lp[:, -6:-1] * weights).sum()).backward()
    result["padded_13/actor_grad_rank_dependent_loss"] = _grad_diffs(actor, reference, group)
    return result


def _worker(rank: int, paths: dict[str, str], critic_paths: dict[str, str], init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for sp in SP_SIZES:
            # mesh_utils.build_meshes' layout: ('dp','sp'), sp consecutive ranks a group
            mesh = init_device_mesh("cpu", (WORLD // sp, sp), mesh_dim_names=("dp", "sp"))
            dp_rank = mesh.get_local_rank("dp")
            for name in [name for case_sp, name in CASES if case_sp == sp]:
                # rows differ between dp groups (and agree inside one), as the batch split makes them
                results[(sp, name)] = _check_one(name, paths, critic_paths, mesh.get_group("sp"), seed=10 * dp_rank)
            # each rank's own rows -> the sp group's rows, in sp-rank order, on every rank of the group
            own = {"ids": torch.full((2, 3), rank), "mask": torch.full((2,), rank % 2, dtype=torch.bool)}
            gathered = ulysses.gather_rows(own, mesh.get_group("sp"))
            first = dp_rank * sp
            results[(sp, "gather_rows")] = (
                torch.equal(gathered["ids"], torch.arange(first, first + sp).repeat_interleave(2)[:, None].expand(-1, 3))
                and torch.equal(gathered["mask"], (torch.arange(first, first + sp) % 2).bool().repeat_interleave(2)))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def critic_paths(tiny_assets, tmp_path_factory) -> dict[str, str]:
    """Value models with a random (not zero) head, so the values and their gradients say something."""
    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        critic = AutoModelForTokenClassification.from_pretrained(tiny_assets[name], num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            critic.score.weight.normal_(std=0.5)
        path = tmp_path_factory.mktemp("critic") / name
        critic.save_pretrained(path)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_assets, critic_paths, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ulysses")
    paths = {name: str(tiny_assets[name]) for name in MODELS}
    run_gloo(_worker, WORLD, paths, critic_paths, str(tmp / "pg"), str(tmp / "result"), timeout_s=600)
    return [torch.load(tmp / f"result.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("sp, name", CASES)
def test_log_probs_entropy_values_equal_unsplit_model(ranks, sp, name):
    for rank, results in enumerate(ranks):
        r = results[(sp, name)]
        assert r["no_sp_group_is_sdpa"], (rank, "without sp_group the attention must be plain sdpa")
        for key, diff in r.items():
            if isinstance(diff, float):
                assert diff < TOLERANCE, (rank, key, diff)


@pytest.mark.parametrize("sp, name", CASES)
def test_gradients_averaged_over_sp_group_equal_unsplit_model(ranks, sp, name):
    for rank, results in enumerate(ranks):
        r = results[(sp, name)]
        for key in ("padded_13/actor_grad", "padded_13/critic_grad", "packed_15/actor_grad", "packed_15/critic_grad",
                    "padded_13/actor_grad_rank_dependent_loss"):
            worst = max(r[key].items(), key=lambda item: item[1])
            assert worst[1] < GRAD_RTOL, (rank, key, worst)


def test_head_counts_sp_cannot_split_are_refused():
    ulysses.check_heads(4, 2, 4)  # 2 KV heads replicated to 4
    ulysses.check_heads(4, 2, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        ulysses.check_heads(4, 2, 8)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ulysses.check_heads(6, 3, 2)


def test_model_whose_heads_sp_cannot_split_is_refused_before_loading(tiny_assets):
    from config import ConfigError
    from models import check_sequence_parallel_heads

    path = str(tiny_assets["tiny-qwen2"])  # 4 query heads, 2 KV heads
    check_sequence_parallel_heads(path, 4, False, "actor_rollout_ref.model.path")
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path=.*num_attention_heads=4"):
        check_sequence_parallel_heads(path, 8, False, "actor_rollout_ref.model.path")


@pytest.mark.parametrize("sp", SP_SIZES)
def test_gather_rows_gives_the_sp_group_its_rows(ranks, sp):
    assert all(results[(sp, "gather_rows")] for results in ranks)
