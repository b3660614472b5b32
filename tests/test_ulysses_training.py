"""A training step with Ulysses sequence parallelism changes the weights as the same step without it.

On 2 real gloo ranks, FSDP2 over both, the tiny Llama (GQA: 4 query heads, 2 KV heads of size 32):
  sp=1: each rank trains on its own half of 8 samples (data parallel 2, reductions over the world);
  sp=2: both ranks hold all 8 (ulysses.gather_rows of the halves), each runs half of every packed
        row, data parallel 1, reductions over the sp mesh's dp group (mesh_utils.train_dp_group).
Both run train_ppo.update_actor (policy loss, entropy bonus, KL loss) and update_critic with plain
SGD at lr 1 and a clip no gradient reaches, so each parameter's change is minus its gradient; micro
batches are cut differently (fixed sizes against token budgets). The changes must agree, and the
update must be a real one (not zero). The same for a LoRA actor (peft adapter on every linear layer
of the blocks, the base frozen): only the adapter moves, as at sp=1."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo

WORLD = 2
NUM_SAMPLES, PROMPT, RESPONSE = 8, 6, 9
GRAD_RTOL = 1e-4  # of the largest change of each parameter


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """8 samples with ragged left-padded prompts and ragged right-padded responses (packed lengths
    that 2 does not always divide), advantages, old and reference log-probs."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (NUM_SAMPLES, PROMPT + RESPONSE), generator=g)
    prompt_lens = torch.tensor([6, 2, 4, 1, 5, 3, 6, 1])
    response_lens = torch.tensor([9, 1, 3, 5, 2, 7, 4, 8])
    mask = torch.cat([torch.arange(PROMPT)[None] >= PROMPT - prompt_lens[:, None],
                      torch.arange(RESPONSE)[None] < response_lens[:, None]], dim=1).long()  # (8, P+R)
    response_mask = mask[:, PROMPT:]  # (8, R)
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:], "response_mask": response_mask,
            # near the model's own log-probs (about -log 100 for a tiny random model): ratios near 1,
            # a few clipped
            "old_log_probs": -4.6 + 0.3 * rand(NUM_SAMPLES, RESPONSE), "ref_log_probs": -4.6 + 0.3 * rand(NUM_SAMPLES, RESPONSE),
            "advantages": (rand(NUM_SAMPLES, 1) - 0.5) * response_mask, "returns": rand(NUM_SAMPLES, RESPONSE) * response_mask,
            "values": 0.1 * rand(NUM_SAMPLES, RESPONSE) * response_mask}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _one_step(path: str, sp: int, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each model's parameter change after one update, as full tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    import models
    import train_ppo
    import ulysses
    from config import load_config
    from lora import LoraSpec
    from mesh_utils import Meshes, UpdateSpec, train_dp_group

    cfg = load_config(None, ["actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.use_kl_loss=true",
                             "actor_rollout_ref.actor.kl_loss_coef=0.5", "actor_rollout_ref.actor.grad_clip=1e9",
                             "critic.grad_clip=1e9"])
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    sp_mesh = init_device_mesh("cpu", (WORLD // sp, sp), mesh_dim_names=("dp", "sp")) if sp > 1 else None
    dp_group = train_dp_group(Meshes(world, world, None, sp_mesh))
    sp_group = sp_mesh.get_group("sp") if sp_mesh is not None else None
    kwargs = dict(device=torch.device("cpu"), param_dtype=torch.float32, reduce_dtype=torch.float32,
                  attn_implementation=ulysses.register_ulysses_attention())
    actor = models.load_causal_lm(path, world, **kwargs)
    critic = models.load_value_model(path, world, **kwargs)
    torch.manual_seed(0)  # the adapter's A starts random (rank 0's, broadcast): the same one at sp=1 and sp=2
    lora_actor = models.load_causal_lm(path, world, wrap=LoraSpec(4, 8.0, "all-linear", None, path).add_adapter,
                                       **kwargs)
    with torch.no_grad():  # the value head starts at zero; give the body's gradients something to carry
        g = torch.Generator().manual_seed(100 + rank)
        for p in critic.parameters():
            p.to_local().add_(torch.randn(p.to_local().shape, generator=g) * 0.02)
        for name, p in lora_actor.named_parameters():  # LoRA's B starts at zero: A's gradient would be zero
            if "lora_B" in name:
                p.to_local().add_(torch.randn(p.to_local().shape, generator=g) * 0.02)
    full = _batch(actor.config.vocab_size)
    half = NUM_SAMPLES // WORLD
    batch = {k: v[rank * half:(rank + 1) * half] for k, v in full.items()}  # as split_for_training
    if sp_group is not None:
        batch = ulysses.gather_rows(batch, sp_group)
        assert all(torch.equal(batch[k], full[k]) for k in full)
    per_rank = NUM_SAMPLES // dist.get_world_size(dp_group)
    # sp=1: fixed micro batches of 2; sp=2: token budgets (about 3 samples each)
    cut = dict(micro_batch_size=2, max_token_len=None) if sp == 1 else dict(micro_batch_size=per_rank, max_token_len=30)
    spec = UpdateSpec(epochs=1, mini_batch_size=per_rank, shuffle=False, loss_agg_mode="token-mean",
                      use_remove_padding=True, grad_clip=1e9, **cut)
    loss = dataclasses.replace(train_ppo.ActorLoss.from_config(cfg), temperature=0.7, loss_scale_factor=RESPONSE)
    groups = dict(dp_group=dp_group, sp_group=sp_group)
    changes = {}
    for name, model in (("actor", actor), ("critic", critic), ("lora_actor", lora_actor)):
        before = _full_params(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        generator = torch.Generator().manual_seed(0)
        if name != "critic":
            metrics, _ = train_ppo.update_actor(model, optimizer, batch, loss, spec, generator, **groups)
        else:
            metrics = train_ppo.update_critic(critic, optimizer, batch, spec, generator, cfg.critic.cliprange_value,
                                              RESPONSE, **groups)
        assert metrics[f"{name.removeprefix('lora_')}/grad_norm"] > 0, metrics
        changes[name] = {k: after - before[k] for k, after in _full_params(model).items()}
    return changes


def _worker(rank: int, path: str, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.save({sp: _one_step(path, sp, rank) for sp in (1, 2)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def changes(tiny_assets, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ulysses_step")
    run_gloo(_worker, WORLD, str(tiny_assets["tiny-llama-tied"]), str(tmp / "pg"), str(tmp / "result"), timeout_s=900)
    return [torch.load(tmp / f"result.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("model", ["actor", "critic", "lora_actor"])
def test_sp2_update_equals_sp1_update(changes, model):
    for rank, result in enumerate(changes):
        want, got = result[1][model], result[2][model]
        assert sum(c.abs().sum().item() for c in want.values()) > 0, "the reference update moved nothing"
        if model == "lora_actor":  # the adapter, A and B, moves; the base does not
            moved = {name for name, c in want.items() if c.abs().max() > 0}
            assert moved and all("lora_A" in n or "lora_B" in n for n in moved), sorted(moved)[:4]
            assert any("lora_A" in n for n in moved) and any("lora_B" in n for n in moved)
        for name, change in want.items():
            if change.abs().max() == 0:  # (the critic's untouched LM head rows, say)
                assert got[name].abs().max() == 0, (rank, name)
                continue
            rel = ((got[name] - change).abs().max() / change.abs().max()).item()
            assert rel < GRAD_RTOL, (rank, model, name, rel)
