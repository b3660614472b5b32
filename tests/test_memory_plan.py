"""memory_plan.py: the placement table and its moves, and the byte estimates checked against real
FSDP2 shards (2 and 4 gloo ranks) and against the tensors autograd really saves for backward."""

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, one_rank_process_group, run, run_gloo

import memory_plan as mp
import offload

# Written out by hand from verl's offload rules (not from placement()): per phase, where
# (actor.params, actor.grads, actor.optimizer, ref.params, engine.weights, engine.kv_cache) live.
D, H, F, N = "device", "host", "freed", "-"
EXPECTED = {
    "no offload, free_cache_engine=false": {
        "sync": (D, N, D, D, D, D), "generate": (D, N, D, D, D, D),
        "log_prob": (D, N, D, D, D, D), "update": (D, D, D, D, D, D)},
    "no offload": {
        "sync": (D, N, D, D, D, D), "generate": (D, N, D, D, D, D),
        "log_prob": (D, N, D, D, F, F), "update": (D, D, D, D, F, F)},
    "param_offload": {
        "sync": (D, N, D, D, D, D), "generate": (H, N, D, D, D, D),
        "log_prob": (D, N, D, D, F, F), "update": (D, D, D, D, F, F)},
    "optimizer_offload": {
        "sync": (D, N, H, D, D, D), "generate": (D, N, H, D, D, D),
        "log_prob": (D, N, H, D, F, F), "update": (D, D, D, D, F, F)},
    "param_offload + optimizer_offload + ref param_offload": {
        "sync": (D, N, H, H, D, D), "generate": (H, N, H, H, D, D),
        "log_prob": (D, N, H, H, F, F), "update": (D, D, D, H, F, F)},
}
COLUMNS = ("actor.params", "actor.grads", "actor.optimizer", "ref.params", "engine.weights", "engine.kv_cache")


def test_placement_is_the_table_and_the_readme_shows_it():
    combos = dict(offload.flag_combinations())
    assert set(combos) == set(EXPECTED)
    for label, phases in EXPECTED.items():
        for phase, row in phases.items():
            where = offload.placement(combos[label], phase)
            assert tuple(where[c] for c in COLUMNS) == row, (label, phase)
            # the critic follows its own flags exactly as the actor follows the actor's, except that
            # its shards stay on the host through sync too (only the actor's are gathered into the engine)
            assert where["critic.optimizer"] == where["actor.optimizer"]
            assert where["critic.grads"] == where["actor.grads"]
    assert offload.placement_table() in (ROOT / "docs" / "memory-and-offload.md").read_text()
    # LoRA's later syncs send the adapted modules only: the sleeping engine keeps the others on the host
    lora = offload.placement(offload.OffloadFlags(partial_sync=True), "update")
    assert (lora["engine.weights"], lora["engine.kv_cache"]) == (H, F)


@pytest.mark.parametrize("label", list(EXPECTED))
def test_moves_of_a_step_reach_every_phase(label):
    """Applying plan_moves from the loaded state through two steps (the trainer's order) lands each
    movable item where placement() says, and moves nothing that is already in place."""
    flags = dict(offload.flag_combinations())[label]
    state = {item: D for item in offload.ITEMS} | {"ref.params": offload.placement(flags, "sync")["ref.params"]}
    previous = offload.LOADED
    for phase in ("sync", "generate", "log_prob", "update", "sync", "generate", "log_prob", "update", "sync"):
        moves = offload.plan_moves(flags, previous, phase)
        for item, where in moves:
            assert state[item] != where, (item, where, "moved to where it already is")
            state[item] = where
        target = offload.placement(flags, phase)
        assert {i: state[i] for i in offload.ITEMS if not i.endswith(".grads")} == \
            {i: target[i] for i in offload.ITEMS if not i.endswith(".grads")}, phase
        previous = phase
    if flags.actor_param:
        assert ("actor.params", H) in offload.plan_moves(flags, "sync", "generate")
        assert ("actor.params", D) in offload.plan_moves(flags, "generate", "log_prob")
    if flags.actor_optimizer:
        assert offload.plan_moves(flags, "log_prob", "update")[:1] == [("actor.optimizer", D)]
    if flags.free_cache_engine:
        assert ("engine.kv_cache", F) in offload.plan_moves(flags, "generate", "log_prob")


