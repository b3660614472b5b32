"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): the weight sync into the real vLLM CPU engine,
and the checkpoint names it sends.

One torchrun launch per architecture (tests/dist_moe_check.py): an FSDP2 actor and its engine, synced after
the experts moved; vLLM's log-probs of its own samples against the actor's.
"""

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import ROOT, short_run, torchrun
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import make_assets
import moe

WORKER = ROOT / "tests" / "dist_moe_check.py"
PARITY = 1e-5  # float32 engine and actor, same weights: only the kernels' summation order differs

# architecture -> (world size, rollout TP)
# (Qwen2-MoE's sync is checked in a training run, at TP 2: test_moe_grpo_at_tp2_keeps_the_sync_with_router_replay)
LAUNCHES = {"qwen3_moe": (1, 1), "mixtral": (2, 1)}
_RESULTS: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> dict[str, Path]:
    return make_assets.build_moe_assets(tmp_path_factory.mktemp("moe_assets"))


# Qwen3-MoE in the inner loop; the other two (one engine start-up each) in the full suite
@pytest.fixture(params=[arch if arch == "qwen3_moe" else pytest.param(arch, marks=pytest.mark.slow)
                        for arch in LAUNCHES])
def launch(request, moe_assets, tmp_path_factory) -> list[dict]:
    arch = request.param
    if arch not in _RESULTS:
        world, tp = LAUNCHES[arch]
        out_dir = tmp_path_factory.mktemp(arch)
        torchrun(world, WORKER, str(out_dir), str(moe_assets[arch]), str(tp), timeout=600)
        _RESULTS[arch] = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return _RESULTS[arch]


def test_engine_equals_actor_after_syncs_that_move_the_experts(launch):
    for rank in launch:
        assert rank["sync_changed_engine"] and rank["sync_changed_experts"], rank
        assert rank["experts_moved"] > 0
        for phase in ("checkpoint", "synced", "restored"):
            assert rank[phase]["tokens"] > 0
            assert rank[phase]["logprob_diff_max"] < PARITY, (rank["rank"], phase, rank[phase])


def test_cpu_engine_still_needs_its_experts_repacked_after_a_sync(launch):
    """The vLLM bug rollout._restore_cpu_moe_layout works around (docs/moe.md): without it the engine's
    experts are wrong after a sync. When this fails, a vLLM upgrade fixed it: remove the workaround."""
    for rank in launch:
        gap = rank["without_restore"]["logprob_diff_max"]
        assert gap > 1e-2, f"a sync without the repack gives parity ({gap:.2e}): drop _restore_cpu_moe_layout"


@pytest.mark.slow
@pytest.mark.short_run("moe_tp2")
def test_moe_grpo_at_tp2_keeps_the_sync_with_router_replay(short_runs):
    """train_ppo on 2 ranks with an untrained Qwen2-MoE (shared expert included), one vLLM engine of TP 2 and
    router replay R2 (recorded in the old-log-prob forward, replayed in both mini batches' forwards and their
    recomputation under activation checkpointing), 3 steps: after each step's sync the engine's log-probs of
    its samples equal the actor's (the verified-sync check, float32), and the routers' balance is reported."""
    from tracking import read_metrics

    rows = [r for r in read_metrics(short_run(short_runs, "moe_tp2") / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-4, row  # the dense runs' bound; without the repack 0.1 to 0.9
        assert row["actor/moe_load_balance"] > 1.0 and row["actor/ppo_kl"] != 0  # the update moved the weights


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_engine_names_are_the_checkpoint_names_save_pretrained_writes(arch, moe_assets):
    """engine_names, one tensor at a time, against the file save_pretrained wrote (its own conversion)."""
    path = moe_assets[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sent = dict(moe.engine_names(model, ((n, p.detach()) for n, p in model.named_parameters())))
    with safe_open(str(path / "model.safetensors"), "pt") as saved:
        assert sorted(sent) == sorted(saved.keys())
        for name in saved.keys():
            assert torch.equal(sent[name], saved.get_tensor(name)), name
    assert moe.is_moe(model.config)


def test_dense_models_keep_their_names(tiny_assets):
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["tiny-qwen2"], dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert not moe.is_moe(model.config)
    assert [n for n, _ in moe.engine_names(model, iter(named))] == [n for n, _ in named]


# ---------------------------------------------------------------------------------------------
# Router replay (trainer side), on the HF models in this process


def _model_and_batch(path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _experts_used(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """What each layer's experts module is handed (its top-k ids), seen from the experts, not the router."""
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
               for name, m in model.named_modules() if name.endswith("mlp.experts")]
    return seen, handles


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_replaying_the_recorded_routes_equals_the_free_forward(arch, moe_assets):
    model, batch = _model_and_batch(moe_assets[arch])
    with torch.no_grad():
        free = model(**batch).logits
        with moe.RouterReplay(model, "record") as rec:
            recorded = model(**batch).logits
        with moe.RouterReplay(model, "replay", rec.routes):
            replayed = model(**batch).logits
    assert rec.routes.shape == (2, 2 * 12, 2)  # (layers, tokens, top_k)
    assert torch.equal(recorded, free) and torch.equal(replayed, free)


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_replay_forces_flipped_routes_back_and_the_router_keeps_its_gradient(arch, moe_assets):
    model, batch = _model_and_batch(moe_assets[arch])
    with torch.no_grad(), moe.RouterReplay(model, "record") as rec:
        model(**batch)
    with torch.no_grad():  # move the routers: many tokens now pick other experts
        for router in moe.routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
        with moe.RouterReplay(model, "record") as moved:
            model(**batch)
    flipped = (moved.routes.sort(-1).values != rec.routes.sort(-1).values).any(-1)  # (layers, tokens)
    assert flipped.sum() > 5, "the perturbation flipped too few routes to test anything"

    seen, handles = _experts_used(model)
    with moe.RouterReplay(model, "replay", rec.routes):
        loss = model(**batch).logits.logsumexp(-1).mean()
    for handle in handles:
        handle.remove()
    assert all(torch.equal(used, want) for used, want in zip(seen, rec.routes, strict=True))  # forced back
    loss.backward()
    for router in moe.routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_refuses_routes_of_other_tokens(moe_assets):
    model, batch = _model_and_batch(moe_assets["qwen3_moe"])
    with torch.no_grad(), moe.RouterReplay(model, "record") as rec:
        model(**batch)
    with pytest.raises(ValueError, match="replay needs the recorded tokens"), torch.no_grad():
        with moe.RouterReplay(model, "replay", rec.routes[:, :-1]):
            model(**batch)
    with pytest.raises(ValueError, match="MoE layers"):
        moe.RouterReplay(model, "replay", rec.routes[:1])


