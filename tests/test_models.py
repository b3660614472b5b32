"""models.load_causal_lm / load_value_model on 2 real gloo ranks, against transformers' own
from_pretrained of the same checkpoint in one process: every full parameter (DTensor.full_tensor())
and every buffer (the rotary inv_freq is in no checkpoint) bit for bit, for an untied Qwen2 and a
tied Llama; the critic's body equals the checkpoint and its head is zero. Then compute_log_probs
on the sharded actor, and its gradients after FSDP's reduce-scatter, against the plain model."""

import pytest
import torch
import torch.distributed as dist
from conftest import forward_batch, run_gloo
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

WORLD = 2
MODELS = ("tiny-qwen2", "tiny-llama-tied")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ: missing on either side, or not bit-identical (dtype included)."""
    bad = sorted(set(got) ^ set(want))
    bad += [n for n in sorted(set(got) & set(want))
            if got[n].dtype != want[n].dtype or not torch.equal(got[n].cpu(), want[n].cpu())]
    return bad


def _gathered_units(model: torch.nn.Module) -> list[str]:
    """The FSDP units whose parameters are gathered (unsharded) now, by module name ('' for the root)."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)
                  and any(g.is_unsharded for g in m._get_fsdp_state()._fsdp_param_groups))


def _worker(rank: int, paths: dict[str, str], init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import models

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        kwargs = dict(device=torch.device("cpu"), param_dtype=torch.float32, reduce_dtype=torch.float32)
        result = {}
        for name, path in paths.items():
            actor = models.load_causal_lm(path, mesh, **kwargs)
            critic = models.load_value_model(path, mesh, **kwargs)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            result[name] = {
                "units": sorted(n for n, m in actor.named_modules() if isinstance(m, FSDPModule)),
                "sharded": all(hasattr(p, "full_tensor") for p in actor.parameters()),
                "tied": actor.get_output_embeddings().weight is actor.get_input_embeddings().weight,
                "params": _same({n: _full(p) for n, p in actor.named_parameters(remove_duplicate=False)},
                                dict(reference.named_parameters(remove_duplicate=False))),
                "buffers": _same(dict(actor.named_buffers(remove_duplicate=False)),
                                 dict(reference.named_buffers(remove_duplicate=False))),
            }
            value_ref = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32, num_labels=1)
            critic_params = {n: _full(p) for n, p in critic.named_parameters()}
            head = {n for n in critic_params if n.startswith(("score.", "classifier."))}
            result[name]["critic_head"] = sorted(head)
            result[name]["critic_head_zero"] = all(not critic_params[n].any() for n in head)
            result[name]["critic_body"] = _same({n: t for n, t in critic_params.items() if n not in head},
                                                {n: p for n, p in value_ref.named_parameters() if n not in head})
            result[name]["critic_buffers"] = _same(dict(critic.named_buffers()), dict(value_ref.named_buffers()))
            # no dropout anywhere in the critic: values in train() equal values in eval()
            result[name]["critic_dropout"] = sorted({m.p for m in critic.modules() if isinstance(m, torch.nn.Dropout)})
            with torch.no_grad():
                critic.train()
                train_values = models.compute_values(critic, forward_batch(critic.config.vocab_size), 3)
                critic.eval()
                eval_values = models.compute_values(critic, forward_batch(critic.config.vocab_size), 3)
            result[name]["critic_train_equals_eval"] = torch.equal(train_values, eval_values)

            # The sharded forward and backward against the plain model on the same rows; every rank
            # holds the same rows, so FSDP's averaged gradient is the plain model's.
            batch = forward_batch(reference.config.vocab_size)
            weights = torch.linspace(-1.0, 1.0, 5)  # (R,) a loss that is not symmetric in the positions
            seen: list[list[str]] = []  # the units gathered as the last block starts its forward
            hook = models.decoder_layers(actor)[-1].register_forward_pre_hook(
                lambda *_, seen=seen, actor=actor: seen.append(_gathered_units(actor)))
            forward = models.compute_log_probs(actor, batch, 0.7, micro_batch_size=2, calc_entropy=True)
            log_probs, entropy = forward.log_probs, forward.entropy
            hook.remove()
            result[name]["gathered_in_forward"] = seen[0]
            (log_probs * weights).sum().backward()
            ref_out = models.compute_log_probs(reference, batch, 0.7, micro_batch_size=3, calc_entropy=True)
            ref_lp, ref_entropy = ref_out.log_probs, ref_out.entropy
            (ref_lp * weights).sum().backward()
            result[name]["log_probs"] = (log_probs.detach(), ref_lp.detach())
            result[name]["entropy"] = (entropy.detach(), ref_entropy.detach())
            result[name]["grads"] = [(n, _full(p.grad), q.grad) for (n, p), q in zip(
                actor.named_parameters(), reference.parameters(), strict=True)]
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tiny_assets, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("models")
    paths = {name: str(tiny_assets[name]) for name in MODELS}
    run_gloo(_worker, WORLD, paths, str(tmp / "pg"), str(tmp / "result"), timeout_s=300)
    return [torch.load(tmp / f"result.{r}") for r in range(WORLD)]


@pytest.mark.parametrize("name", MODELS)
def test_load_equals_from_pretrained(ranks, name):
    for rank, result in enumerate(ranks):
        r = result[name]
        assert r["sharded"], (rank, "parameters are not DTensors: the model was not sharded")
        assert r["tied"] == (name == "tiny-llama-tied"), (rank, r["tied"])
        assert r["params"] == [], (rank, "parameters differ from from_pretrained", r["params"])
        assert r["buffers"] == [], (rank, "buffers differ from from_pretrained", r["buffers"])


@pytest.mark.parametrize("name", MODELS)
def test_untied_embedding_and_head_are_units_of_their_own(ranks, name):
    """Untied, the embedding and the LM head are FSDP units of their own, so neither is gathered while
    the decoder blocks run (the root keeps only the final norm); tied, the one embedding parameter
    stays in the root, gathered from the root's first forward to the end of its backward."""
    layers = [f"model.layers.{i}" for i in range(2)]
    for rank, result in enumerate(ranks):
        r = result[name]
        if name == "tiny-llama-tied":
            assert r["units"] == sorted(["", *layers]), (rank, r["units"])
        else:
            assert r["units"] == sorted(["", "lm_head", "model.embed_tokens", *layers]), (rank, r["units"])
        assert r["gathered_in_forward"] == ["", layers[-1]], (rank, r["gathered_in_forward"])


@pytest.mark.parametrize("name", MODELS)
def test_value_model_is_checkpoint_body_with_zero_head(ranks, name):
    for rank, result in enumerate(ranks):
        r = result[name]
        assert r["critic_head"] == ["score.bias", "score.weight"] and r["critic_head_zero"], (rank, r["critic_head"])
        assert r["critic_body"] == [] and r["critic_buffers"] == [], (rank, r["critic_body"], r["critic_buffers"])
        assert r["critic_dropout"] in ([], [0.0]) and r["critic_train_equals_eval"], (rank, r["critic_dropout"])


@pytest.mark.parametrize("name", MODELS)
def test_sharded_log_probs_and_grads_equal_plain_model(ranks, name):
    for rank, result in enumerate(ranks):
        r = result[name]
        for key in ("log_probs", "entropy"):
            got, want = r[key]
            assert got.shape == (3, 5) and torch.equal(got, want), (rank, key, (got - want).abs().max())
        for param, got, want in r["grads"]:
            assert want.abs().max() > 0, (param, "the reference gradient is zero: the loss does not reach it")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, p=param: f"{p}: {m}")