# --- shard bytes: the estimate against real FSDP2 shards -------------------------------------------


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _shard_worker(rank: int, world: int, paths: dict[str, str], init_file: str, out_dir: str) -> None:
    import models
    from mesh_utils import ParallelDims, build_meshes

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        meshes = build_meshes(ParallelDims(world, 1, world, world, 1, 1), "cpu")
        result = {}
        for name, path in paths.items():
            for value_head in (False, True):
                load = models.load_value_model if value_head else models.load_causal_lm
                model = load(path, meshes.fsdp, device=torch.device("cpu"), param_dtype=torch.float32,
                             reduce_dtype=torch.float32)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                ids = torch.randint(3, model.config.vocab_size, (2, 8))
                model(input_ids=ids).logits.float().square().mean().backward()
                grads = sum(_local_bytes(p.grad) for p in model.parameters())
                optimizer.step()
                result[f"{name}/{'critic' if value_head else 'actor'}"] = {
                    "params": sum(_local_bytes(p) for p in model.parameters()), "grads": grads,
                    "optimizer": sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values())}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_shard_bytes_equal_real_fsdp2_shards(world, tiny_assets, tmp_path):
    """Parameter, gradient and AdamW state bytes per rank, from config.json alone, equal what each
    rank of a real FSDP2 model holds: two architectures (one tied), actor and critic, and a model
    whose rows do not divide by the world (uneven and empty shards)."""
    import make_assets

    uneven = tmp_path / "uneven"
    make_assets.build_model(uneven, make_assets.model_config("qwen2", hidden=96, layers=2, heads=3, kv_heads=1,
                                                             intermediate=202, tied=True), seed=0)
    paths = {"tiny-qwen2": str(tiny_assets["tiny-qwen2"]), "tiny-llama-tied": str(tiny_assets["tiny-llama-tied"]),
             "uneven": str(uneven)}
    run_gloo(_shard_worker, world, world, paths, str(tmp_path / "init"), str(tmp_path), timeout_s=600)
    for rank in range(world):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, path in paths.items():
            for kind in ("actor", "critic"):
                shape = mp.model_shape(path, value_head=kind == "critic")
                got = real[f"{name}/{kind}"]
                assert got["params"] == mp.param_shard_bytes(shape, world, rank), (name, kind, rank)
                assert got["grads"] == mp.param_shard_bytes(shape, world, rank), (name, kind, rank)
                assert got["optimizer"] == mp.adam_state_bytes(shape, world, rank), (name, kind, rank)
    assert mp.shard_numel((202, 96), 4, 3) == 49 * 96 and mp.shard_numel((3, 5), 4, 3) == 0


# --- activations: the estimate against the tensors autograd saves ---------------------------------