PROMPT, RESPONSE = 5, 6


def _ragged_batch(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's layout: ragged left-padded prompts (P=5), right-padded responses (R=6)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, PROMPT + RESPONSE), generator=g)
    prompt_lens = torch.randint(1, PROMPT + 1, (rows,), generator=g)
    response_lens = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    mask = torch.cat([torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None],
                      torch.arange(RESPONSE)[None] < response_lens[:, None]], dim=1).long()  # (B, P+R)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:], "response_mask": mask[:, PROMPT:].clone()}


def _move_routers(model: torch.nn.Module, seed: int) -> None:
    """Noise on every router (each rank on its own shard): many tokens then pick other experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe.routers(model):
            weight = router.weight.to_local() if hasattr(router.weight, "to_local") else router.weight
            weight.add_(torch.randn(weight.shape, generator=g))


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_routes_recorded_per_row_replay_in_any_layout_and_cut(arch, moe_assets):
    """R2's store: routes recorded in one layout (padded, micro batches of 2) replay in another (packed,
    token-budget micro batches, rows shuffled). Replayed on the recording weights: the padded forward is
    the recorded one exactly, the packed one the free packed forward exactly. After the routers moved, each
    packed forward's experts are those the packed forward chose before (recorded there directly)."""
    import models

    model, _ = _model_and_batch(moe_assets[arch])
    batch = _ragged_batch(6)
    shuffled = {k: v[torch.tensor([4, 1, 5, 0, 3, 2])] for k, v in batch.items()}
    packed = dict(use_remove_padding=True, max_token_len=24)  # cuts of 2-3 rows
    with torch.no_grad():
        with moe.RouterReplay(model, "record") as rec:
            old = models.compute_log_probs(model, batch, 1.0, 2, router_replay=rec)
        with moe.RouterReplay(model, "replay") as replay:
            again = models.compute_log_probs(model, batch, 1.0, 2, router_replay=replay,
                                             routed_experts=old.routed_experts)
        free_packed = models.compute_log_probs(model, shuffled, 1.0, 6, **packed)
        packed_routes: list[torch.Tensor] = []
        with moe.RouterReplay(model, "record") as direct:  # the reference: each packed forward's own choice
            hook = model.lm_head.register_forward_hook(lambda *a: packed_routes.append(direct.routes))
            models.compute_log_probs(model, shuffled, 1.0, 6, **packed)
            hook.remove()
        with moe.RouterReplay(model, "replay") as replay:
            replayed_packed = models.compute_log_probs(model, shuffled, 1.0, 6, router_replay=replay,
                                                       routed_experts=old.routed_experts[[4, 1, 5, 0, 3, 2]], **packed)
    real = batch["attention_mask"].bool()
    assert old.routed_experts.shape == (6, PROMPT + RESPONSE, 2, 2) and bool((old.routed_experts[real] >= 0).all())
    assert torch.equal(again.log_probs, old.log_probs)
    assert torch.equal(replayed_packed.log_probs, free_packed.log_probs)
    responses = shuffled["response_mask"].bool()  # padded keeps the model's output past a response's end
    torch.testing.assert_close(replayed_packed.log_probs[responses], old.log_probs[[4, 1, 5, 0, 3, 2]][responses],
                               rtol=0, atol=1e-5)
    assert len(packed_routes) > 1  # more than one micro batch

    _move_routers(model, 1)
    seen, handles = _experts_used(model)
    with torch.no_grad():
        models.compute_log_probs(model, shuffled, 1.0, 6, **packed)  # free: the routes flip
        free_seen = list(seen)
        seen.clear()
        with moe.RouterReplay(model, "replay") as replay:
            models.compute_log_probs(model, shuffled, 1.0, 6, router_replay=replay,
                                     routed_experts=old.routed_experts[[4, 1, 5, 0, 3, 2]], **packed)
    for handle in handles:
        handle.remove()
    want = [layer for routes in packed_routes for layer in routes]  # per forward, per layer (N, k)
    flipped = sum(int((f.sort(-1).values != w.sort(-1).values).any(-1).sum()) for f, w in zip(free_seen, want, strict=True))
    assert flipped > 5, "the moved routers flipped too few routes to test anything"
    assert all(torch.equal(used, w) for used, w in zip(seen, want, strict=True))  # every flip forced back


