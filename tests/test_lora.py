"""LoRA (lora.py) on 2 real gloo ranks, against peft and transformers in one plain process:

  * the FSDP2 actor built with an adapter on the meta device holds the checkpoint's base weights bit
    for bit, and only the adapter is trainable and has optimizer state;
  * the reference (the actor with the adapter disabled) gives the log-probs of a separately loaded
    base model, while the actor with its trained adapter does not;
  * the engine's weights (iter_sync_params) equal peft's own merge_and_unload of a plain copy holding
    the same adapter; the partial sync sends the targets and their fused siblings only, same values;
  * a checkpoint holds the adapter and its optimizer state only, and loading it restores both exactly.
Then one GRPO run with LoRA on the demo task (real vLLM), and its exports (merged, adapter-only) read
back by transformers, peft and vLLM.
"""

import json
import math
import sys
from pathlib import Path

import noise
import pytest
import torch
import torch.distributed as dist
from conftest import clean_env, forward_batch, run, run_gloo, short_run
from short_runs import LORA_STEPS

WORLD = 2
CASES = {"tiny-qwen2": ["q_proj", "v_proj", "down_proj"], "tiny-llama-tied": "all-linear"}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM's Qwen2/Llama
OPTIM = dict(lr=1e-2, betas=[0.9, 0.999], weight_decay=0.0, total_training_steps=-1, lr_warmup_steps=0,
             lr_warmup_steps_ratio=0.0, warmup_style=None, lr_scheduler_type="constant", min_lr_ratio=0.0)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, optim_sd = get_state_dict(model, optimizer)
    return {f"{name}.{key}": _full(value).clone() for name, state in optim_sd["state"].items()
            for key, value in state.items()}