def saved_for_backward_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward (parameters
    excluded). Under non-reentrant checkpointing, the checkpoint's own hooks take a block's saved
    tensors (and drop them); what it keeps is each block's input, recorded here as it enters."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    def block_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        kept[hidden.untyped_storage().data_ptr()] = hidden.untyped_storage().nbytes()

    hooks = ([layer.register_forward_pre_hook(block_input, with_kwargs=True) for layer in model.model.layers]
             if checkpointing else [])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch, use_cache=False, logits_to_keep=1)
    for hook in hooks:
        hook.remove()
    del out
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True)])
def test_activation_estimate_within_30_percent(arch, tied, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    import make_assets

    path = tmp_path / arch
    make_assets.build_model(path, make_assets.model_config(arch, hidden=256, layers=4, heads=8, kv_heads=2,
                                                           intermediate=704, tied=tied), seed=0)
    shape = mp.model_shape(str(path))
    micro_batch, seq_len = 4, 256
    ids = torch.randint(3, make_assets.VOCAB_SIZE, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :17] = 0  # a left-padded row, as the trainer's batches have
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").train()
    errors = {}
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        measured = saved_for_backward_bytes(model, batch, checkpointing)
        estimate = mp.activation_bytes(shape, micro_batch, seq_len, dtype.itemsize, checkpointing)
        errors[checkpointing] = (estimate - measured) / measured
        assert abs(errors[checkpointing]) <= 0.30, (checkpointing, estimate, measured)
    print(f"{arch} {dtype}: activation estimate error {errors[False]:+.1%} (no checkpointing), "
          f"{errors[True]:+.1%} (checkpointing)")


PACKED_LENGTHS = [100, 37, 200, 63, 111]  # one packed row of 511 tokens: 2 does not divide it


def _sp_activation_worker(rank: int, path: str, init_file: str, out_dir: str) -> None:
    """Bytes autograd saves on this rank in the Ulysses forward of one packed row, sp=2, without and
    with checkpointing; rank 0 also the whole row's forward without sp."""
    from transformers import AutoModelForCausalLM

    import ulysses

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation=ulysses.register_ulysses_attention()).train()
        ids = torch.randint(3, model.config.vocab_size, (1, sum(PACKED_LENGTHS)),
                            generator=torch.Generator().manual_seed(0))
        row = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]}
        result = {}
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            result[f"sp2/{checkpointing}"] = saved_bytes_of(
                model, lambda: ulysses.sequence_parallel_log_probs(model, row, 1.0, dist.group.WORLD), checkpointing)
            result[f"sp1/{checkpointing}"] = saved_bytes_of(model, lambda: model(**row, use_cache=False, logits_to_keep=1),
                                                            checkpointing)
        (Path(out_dir) / f"sp_rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def saved_bytes_of(model: torch.nn.Module, forward, checkpointing: bool, blocks: list | None = None) -> int:
    """saved_for_backward_bytes for any forward call (the Ulysses one takes no batch dict); `blocks`: the
    checkpointed blocks (default: the decoder's)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def block_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        kept[hidden.untyped_storage().data_ptr()] = hidden.untyped_storage().nbytes()

    hooks = ([layer.register_forward_pre_hook(block_input, with_kwargs=True)
              for layer in (model.model.layers if blocks is None else blocks)] if checkpointing else [])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    for hook in hooks:
        hook.remove()
    del out
    return sum(kept.values())


def test_activation_estimate_under_ulysses_sp2(tmp_path):
    """Ulysses: each rank of 2 saves for backward what the estimate says for its half of a packed row
    (the per-token bytes divided by sp, no mask), within the same 30% as unsplit; and
    measured, that is about half of the unsplit forward's."""
    import make_assets

    path = tmp_path / "qwen2"
    make_assets.build_model(path, make_assets.model_config("qwen2", hidden=256, layers=4, heads=8, kv_heads=2,
                                                           intermediate=704, tied=False), seed=0)
    run_gloo(_sp_activation_worker, 2, str(path), str(tmp_path / "init"), str(tmp_path), timeout_s=300)
    shape, tokens = mp.model_shape(str(path)), sum(PACKED_LENGTHS)
    for rank in range(2):
        measured = json.loads((tmp_path / f"sp_rank{rank}.json").read_text())
        for checkpointing in (False, True):
            got, whole = measured[f"sp2/{checkpointing}"], measured[f"sp1/{checkpointing}"]
            estimate = mp.activation_bytes(shape, 1, tokens, 4, checkpointing, sp=2, packed=True)
            assert abs(estimate - got) / got <= 0.30, (rank, checkpointing, estimate, got)
            assert 0.4 < got / whole < 0.6, (rank, checkpointing, got, whole)  # the sp split is real
            # by hand: the per-token part for ceil(511 / 2) = 256 positions (a packed row keeps no mask)
            per_token = mp.activation_bytes(shape, 1, 1, 4, checkpointing, packed=True)
            assert estimate == 256 * per_token


def _inputs(shape: mp.ModelShape, **fields) -> mp.MemoryInputs:
    base = dict(actor=shape, critic=None, use_ref=False, flags=offload.OffloadFlags(), fsdp=1, infer_tp=1, compute_bytes=2,
                engine_bytes=2, prompt_len=512, response_len=3584, ppo_micro=4, log_prob_micro=8, critic_micro=None,
                actor_checkpointing=False, critic_checkpointing=False, gpu_memory_utilization=0.5,
                gpu_memory_bytes=80 * mp.GIB, actor_packed=True, samples_per_rank=64)
    return mp.MemoryInputs(**(base | fields))


def test_update_activations_follow_the_token_budget_and_sp():
    """The update's activations, by hand: padded, micro rows of P+R; packed, one row of micro x (P+R)
    tokens (no mask: attention runs per sequence); with a token budget, one row of the budget whatever
    the micro batch size; Ulysses divides the per-token part by sp."""
    shape = mp.ModelShape(param_shapes=[(128, 256)], hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32,
                          intermediate=704, vocab=128, largest_block_numel=1000)
    seq = 512 + 3584
    per_token = mp.activation_bytes(shape, 1, 1, 2, False, packed=True)

    def update_activations(**fields) -> int:
        return mp.phase_bytes(_inputs(shape, **fields), 0)["update"]["activations"]

    assert update_activations(actor_packed=False) == 4 * seq * per_token + 4 * seq * seq
    assert update_activations() == 4 * seq * per_token
    budget = 6000  # the plan's, the sp group's tokens per micro batch
    for micro in (1, 4, 16):
        assert update_activations(ppo_micro=micro, ppo_max_tokens=budget) == budget * per_token
        assert update_activations(ppo_micro=micro, ppo_max_tokens=budget, sp=2) == budget // 2 * per_token
    # padded, a budget admits up to budget / 2 samples of 2 valid tokens, each P+R long (at most the rank's 64)
    assert update_activations(actor_packed=False, ppo_max_tokens=budget) == 64 * seq * (per_token + seq)
    # a token budget too large (checkpointing already on): the verdict names the budget key, smaller
    m = _inputs(shape, ppo_max_tokens=budget, sp=2, actor_checkpointing=True)
    update = mp.phase_bytes(m, 0)["update"]
    m = _inputs(shape, ppo_max_tokens=budget, sp=2, actor_checkpointing=True,
                gpu_memory_bytes=sum(update.values()) - update["activations"] // 3)
    fits, line = mp.verdict(m, mp.phase_bytes(m, 0), 64)
    assert not fits and "set actor_rollout_ref.actor.ppo_max_token_len_per_gpu=" in line, line
    smaller = int(line.split("ppo_max_token_len_per_gpu=")[1].split()[0])
    assert -(-seq // 2) <= smaller < budget // 2  # still holds one sample's half, below the per-gpu 3000


@pytest.mark.parametrize("tied", [False, True])
def test_the_shape_knows_the_fsdp_units(tied, tmp_path):
    """model_shape's root and largest unit, against the parameter names: untied, the embedding and the
    LM head are units of their own (the root keeps the final norm); tied, the root keeps the embedding."""
    import make_assets

    make_assets.build_model(tmp_path, make_assets.model_config("qwen2", hidden=32, layers=2, heads=4, kv_heads=2,
                                                               intermediate=4, tied=tied), seed=0)
    shape = mp.model_shape(str(tmp_path))
    vocab, hidden = shape.vocab, shape.hidden
    assert vocab * hidden > shape.largest_block_numel  # the embedding is the largest unit when it is one
    if tied:
        assert shape.root_numel == vocab * hidden + hidden
        assert shape.largest_unit_numel == shape.largest_block_numel
    else:
        assert shape.root_numel == hidden
        assert shape.largest_unit_numel == vocab * hidden
    block, embed, e = shape.largest_block_numel, vocab * hidden, 2
    assert shape.unit_numels == ((block, block) if tied else (embed, block, block, embed))  # the forward's order
    assert (shape.head_unit, shape.tied) == (not tied, tied)
    root = shape.root_numel
    # bench/memory_rehearsal.py measures these moments at Qwen2.5-0.5B's and 7B's widths (within 0.1%)
    forward, at_head = mp.forward_gathered_bytes(shape, e, fsdp=2)
    first, rest, end = mp.backward_gathered_bytes(shape, e)
    if tied:  # the first block's copy-out beside the root's all-gather output and parameters
        assert (forward, at_head) == ((2 * root + 2 * block) * e, (root + block) * e)
        # the root, the head's weight gradient; the second block's backward beside the first's
        # reduce-scatter input and the prefetched first block; the end: 4 embedding-sized and that input
        assert first == (root + embed + block) * e
        assert rest == max((root + embed) * e + 4 * block + 2 * e * block,  # the second's backward
                           (root + embed) * e + (e + 4) * block + e * block)  # the first's post-backward
        assert end == max(e * root + 3 * e * embed + 4 * block, (e + 4) * root)
    else:  # the head's copy-out beside the last block's all-gather output
        assert (forward, at_head) == ((root + block + 2 * embed) * e, (root + 2 * embed) * e)
        assert first == root * e + 2 * e * embed + e * block  # the head, its gradient, the last block prefetched
        # the last block's backward beside the head's reduce-scatter input; the embedding's post-backward
        assert rest == max(root * e + 4 * embed + 2 * e * block + e * block, root * e + (e + 4) * embed)
        assert end == (e + 4) * root
    assert mp.gathered_bytes(shape, e, backward=False) == forward
    assert mp.gathered_bytes(shape, e, backward=True) == max(forward, at_head, first, rest, end)


def test_update_counts_the_logits_gradient_and_the_accumulated_gradient():
    """The update's head: the saved logits, their gradient (compute dtype) and three float32 chunks (no more on
    the way back through the temperature); a no-grad forward: the logits and three chunks. Gradients: the fp32 shard, plus under
    accumulate_unsharded_grads the whole model's fp32 gradient, held between micro batches."""
    from mesh_utils import UpdateSpec

    shape = mp.ModelShape(param_shapes=[(128, 256), (256,)], hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32,
                          intermediate=704, vocab=128, largest_block_numel=1000)
    positions = 4 * 3584  # packed: micro x R response positions
    chunk = 1024 * 128 * 4
    phases = mp.phase_bytes(_inputs(shape), 0)
    # the update's largest moment is the log-prob backward's: the logits, their gradient and three chunks,
    # nothing gathered
    assert phases["update"]["log_prob_chunk"] == 2 * positions * 128 * 2 + 3 * chunk
    assert phases["update"]["gathered_blocks"] == 0
    assert phases["log_prob"]["log_prob_chunk"] == 8 * 3584 * 128 * 2 + 3 * chunk
    assert mp.logprob_chunk_bytes(shape, 10, 2, backward=True) == 2 * 10 * 128 * 2 + 3 * 10 * 128 * 4
    assert mp.logprob_chunk_bytes(shape, 10, 2) == 10 * 128 * 2 + 3 * 10 * 128 * 4
    full = (128 * 256 + 256) * 4
    for fsdp in (1, 8):
        shard = mp.param_shard_bytes(shape, fsdp, 0)
        assert mp.phase_bytes(_inputs(shape, fsdp=fsdp), 0)["update"]["actor.grads"] == shard
        held = mp.phase_bytes(_inputs(shape, fsdp=fsdp, accumulate_unsharded_grads=True), 0)["update"]["actor.grads"]
        assert held == shard + full
    spec = dict(epochs=1, mini_batch_size=8, max_token_len=None, shuffle=False, loss_agg_mode="token-mean",
                use_remove_padding=True, grad_clip=1.0)
    assert mp._holds_unsharded_grads(UpdateSpec(micro_batch_size=4, accumulate_unsharded_grads=True, **spec))
    assert not mp._holds_unsharded_grads(UpdateSpec(micro_batch_size=8, accumulate_unsharded_grads=True, **spec))
    assert not mp._holds_unsharded_grads(UpdateSpec(micro_batch_size=4, **spec))


# --- the planner ------------------------------------------------------------------------------------


def planner_output(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """memory_plan.py's stdout for argv, run in this process (main(argv), what the script runs: the CLI's own exit
    status and streams are test_planner_without_a_model_prints_the_layout_and_refuses_a_bad_config's)."""
    capsys.readouterr()
    assert mp.main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_planner_prints_the_memory_plan(tiny_assets, tmp_path, capsys):
    # padded forwards: their activations are linear in the tokens, which checkpointing cuts most
    common = ["--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
              "actor_rollout_ref.model.use_remove_padding=false"]
    memory = json.loads(planner_output(capsys, "--json", *common))["memory"]
    shape = mp.model_shape(str(tiny_assets["tiny-qwen2"]))
    ranks = memory["per_fsdp_rank"]
    for rank, phases in enumerate(ranks):
        assert phases["update"]["actor.params"] == mp.param_shard_bytes(shape, len(ranks), rank)
        assert phases["update"]["actor.grads"] == phases["update"]["actor.params"]
    assert memory["fits"] is True and memory["verdict"].startswith("fits")
    # a device a little too small for the update's activations: the verdict names the key and a value
    update = memory["per_fsdp_rank"][0]["update"]
    # (checkpointing keeps each block's input and one block's recompute, and the padded rows' masks: here it
    # frees about 40% of the activations)
    limit_gb = (sum(update.values()) - update["activations"] / 4) / mp.GIB
    small = json.loads(planner_output(capsys, "--json", *common, "--gpu-memory-gb", str(limit_gb)))["memory"]
    assert small["fits"] is False
    assert "set actor_rollout_ref.model.enable_gradient_checkpointing=true" in small["verdict"], small["verdict"]
    out = planner_output(capsys, *common, "--gpu-memory-gb", "0.001")
    assert "does not fit" in out and "set actor_rollout_ref." in out
    # no config.json: a clear message, and the rest of the plan still prints
    out = planner_output(capsys, "--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={tmp_path / 'nowhere'}")
    assert "Device map" in out and "cannot read the config.json of actor_rollout_ref.model.path" in out


def test_planner_without_a_model_prints_the_layout_and_refuses_a_bad_config(capsys):
    """No config.json at hand: the layout (mesh_utils.py's text) and the reason there is no memory plan;
    a bad layout exits 1 with the reason before any model is read."""
    seed = ["--config", "configs/gsm8k_grpo_1node_6gpu.yaml"]
    layout = run([sys.executable, "mesh_utils.py", *seed]).stdout
    out = planner_output(capsys, *seed, "actor_rollout_ref.model.path=/nowhere")
    assert out.startswith(layout) and "Memory plan: no memory plan: cannot read" in out
    proc = run([sys.executable, "memory_plan.py", *seed, "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
               check=False)
    assert proc.returncode == 1 and "tensor_model_parallel_size=4" in proc.stderr and proc.stdout == ""


def test_apply_moves_walks_a_step_on_the_cpu():
    """The trainer's executor on a real FSDP2 model and AdamW: every move of a step with every flag
    on is a no-op on the CPU (the same plan, nothing to move), values stay bit-exact, and an item it
    cannot move is an error."""
    from torch.distributed.fsdp import fully_shard

    import models

    with one_rank_process_group():
        model = fully_shard(torch.nn.Linear(4, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        before = [t.detach().to_local().clone() for t in model.parameters()]
        flags = dict(offload.flag_combinations())["param_offload + optimizer_offload + ref param_offload"]
        slept = []
        previous = offload.LOADED
        for phase in ("sync", "generate", "log_prob", "update", "sync"):
            models.apply_moves(offload.plan_moves(flags, previous, phase), {"actor": model, "critic": None},
                               {"actor": optimizer, "critic": None}, torch.device("cpu"),
                               sleep_engine=lambda phase=phase: slept.append(phase))
            previous = phase
        assert slept == ["log_prob"]  # the engine sleeps once a step, entering the forwards
        assert all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters(), strict=True))
        assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
        with pytest.raises(ValueError, match="actor.grads"):
            models.apply_moves([("actor.grads", "host")], {"actor": model}, {}, torch.device("cpu"))


def test_planner_refuses_a_tensor_parallel_degree_vllm_refuses(tmp_path, capsys):
    """Qwen2.5-7B's heads (28 query, 4 KV, MLP 18944) at TP=8: vLLM refuses 28 heads over 8 ranks at engine
    start; the planner says so from config.json alone, with the degrees that work (1, 2, 4)."""
    import make_assets

    path = tmp_path / "qwen2.5-7b-heads"
    make_assets.model_config("qwen2", hidden=28 * 32, layers=1, heads=28, kv_heads=4, intermediate=18944,
                             tied=False).save_pretrained(path)
    args = ["--config", "configs/gsm8k_grpo_1node_6gpu.yaml", "trainer.n_gpus_per_node=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            f"actor_rollout_ref.model.path={path}"]
    assert mp.main([*args, "actor_rollout_ref.rollout.tensor_model_parallel_size=8"]) == 1
    err = capsys.readouterr().err
    assert "tensor_model_parallel_size=8 cannot shard" in err and "Valid values up to 64: 1, 2, 4." in err, err
    assert mp.main([*args, "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]) == 0
    assert "Memory plan" in capsys.readouterr().out


def test_reward_model_is_counted_like_the_reference(tiny_assets):
    """reward_model.enable: its shards on the device in every phase unless offloaded (never moved), and its
    forward in the generate phase, where it scores, growing with its micro batch."""
    from config import load_config
    from mesh_utils import validate

    def plan(*overrides: str) -> list[dict]:
        cfg = load_config("configs/tiny_cpu.yaml", [f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
                                                    *overrides])
        dims, batches = validate(cfg, 2)
        return mp.memory_report(cfg, dims, batches, 80.0)["per_fsdp_rank"]

    rm = ["reward_model.enable=true", f"reward_model.model.path={tiny_assets['tiny-qwen2']}"]
    shape = mp.model_shape(str(tiny_assets["tiny-qwen2"]), value_head=True)
    none, offloaded = plan(), plan(*rm, "reward_model.micro_batch_size_per_gpu=4")
    on_device = plan(*rm, "reward_model.model.fsdp_config.param_offload=false", "reward_model.micro_batch_size_per_gpu=16")
    for rank in range(2):
        for phase in offload.PHASES:
            assert none[rank][phase]["reward_model.params"] == offloaded[rank][phase]["reward_model.params"] == 0
            assert on_device[rank][phase]["reward_model.params"] == mp.param_shard_bytes(shape, 2, rank)
            assert (offloaded[rank][phase]["reward_model.forward"] > 0) == (phase == "generate")
        assert 0 < offloaded[rank]["generate"]["reward_model.forward"] < on_device[rank]["generate"]["reward_model.forward"]
    flags = offload.OffloadFlags(reward_model_param=False)
    assert ("reward_model.params", "host") not in offload.plan_moves(flags, offload.LOADED, "generate")


def test_teacher_is_counted_like_the_reference(tiny_assets, tmp_path):
    """distillation.enabled: the teacher's shards on the device in every phase unless offloaded (never moved),
    its LM head in the log_prob phase when it is the larger one, and forward_kl_topk's k log-probs and ids per
    response token kept in the batch through the update. A teacher too large to fit is answered with its
    param_offload key."""
    import json

    from config import load_config
    from mesh_utils import validate

    teacher = tmp_path / "teacher"  # config.json is all the planner reads: a wider model, a padded vocabulary
    teacher.mkdir()
    config = json.loads((tiny_assets["tiny-qwen2"] / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(dict(config, vocab_size=4096, hidden_size=256,
                                                         intermediate_size=512)))

    def plan(*overrides: str, gpu_gb: float = 80.0) -> dict:
        cfg = load_config("configs/tiny_cpu.yaml", [f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
                                                    *overrides])
        dims, batches = validate(cfg, 2)
        return mp.memory_report(cfg, dims, batches, gpu_gb)

    distill = ["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}"]
    shape = mp.model_shape(str(teacher))
    none, on_device = plan()["per_fsdp_rank"], plan(*distill)["per_fsdp_rank"]
    offloaded = plan(*distill, "distillation.teacher_models.teacher_model.fsdp_config.param_offload=true")["per_fsdp_rank"]
    topk = plan(*distill, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                "distillation.distillation_loss.topk=5")["per_fsdp_rank"]
    for rank in range(2):
        for phase in offload.PHASES:
            assert none[rank][phase]["teacher.params"] == offloaded[rank][phase]["teacher.params"] == 0
            assert on_device[rank][phase]["teacher.params"] == mp.param_shard_bytes(shape, 2, rank) > 0
            # 32 prompts x 8 samples / 2 ranks = 128 per rank, x 12 response tokens x 5 x (float32 + int64)
            assert topk[rank][phase]["teacher.topk"] == (128 * 12 * 5 * 12 if phase in ("log_prob", "update") else 0)
            assert on_device[rank][phase]["teacher.topk"] == 0
        assert on_device[rank]["log_prob"]["log_prob_chunk"] > none[rank]["log_prob"]["log_prob_chunk"]  # 4096 > 128
        assert on_device[rank]["update"]["log_prob_chunk"] == none[rank]["update"]["log_prob_chunk"]  # the actor's
    assert ("teacher.params", "host") not in offload.plan_moves(offload.OffloadFlags(), offload.LOADED, "generate")
    cfg = load_config("configs/tiny_cpu.yaml", [f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}", *distill])
    m = mp.memory_inputs(cfg, *validate(cfg, 2), 80.0)
    remedies = dict(mp._remedies(m, "log_prob", on_device[0]["log_prob"], 1000, 64))
    assert remedies["distillation.teacher_models.teacher_model.fsdp_config.param_offload=true"] == \
        on_device[0]["log_prob"]["teacher.params"]


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "lots"])
def test_the_device_memory_must_be_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        mp.main(["--config", "configs/tiny_cpu.yaml", "--gpu-memory-gb", value])
    assert exit_.value.code == 2
    assert "must be the device's memory in GiB, a number > 0" in capsys.readouterr().err


def test_a_separate_rollout_pool_plans_each_role(tiny_assets):
    """hybrid_engine=false: the trainers' phases hold no engine (theirs never wakes), a rollout rank holds the
    collocated plan's engine (weights and KV cache) and one broadcast bucket; too large an engine names its key."""
    from config import load_config
    from mesh_utils import validate

    split = ["actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
             "actor_rollout_ref.rollout.nnodes=1", "trainer.v1.separate_async.parameter_sync_step=2",
             "trainer.v1.separate_async.num_warmup_batches=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
             "trainer.save_freq=-1"]

    def plan(*overrides: str, world: int, gpu_gb: float = 80.0) -> dict:
        cfg = load_config("configs/tiny_cpu.yaml", [f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
                                                    *overrides])
        dims, batches = validate(cfg, world)
        return mp.memory_report(cfg, dims, batches, gpu_gb)

    together, apart = plan(world=2), plan(*split, world=4)
    assert together["rollout_rank"] is None
    for phase in offload.PHASES:
        assert apart["per_fsdp_rank"][0][phase]["engine.weights"] == apart["per_fsdp_rank"][0][phase]["engine.kv_cache"] == 0
        assert apart["per_fsdp_rank"][0][phase]["actor.params"] == together["per_fsdp_rank"][0][phase]["actor.params"]
    pool = apart["rollout_rank"]
    assert pool["engine.weights"] == together["per_fsdp_rank"][0]["generate"]["engine.weights"]
    assert pool["engine.kv_cache"] == together["per_fsdp_rank"][0]["generate"]["engine.kv_cache"]
    assert pool["sync_bucket"] > 0
    tight = plan(*split, world=4, gpu_gb=1e-4)  # less than the weights
    assert not tight["fits"] and "actor_rollout_ref.rollout.gpu_memory_utilization" in tight["verdict"]
    assert "rollout rank, GiB" in mp.describe_memory(apart)
    # a reward model scores on the pool: sharded over its 2 ranks there, as over the 2 collocated ranks; none on
    # the trainers; its forward or the sync bucket, whichever is larger (the bucket is freed before it scores)
    rm = ["reward_model.enable=true", f"reward_model.model.path={tiny_assets['tiny-qwen2']}",
          "reward_model.model.fsdp_config.param_offload=false", "reward_model.micro_batch_size_per_gpu=16"]
    together_rm, apart_rm = plan(*rm, world=2), plan(*split, *rm, world=4)
    for phase in offload.PHASES:
        assert apart_rm["per_fsdp_rank"][0][phase]["reward_model.params"] == 0
        assert apart_rm["per_fsdp_rank"][0][phase]["reward_model.forward"] == 0
    pool_rm, rm_generate = apart_rm["rollout_rank"], together_rm["per_fsdp_rank"][0]["generate"]
    assert pool_rm["reward_model.params"] == rm_generate["reward_model.params"] > 0
    assert pool_rm["sync_bucket"] + pool_rm["reward_model.forward"] == max(pool["sync_bucket"],
                                                                          rm_generate["reward_model.forward"])
    beside_engine = sum(v for k, v in pool_rm.items() if not k.startswith("engine."))
    squeezed = plan(*split, *rm, world=4, gpu_gb=beside_engine / (1 - 0.3) * 0.99 / mp.GIB)  # 0.3: the engine's
    assert not squeezed["fits"] and "reward_model.model.fsdp_config.param_offload" in squeezed["verdict"]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_activations_within_10_percent(arch):
    """memory_plan.vision_activation_bytes against the tensors autograd saves in a VLM's vision tower (two images
    of different sizes, a tower wider than the test assets'), float32 and bf16, with and without checkpointing."""
    from transformers import AutoModelForImageTextToText

    import make_assets

    config = make_assets.vl_config(arch)
    vision = config.vision_config
    vision.depth, vision.num_heads = 2, 4
    if arch == "qwen2_vl":
        vision.embed_dim, vision.mlp_ratio = 256, 4
    else:
        vision.hidden_size, vision.intermediate_size, vision.fullatt_block_indexes = 256, 688, [1]
    grid = torch.tensor([[1, 16, 24], [1, 8, 8]])
    patches = int(grid.prod(-1).sum())
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa").train()
        shape = mp.vision_shape(model)
        tower = model.model.visual
        pixels = torch.randn(patches, shape.patch_dim, dtype=dtype, generator=torch.Generator().manual_seed(0))
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            measured = saved_bytes_of(tower, functools.partial(tower, pixels, grid_thw=grid), checkpointing,
                                      blocks=list(tower.blocks))
            estimate = mp.vision_activation_bytes(shape, patches, dtype.itemsize, checkpointing)
            assert abs(estimate - measured) / measured <= 0.10, (dtype, checkpointing, estimate, measured)