def test_replay_holds_through_activation_checkpointing(moe_assets):
    """The update's backward recomputes each layer under activation checkpointing; the recomputed routers
    must replay the same routes, or the gradient is of another forward than the loss's."""
    import models

    batch = _ragged_batch(4, seed=1)
    grads = {}
    for checkpointing in (False, True):
        model, _ = _model_and_batch(moe_assets["qwen3_moe"])
        with torch.no_grad(), moe.RouterReplay(model, "record") as rec:
            old = models.compute_log_probs(model, batch, 1.0, 4, use_remove_padding=True, router_replay=rec)
        _move_routers(model, 2)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with moe.RouterReplay(model, "replay") as replay:
            out = models.compute_log_probs(model, batch, 1.0, 4, use_remove_padding=True, router_replay=replay,
                                           routed_experts=old.routed_experts)
            (out.log_probs * batch["response_mask"]).sum().backward()
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert all(r.weight.grad.abs().sum() > 0 for r in moe.routers(model))
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)


def test_the_update_replays_the_old_forwards_routes(moe_assets):
    """train_ppo's R2 path on a (1-rank FSDP) Qwen3-MoE with activation checkpointing: old_policy_forward's
    recording replayed by update_actor over 2 epochs of 2 shuffled mini batches (packed, one row per micro
    batch). With the weights unchanged (lr 0) and the old forward in the update's cut, every update forward's
    log-probs are the old ones exactly (ppo_kl 0). After the routers moved, every forward and recomputation
    hands the experts the routes an old forward in another layout (padded, micro batches of 2) chose."""
    import dataclasses

    from conftest import one_rank_process_group
    from torch.distributed.device_mesh import init_device_mesh

    import config
    import models
    import train_ppo

    batch = _ragged_batch(4, seed=2)
    batch["advantages"] = torch.randn(4, RESPONSE, generator=torch.Generator().manual_seed(3))
    cfg = config.load_config(None, ["actor_rollout_ref.actor.router_replay.mode=R2"])
    spec = train_ppo.UpdateSpec(epochs=2, mini_batch_size=2, micro_batch_size=1, max_token_len=None,
                                shuffle=True, loss_agg_mode="token-mean", use_remove_padding=True, grad_clip=1e9)
    loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=1.0)
    with one_rank_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        actor = models.load_causal_lm(str(moe_assets["qwen3_moe"]), mesh, device=torch.device("cpu"),
                                      param_dtype=torch.float32, reduce_dtype=torch.float32,
                                      activation_checkpointing=True)
        def old_forward(micro_batch_size: int, packed: bool) -> train_ppo.PolicyForward:
            plan = types.SimpleNamespace(old_log_prob=types.SimpleNamespace(
                micro_batch_size=micro_batch_size, max_token_len=None, use_remove_padding=packed))
            run = types.SimpleNamespace(cfg=cfg, actor=actor, plan=plan, actor_loss=loss, sp_group=None,
                                        dp_group=None)
            return train_ppo.old_policy_forward(run, batch)

        old = old_forward(1, True)  # the update's own cut
        rows = dict(batch, old_log_probs=old.old_log_probs, routed_experts=old.routed_experts)
        metrics, _ = train_ppo.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=0.0), rows, loss, spec,
                                            torch.Generator().manual_seed(0))
        assert metrics["actor/ppo_kl"] == 0 and metrics["actor/pg_clipfrac"] == 0, metrics  # on-policy, exactly

        old = old_forward(2, False)  # another layout and cut: padded, micro batches of 2
        rows = dict(batch, old_log_probs=old.old_log_probs, routed_experts=old.routed_experts)

        _move_routers(actor, 4)
        seen, handles = _experts_used(actor)
        inputs: list[torch.Tensor] = []
        handles.append(actor.model.embed_tokens.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone())))
        train_ppo.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=0.0), rows, loss, spec,
                               torch.Generator().manual_seed(0))
        for handle in handles:
            handle.remove()
    real = batch["attention_mask"].bool()
    row_of = [next(r for r in range(4) if torch.equal(batch["input_ids"][r][real[r]], ids[0])) for ids in inputs]
    assert len(row_of) == 8 and len(seen) == 8 * 4  # 2 epochs x 4 rows; 2 layers, each run and recomputed
    for j, row in enumerate(row_of):
        want = old.routed_experts[row][real[row]].transpose(0, 1).long()  # (layers, n, k)
        used = seen[4 * j:4 * j + 4]  # layer 0, layer 1, then the backward's recomputation: layer 1, layer 0
        assert all(torch.equal(u, want[layer]) for u, layer in zip(used, (0, 1, 1, 0), strict=True)), (j, row)