def _train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    import models

    model.train()
    log_probs = models.compute_log_probs(model, batch, 1.0, 3).log_probs
    (-log_probs.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, paths: dict[str, str], init_file: str, ckpt_root: str, out: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import lora
    import models
    from checkpoint import load_checkpoint, save_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        kwargs = dict(device=torch.device("cpu"), param_dtype=torch.float32, reduce_dtype=torch.float32)
        result = {}
        for name, path in paths.items():
            spec = lora.LoraSpec.from_config({"lora_rank": 4, "lora_alpha": 8.0, "target_modules": CASES[name],
                                              "lora_adapter_path": None, "path": path})
            torch.manual_seed(0)
            actor = models.load_causal_lm(path, mesh, wrap=spec.add_adapter, **kwargs)
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            r = result[name] = {}
            params = dict(actor.named_parameters(remove_duplicate=False))
            r["trainable"] = sorted(n for n, p in actor.named_parameters() if p.requires_grad)
            r["all"] = sorted(params)
            base_params = {lora.hf_name(n): _full(p) for n, p in params.items() if ".lora_" not in n}
            want = dict(base.named_parameters(remove_duplicate=False))
            r["base_equal"] = set(base_params) == set(want) and all(torch.equal(base_params[n], want[n])
                                                                      for n in want)
            r["tied"] = actor.get_output_embeddings().weight is actor.get_input_embeddings().weight
            batch = forward_batch(base.config.vocab_size)
            optimizer, sched = models.make_optimizer(actor, OPTIM, 10)
            names = {id(p): n for n, p in actor.named_parameters()}
            for _ in range(2):
                _train_step(actor, batch, optimizer)
            r["optimizer_params"] = sorted(names[id(p)] for p in optimizer.state)
            actor.eval()
            with torch.no_grad():
                with actor.disable_adapter():
                    reference = models.compute_log_probs(actor, batch, 1.0, 3).log_probs
                trained = models.compute_log_probs(actor, batch, 1.0, 3).log_probs
                plain = models.compute_log_probs(base, batch, 1.0, 3).log_probs
            r["ref_vs_base"] = (reference - plain).abs().max().item()
            r["actor_vs_base"] = (trained - plain).abs().max().item()

            # the engine's weights against peft's own merge of a plain copy with the same adapter
            synced = {n: t.clone() for n, t in lora.iter_sync_params(actor, torch.float32)}
            adapter = {n: _full(p) for n, p in params.items() if ".lora_" in n}
            copy = spec.add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
            copy.load_state_dict(adapter, strict=False)
            merged = dict(copy.merge_and_unload().named_parameters(remove_duplicate=False))
            r["sync_names"] = sorted(synced) == sorted(merged)
            r["sync_max_diff"] = max((synced[n] - merged[n]).abs().max().item() for n in merged)
            r["sync_moved"] = sum(not torch.equal(synced[n], want[n]) for n in want)
            partial = dict(lora.iter_sync_params(actor, torch.float32, lora.sync_modules(actor, PACKED)))
            r["partial_names"] = sorted(partial)
            r["partial_equal"] = all(torch.equal(partial[n], synced[n]) for n in partial)

            # lora_adapter_path: a new actor starts from the trained adapter, saved by peft (rank 0 writes it)
            adapter_dir = Path(ckpt_root) / f"{name}-adapter"
            if rank == 0:
                copy_with_adapter = spec.add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
                copy_with_adapter.load_state_dict(adapter, strict=False)
                copy_with_adapter.save_pretrained(adapter_dir)
            dist.barrier()
            resumed_spec = lora.LoraSpec.from_config({"lora_rank": 0, "lora_alpha": 1.0, "target_modules": "all-linear",
                                                      "lora_adapter_path": str(adapter_dir), "path": path})
            resumed = models.load_causal_lm(path, mesh, wrap=resumed_spec.add_adapter, **kwargs)
            resumed_params = {n: _full(p) for n, p in resumed.named_parameters() if p.requires_grad}
            r["from_adapter_path"] = (resumed_spec.rank, resumed_spec.alpha, resumed_spec.target_modules,
                                      resumed_params.keys() == adapter.keys()
                                      and all(torch.equal(resumed_params[n], adapter[n]) for n in adapter))
            del resumed

            # checkpoint: adapter + its optimizer state; a later step is undone by loading it
            ckpt_models = {"actor": (actor, optimizer, sched)}
            ckpt = save_checkpoint(Path(ckpt_root) / name, 2, ckpt_models, {}, hf_source=lora.lora_config(actor))
            saved_adapter, saved_optim = dict(adapter), _optim_state(actor, optimizer)
            _train_step(actor, batch, optimizer)
            r["step_moved_adapter"] = any(not torch.equal(_full(params[n]), saved_adapter[n]) for n in saved_adapter)
            load_checkpoint(ckpt, ckpt_models)
            r["adapter_restored"] = all(torch.equal(_full(params[n]), saved_adapter[n]) for n in saved_adapter)
            restored = _optim_state(actor, optimizer)
            r["optim_restored"] = restored.keys() == saved_optim.keys() and all(
                torch.equal(restored[k], saved_optim[k]) for k in saved_optim)
            r["ckpt_model_keys"] = sorted(k for k in FileSystemReader(str(ckpt / "actor")).read_metadata()
                                          .state_dict_metadata if k.startswith("model."))
            r["adapter_config"] = json.loads((ckpt / "hf" / "adapter_config.json").read_text())
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def lora_results(tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    paths = {name: str(tiny_assets[name]) for name in CASES}
    run_gloo(_worker, WORLD, paths, str(tmp / "init"), str(tmp / "ckpt"), str(tmp / "out.pt"), timeout_s=300)
    return torch.load(tmp / "out.pt"), paths


@pytest.mark.parametrize("name", list(CASES))
def test_only_the_adapter_is_trained(lora_results, name):
    r = lora_results[0][name]
    adapter = [n for n in r["all"] if ".lora_A." in n or ".lora_B." in n]
    assert adapter and r["trainable"] == sorted(adapter)
    assert r["optimizer_params"] == sorted(adapter)  # no Adam state for the frozen base weights
    assert r["base_equal"]  # the base weights are the checkpoint's, bit for bit
    assert r["tied"] == (name == "tiny-llama-tied")
    if CASES[name] == "all-linear":  # every linear layer of the blocks, never the LM head
        assert not any("lm_head" in n for n in adapter)
        assert {n.split(".")[-4] for n in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_the_base_model(lora_results, name):
    r = lora_results[0][name]
    assert r["ref_vs_base"] < 1e-5
    assert r["actor_vs_base"] > 1e-3  # the trained adapter changed the actor, so the check can fail


@pytest.mark.parametrize("name", list(CASES))
def test_sync_sends_merged_weights(lora_results, name):
    r = lora_results[0][name]
    assert r["sync_names"] and r["sync_max_diff"] < 1e-6
    assert r["sync_moved"] > 0  # the merged weights are not the base ones
    targets = CASES[name] if isinstance(CASES[name], list) else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"]
    # the fused siblings of a target come along (q_proj brings k_proj and v_proj: vLLM's qkv_proj)
    expected_modules = {m for t in targets for group in [*PACKED.values(), [t]] if t in group for m in group}
    assert {n.split(".")[-2] for n in r["partial_names"]} == expected_modules
    assert not any(n.startswith(("model.embed_tokens", "model.norm", "lm_head")) or "layernorm" in n
                   for n in r["partial_names"])
    assert r["partial_equal"]


@pytest.mark.parametrize("name", list(CASES))
def test_start_from_a_saved_adapter(lora_results, name):
    """lora_adapter_path: the actor starts from a peft adapter on disk, its rank, alpha and targets."""
    rank, alpha, targets, same = lora_results[0][name]["from_adapter_path"]
    assert (rank, alpha) == (4, 8.0) and same
    linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # peft saves all-linear as the modules' full names
    assert {t.split(".")[-1] for t in targets} == set(CASES[name] if isinstance(CASES[name], list) else linear)


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_holds_the_adapter_and_resumes_exactly(lora_results, name):
    r, paths = lora_results[0][name], lora_results[1]
    assert r["ckpt_model_keys"] and all(".lora_" in k for k in r["ckpt_model_keys"])
    assert r["step_moved_adapter"] and r["adapter_restored"] and r["optim_restored"]
    assert r["adapter_config"]["base_model_name_or_path"] == paths[name]
    assert r["adapter_config"]["r"] == 4 and r["adapter_config"]["lora_alpha"] == 8.0


# ---------------------------------------------------------------------------------------------
# End to end: GRPO with LoRA on the demo task


VLLM_ADAPTER = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, merged, adapter, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
tok = AutoTokenizer.from_pretrained(merged)
ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
def greedy(model):
    out = []
    for i in ids:
        gen = model.generate(torch.tensor([i]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, len(i):], skip_special_tokens=True))
    return out
hf_merged = greedy(AutoModelForCausalLM.from_pretrained(merged).eval())
hf_peft = greedy(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval())
llm = LLM(model=base, dtype="float32", enforce_eager=True, max_model_len=64, gpu_memory_utilization=0.3,
          enable_lora=True, max_lora_rank=8)
res = llm.generate([{"prompt_token_ids": i} for i in ids],
                   SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok.eos_token_id]),
                   lora_request=LoRARequest("trained", 1, adapter), use_tqdm=False)
