"""FSDP2 on mixture-of-experts models: this project's per-block wrapping (models.load_causal_lm) shards the
fused expert tensors on their expert dimension; on 2 real gloo ranks the sharded forward (padded and packed)
equals one plain transformers forward, the backward reaches router, experts and shared expert, and
iter_full_params gives back the checkpoint's tensors under transformers' names. All three tiny MoE
architectures in one spawn; the full suite adds 3 ranks, where the 4 experts shard unevenly (2, 2, 0)."""

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo
from transformers import AutoModelForCausalLM

import make_assets

PROMPT, RESPONSE = 5, 6


def _batch(rank: int) -> dict[str, torch.Tensor]:
    """4 samples with ragged left-padded prompts and right-padded responses, different per rank."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 128, (4, PROMPT + RESPONSE), generator=g)
    prompt_lens, response_lens = torch.tensor([5, 2, 4, 1]), torch.tensor([6, 1, 3, 5]).roll(rank)
    mask = torch.cat([torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None],
                      torch.arange(RESPONSE)[None] < response_lens[:, None]], dim=1).long()  # (4, P+R)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:]}


def _worker(rank: int, world: int, paths: dict[str, str], init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import models

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        result: dict = {}
        for arch, path in paths.items():
            plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            actor = models.load_causal_lm(path, mesh, device=torch.device("cpu"), param_dtype=torch.float32,
                                          reduce_dtype=torch.float32).eval()
            batch = _batch(rank)
            experts = actor.model.layers[0].mlp.experts.gate_up_proj
            with torch.no_grad():
                logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]).logits[:, PROMPT - 1:-1]  # (4, R, V)
                want = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
                padded = models.compute_log_probs(actor, batch, 1.0, micro_batch_size=2).log_probs
                packed = models.compute_log_probs(actor, batch, 1.0, micro_batch_size=4,
                                                  use_remove_padding=True).log_probs
            log_probs = models.compute_log_probs(actor, batch, 1.0, micro_batch_size=4).log_probs
            (log_probs * batch["attention_mask"][:, PROMPT:]).sum().backward()
            grads = {name: p.grad.full_tensor().abs().sum().item() for name, p in actor.named_parameters()
                     if any(k in name for k in ("mlp.gate.", "mlp.experts.", "shared_expert."))}
            reference = dict(plain.named_parameters())
            full_equal = [name for name, tensor in models.iter_full_params(actor)
                          if torch.equal(tensor, reference[name].detach())]
            result[arch] = {"want": want, "padded": padded, "packed": packed, "grads": grads,
                            "full_equal": len(full_equal), "num_params": len(reference),
                            "local_experts": experts.to_local().shape[0], "experts": experts.shape[0],
                            "replay": _replay_after_the_routers_moved(actor, batch)}
        result["mask"] = _batch(rank)["attention_mask"][:, PROMPT:].bool()
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _replay_after_the_routers_moved(actor: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """R2 on the sharded actor: routes recorded in a padded forward (micro batches of 2), the routers moved
    (each rank its shard), then a packed forward replaying them: the experts it hands each layer, the routes
    a free packed forward on the recording weights chose (the reference), and the free forward's after the move."""
    import models
    import moe

    seen: list[torch.Tensor] = []
    experts = [m for name, m in actor.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        with moe.RouterReplay(actor, "record") as rec:
            old = models.compute_log_probs(actor, batch, 1.0, 2, router_replay=rec)
            models.compute_log_probs(actor, batch, 1.0, 4, use_remove_padding=True, router_replay=rec)
            reference = rec.routes  # (layers, N, k) the packed forward's own choice
        g = torch.Generator().manual_seed(7)
        for router in moe.routers(actor):
            router.weight.to_local().add_(torch.randn(router.weight.to_local().shape, generator=g))
        with moe.RouterReplay(actor, "record") as moved:
            models.compute_log_probs(actor, batch, 1.0, 4, use_remove_padding=True, router_replay=moved)
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for m in experts]
    with moe.RouterReplay(actor, "replay") as replay:
        log_probs = models.compute_log_probs(actor, batch, 1.0, 4, use_remove_padding=True, router_replay=replay,
                                             routed_experts=old.routed_experts).log_probs
    for handle in handles:
        handle.remove()
    actor.zero_grad(set_to_none=True)
    log_probs.sum().backward()
    router_grads = [r.weight.grad.full_tensor().abs().sum().item() for r in moe.routers(actor)]
    return {"seen": torch.stack(seen), "reference": reference, "moved": moved.routes, "router_grads": router_grads}


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory) -> list[dict]:
    world = request.param
    tmp = tmp_path_factory.mktemp(f"moe_fsdp{world}")
    paths = {arch: str(p) for arch, p in make_assets.build_moe_assets(tmp / "assets").items()}
    run_gloo(_worker, world, world, paths, str(tmp / "pg"), str(tmp / "result"), timeout_s=300)
    return [torch.load(tmp / f"result.{r}") for r in range(world)]


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_sharded_moe_forward_equals_plain_transformers(ranks, arch):
    experts = ranks[0][arch]["experts"]
    shard = -(-experts // len(ranks))  # FSDP's dim-0 chunks: the last ranks may hold fewer, or none
    assert [r[arch]["local_experts"] for r in ranks] == [max(0, min(shard, experts - shard * i))
                                                         for i in range(len(ranks))]
    for rank, result in enumerate(ranks):
        mask, got = result["mask"], result[arch]
        for layout in ("padded", "packed"):
            torch.testing.assert_close(got[layout][mask], got["want"][mask], rtol=0, atol=1e-5,
                                       msg=lambda m, r=rank, lay=layout: f"{arch} rank {r} {lay}: {m}")


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_gradients_reach_router_and_experts_and_full_params_are_the_checkpoint(ranks, arch):
    for result in ranks:
        got = result[arch]
        kinds = {"mlp.gate.", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
        if arch == "qwen2_moe":
            kinds.add("shared_expert.")
        for kind in kinds:
            named = {n: g for n, g in got["grads"].items() if kind in n}
            assert named and all(g > 0 for g in named.values()), (kind, named)
        assert got["full_equal"] == got["num_params"]


@pytest.mark.parametrize("arch", make_assets.MOE_ARCHS)
def test_replay_forces_the_recorded_routes_on_the_sharded_actor(ranks, arch):
    """Router replay (R2) on real ranks: routes recorded per row in one layout are forced back, flips and all,
    in another layout after the routers moved, and the router still gets its gradient."""
    for rank, result in enumerate(ranks):
        got = result[arch]["replay"]
        flipped = (got["moved"].sort(-1).values != got["reference"].sort(-1).values).any(-1).sum().item()
        assert flipped > 3, (arch, rank, "the moved routers flipped too few routes to test anything")
        assert torch.equal(got["seen"], got["reference"]), (arch, rank)
        assert all(g > 0 for g in got["router_grads"]), (arch, rank, got["router_grads"])