def test_lora_on_a_moe_model_is_refused(moe_assets):
    from config import ConfigError
    from lora import LoraSpec

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear", adapter_path=None, base_model="tiny")
    model = AutoModelForCausalLM.from_pretrained(moe_assets["mixtral"], dtype=torch.float32)
    with pytest.raises(ConfigError, match="LoRA on a mixture-of-experts model"):
        spec.add_adapter(model)


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_load_balancing_loss_is_transformers_aux_loss(arch, moe_assets):
    model, batch = _model_and_batch(moe_assets[arch])
    with torch.no_grad(), moe.RouterLogits(model) as seen:
        want = model(**batch, output_router_logits=True).aux_loss  # transformers' own, from the same logits
    assert len(seen.logits) == 2 and want > 1.0
    got = moe.load_balancing_loss(seen.logits, model.config.num_experts_per_tok)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    # every expert equally likely and, by topk's ties, the same two picked: balanced probabilities give top_k
    assert moe.load_balancing_loss([torch.zeros(24, 4)], 2).item() == pytest.approx(2.0)


def test_the_update_reports_the_routers_load_balance(moe_assets):
    """train_ppo.update_actor on a (1-rank FSDP) Qwen2-MoE: actor/moe_load_balance is the load-balancing loss
    of a plain forward of the same packed tokens before the step."""
    import dataclasses

    from conftest import one_rank_process_group
    from torch.distributed.device_mesh import init_device_mesh

    import config
    import models
    import train_ppo

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (4, 11), generator=g)
    attention = torch.ones_like(ids)
    response_mask = attention[:, 5:].clone()
    batch = {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1),
             "responses": ids[:, 5:], "response_mask": response_mask, "advantages": torch.randn(4, 6, generator=g)}
    plain, _ = _model_and_batch(moe_assets["qwen2_moe"])
    with torch.no_grad(), moe.RouterLogits(plain) as seen:
        plain(input_ids=ids)
    want = moe.load_balancing_loss(seen.logits, 2).item()
    with one_rank_process_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        actor = models.load_causal_lm(str(moe_assets["qwen2_moe"]), mesh, device=torch.device("cpu"),
                                      param_dtype=torch.float32, reduce_dtype=torch.float32)
        with torch.no_grad():
            batch["old_log_probs"] = models.compute_log_probs(actor, batch, 1.0, 4).log_probs
        cfg = config.load_config(None, [])
        spec = train_ppo.UpdateSpec(epochs=1, mini_batch_size=4, micro_batch_size=4, max_token_len=None,
                                    shuffle=False, loss_agg_mode="token-mean", use_remove_padding=True, grad_clip=1e9)
        loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=1.0, loss_scale_factor=6)
        metrics, _ = train_ppo.update_actor(actor, torch.optim.SGD(actor.parameters(), lr=0.1), batch, loss, spec,
                                            torch.Generator().manual_seed(0))
    assert metrics["actor/moe_load_balance"] == pytest.approx(want, rel=1e-5)
    assert want > 2.0  # top_k is the balanced value: this random router is not balanced