vllm_adapter = [tok.decode(r.outputs[0].token_ids, skip_special_tokens=True) for r in res]
print("RESULT" + json.dumps({"merged": hf_merged, "peft": hf_peft, "vllm": vllm_adapter}))
"""


@pytest.mark.slow
@pytest.mark.short_run("lora")
def test_lora_grpo_learns_and_exports(sft_model, short_runs, tmp_path):
    """The demo task with a rank-8 adapter on every linear layer, the KL loss to the reference (the
    adapter disabled) and the KL in the reward (tests/short_runs.py's lora case): the training score rises;
    every step's sync check holds (the first sync sends every weight, later ones the merged target modules
    only); the policy moves away from the reference; the final checkpoint exports as a merged model and as a
    peft adapter that transformers, peft and vLLM all read back to the run's own validation answers.

    Noise (tests/noise.py): the training score's trend over LORA_STEPS steps has a standard error of ~0.02
    (the per-step score moves by ~0.05 around it); measured on an AMD EPYC (Zen 4) over 160 steps: 0.15
    (13.0 standard errors), 0.10 (8.2), 0.14 (9.6) (make learning-caps: the EPYC's own kernels, ATen at AVX2, ATen's default with MKL and oneDNN at AVX2). The reference: actor/reward_kl_penalty is the KL of the policy
    before each update to the reference. With the adapter disabled it grows as the adapter trains (0.01-0.1
    from step 10 on); were the reference the actor itself (the adapter left on), it would be 0 up to float
    rounding (< 1e-6) at every step. Asserted: its mean over the second half of the run, 4 standard errors
    (over those steps) above 1e-3; measured 0.036 (20 standard errors), 0.041 (15), 0.053 (29) under the
    same three kernels, and exactly 0 under the mutation (tests/mutations.py) under each."""
    out, steps = short_run(short_runs, "lora"), LORA_STEPS
    from tracking import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    assert len([r for r in rows if "val/score" in r]) == 2
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == steps
    noise.assert_above(*noise.trend([r["critic/score/mean"] for r in trained]), 0.0, "the training score's rise")
    for r in trained:
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # the engine samples from the merged actor
        assert r["actor/skipped_steps"] == 0 and math.isfinite(r["actor/kl_loss"]) and r["timing_s/ref"] > 0
    kl = [r["actor/reward_kl_penalty"] for r in trained[steps // 2:]]
    noise.assert_above(*noise.mean_and_se(kl), 1e-3, "the KL of the policy to the reference (adapter off)")

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run([sys.executable, "export_hf.py", str(out), "--out", str(merged)])
    run([sys.executable, "export_hf.py", str(out), "--out", str(adapter), "--adapter-only"])
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    expected = [json.loads(line) for f in (out / "val_generations").glob(f"{steps}.jsonl")
                for line in f.read_text().splitlines()][:16]
    proc = run([sys.executable, "-c", VLLM_ADAPTER, str(sft_model), str(merged), str(adapter),
                json.dumps([r["input"] for r in expected])], timeout=600,
               env=clean_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"))
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    want = [r["output"] for r in expected]
    assert got["merged"] == want and got["peft"] == want and got["vllm"] == want, (got, want)


# ---------------------------------------------------------------------------------------------
# The memory plan and the 7B one-GPU config


QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False)


def test_lora_config_plan_fits_one_80gb_gpu(tmp_path):
    """configs/gsm8k_grpo_lora_1gpu.yaml on Qwen2.5-7B's shapes (its config.json, written here): the plan
    fits 80 GB, with AdamW state and gradients for the adapter only (its size counted by hand: r x (in + out)
    per linear layer) and no reference copy; the same job with full fine-tuning does not fit."""
    from transformers import Qwen2Config

    Qwen2Config(**QWEN25_7B).save_pretrained(tmp_path / "qwen7b")
    common = [sys.executable, "memory_plan.py", "--json", "--config", "configs/gsm8k_grpo_lora_1gpu.yaml",
              "--gpu-memory-gb", "80", f"actor_rollout_ref.model.path={tmp_path / 'qwen7b'}"]
    lora_plan = json.loads(run(common).stdout)["memory"]
    full_plan = json.loads(run([*common[:-1], "actor_rollout_ref.model.lora_rank=0", common[-1]]).stdout)["memory"]
    assert lora_plan["fits"] is True, lora_plan["verdict"]
    assert full_plan["fits"] is False, full_plan["verdict"]
    h, i, kv, layers, rank = 3584, 18944, 4 * 128, 28, 64
    linear = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    adapter_numel = layers * rank * sum(a + b for a, b in linear)
    update = lora_plan["per_fsdp_rank"][0]["update"]
    assert update["actor.grads"] == adapter_numel * 4
    assert update["actor.optimizer"] == 2 * adapter_numel * 4 + 4 * 2 * 7 * layers  # + a float32 step per tensor
    assert update["ref.params"] == 0 < full_plan["per_fsdp_rank"][0]["update"]["ref.params"]
    assert full_plan["per_fsdp_rank"][0]["update"]["actor.optimizer"] > 40 * update["actor.optimizer"]


@pytest.mark.parametrize("keys, fragment", [
    ({"lora_rank": -1}, "lora_rank=-1"),
    ({"target_modules": "attention"}, "target_modules='attention'"),
    ({"target_modules": []}, "target_modules=[]"),
    ({"lora_alpha": 0.0}, "lora_alpha=0.0"),
    ({"lora_rank": 0, "lora_adapter_path": "/nowhere"}, "lora_adapter_path='/nowhere'"),
])
def test_bad_lora_keys_name_the_key(keys, fragment):
    import lora
    from config import ConfigError

    model_cfg = {"lora_rank": 8, "lora_alpha": 16.0, "target_modules": "all-linear", "lora_adapter_path": None,
                 "path": "assets/tiny-qwen2", **keys}
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        lora.LoraSpec.from_config(model_cfg)
    off = {**model_cfg, "lora_rank": 0, "lora_alpha": 16.0, "target_modules": "all-linear", "lora_adapter_path": None}
    assert lora.LoraSpec.from_config(off) is None  # lora_rank=0: full fine-tuning