# ---------------------------------------------------------------------------------------------
# The planner and the TP check on MoE widths


def test_tensor_parallel_is_checked_against_the_expert_width():
    from config import ConfigError
    from models import check_tensor_parallel

    narrow = make_assets.moe_config("qwen3_moe", expert_intermediate=34)  # dense intermediate_size 136 splits by 4
    with pytest.raises(ConfigError, match="moe_intermediate_size=34 over the TP ranks. Valid values up to 64: 1, 2."):
        check_tensor_parallel(narrow, 4, "narrow")
    unused_dense = make_assets.moe_config("qwen3_moe")
    unused_dense.intermediate_size = 250  # no layer without experts uses it: vLLM never shards it
    check_tensor_parallel(unused_dense, 4, "unused_dense")
    shared = make_assets.moe_config("qwen2_moe")
    shared.shared_expert_intermediate_size = 98  # the shared expert is sharded too
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=98"):
        check_tensor_parallel(shared, 4, "shared")
    check_tensor_parallel(make_assets.moe_config("mixtral"), 2, "mixtral")  # Mixtral: intermediate_size is the expert's


def test_cpu_engine_expert_width_per_rank_is_checked():
    """vLLM's CPU engine pads an expert width per TP rank that is not a multiple of 32 at load, and its
    reload_weights then fails on the padded tensors (seen with width 48: 'The size of tensor a (128) must
    match the size of tensor b (96)'): refused before anything loads, with the TP degrees that work."""
    from config import ConfigError

    wide = make_assets.moe_config("qwen3_moe", expert_intermediate=96)  # 96 per rank at TP 1, 48 at 2, 32 at 3
    moe.check_cpu_engine_expert_width(wide, 1, "wide")
    with pytest.raises(ConfigError, match=r"48 per rank at actor_rollout_ref.rollout.tensor_model_parallel_size=2.*"
                                          r"valid here: 1, 3\)"):
        moe.check_cpu_engine_expert_width(wide, 2, "wide")
    with pytest.raises(ConfigError, match="experts 48 wide.*valid here: none"):
        moe.check_cpu_engine_expert_width(make_assets.moe_config("mixtral", expert_intermediate=48), 1, "narrow")
    moe.check_cpu_engine_expert_width(make_assets.moe_config("mixtral"), 2, "tiny")  # 64: 32 per rank
    moe.check_cpu_engine_expert_width(make_assets.model_config("qwen2", 64, 2, 2, 2, 40, False), 2, "dense")


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_planner_counts_active_experts_and_gathers_a_whole_layer(arch, moe_assets):
    import memory_plan

    shape = memory_plan.model_shape(str(moe_assets[arch]))
    config = AutoModelForCausalLM.from_pretrained(moe_assets[arch]).config
    assert shape.intermediate == 2 * 64 + (128 if arch == "qwen2_moe" else 0)  # top_k x expert width (+ shared)
    plain = AutoModelForCausalLM.from_pretrained(moe_assets[arch], dtype=torch.float32)
    layer0 = sum(p.numel() for n, p in plain.named_parameters() if n.startswith("model.layers.0."))
    experts = sum(p.numel() for n, p in plain.named_parameters() if n.startswith("model.layers.0.mlp.experts."))
    assert experts == 4 * 3 * 64 * 128 and shape.largest_block_numel == layer0  # all 4 experts in the unit
    assert moe.active_mlp_width(config) == shape.intermediate


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"], "GPU model runner V2.*Use actor_rollout_ref.actor.router_replay.mode=R2"),
    (["actor_rollout_ref.actor.router_replay.mode=R3"], "router_replay.mode=R3 is not supported.*mode=R2"),
    (["actor_rollout_ref.actor.router_replay.mode=R4"], "valid values: disabled, R2, R3"),
    (["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     "not Ulysses slices"),
    (["actor_rollout_ref.actor.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"],
     "bypass mode skips")])
def test_router_replay_refuses_what_cannot_work(overrides, message):
    from config import ConfigError, check_router_replay, load_config

    with pytest.raises(ConfigError, match=message):
        check_router_replay(load_config(None, ["data.train_files=x.parquet", *overrides]))
    check_router_replay(load_config(None, ["data.train_files=x.parquet"]))  # the defaults pass
    check_router_replay(load_config(None, ["data.train_files=x.parquet", "actor_rollout_ref.actor.router_replay.mode=R2"]))


def test_router_replay_on_a_dense_model_is_refused(tiny_assets):
    from config import ConfigError

    dense = AutoModelForCausalLM.from_pretrained(tiny_assets["tiny-qwen2"])
    with pytest.raises(ConfigError, match="has no MoE router"):
        moe.check_router_replay(dense, "R2")
    moe.check_router_replay(dense, "disabled")
