"""bench/memory_rehearsal.py: its live-storage account against hand counts, the rehearsal at Qwen2.5-0.5B's
real width and vocabulary on a fake world of 6 against the memory plan, and the GPU check's imports on a
machine without vLLM."""

import json
import sys

import pytest
import torch
from conftest import ROOT, run

sys.path.insert(0, str(ROOT / "bench"))
import memory_rehearsal  # noqa: E402


def test_live_bytes_counts_each_storage_once_until_it_is_freed():
    with memory_rehearsal.LiveBytes() as live:
        x = torch.empty(1000)  # 4000 bytes
        view = x[10:]  # the same storage: nothing more
        assert live.current == 4000
        del x
        assert live.current == 4000  # the view keeps it alive
        del view
        assert (live.current, live.peak) == (0, 4000)
        y = torch.empty(256)
        y.untyped_storage().resize_(0)  # how FSDP2 frees an unsharded parameter, outside the dispatcher
        assert live.current == 0
        y.untyped_storage().resize_(4096)  # and allocates it again
        assert live.current == 4096
        live.reset()
        assert live.peak == 4096
        # autograd: a, its gradient, and what sin saves (its input, a * 2), against a hand count
        a = torch.randn(100, 100, requires_grad=True)
        b = (a * 2).sin().sum()
        assert live.current == 4096 + 2 * 40000 + 4  # a, a * 2 (saved by sin), the sum
        b.backward()
        del b
        assert live.current == 4096 + 2 * 40000  # the graph freed a * 2; a.grad is new
    assert torch.UntypedStorage.resize_ is live._resize  # restored on exit


def rehearse(tmp_path, samples: int, micro: int) -> dict:
    out = tmp_path / f"rehearsal_{samples}_{micro}.json"
    run([sys.executable, str(ROOT / "bench" / "memory_rehearsal.py"), "--case", "0.5b:6", "--layers", "1",
         "--prompt-len", "16", "--response-len", "32", "--samples", str(samples), "--micro-batch", str(micro),
         "--out", str(out)], timeout=600)
    [case] = json.loads(out.read_text())["cases"]
    return case


@pytest.mark.slow
def test_rehearsal_is_within_15_percent_of_the_plan(tmp_path):
    """One mini batch in one micro batch: every phase's peak within 15% of memory_plan's total, and the terms
    the plan once missed are there: the sync gathers the whole tied embedding (151936 x 896, bf16), the
    forwards hold the root unit (that embedding) gathered."""
    case = rehearse(tmp_path, samples=2, micro=2)
    assert case["world"] == 6 and case["measure"] == "live storages" and case["old_log_probs_from"] == "update"
    embedding_bf16 = 151936 * 896 * 2
    phases = case["phases"]
    assert phases["sync"]["measured_transient"] > embedding_bf16
    assert phases["log_prob"]["measured_transient"] > 2 * embedding_bf16
    for phase, row in phases.items():
        # the shards and Adam state exactly, plus the rotary buffers and the batch (a few KiB)
        planned_resident = row["planned_resident"] - row["planned_items"]["actor.grads"]  # no gradients yet
        assert 0 <= row["measured_resident"] - planned_resident < 2**16, phase
        assert abs(row["ratio"] - 1) <= 0.15, (phase, row["ratio"])


@pytest.mark.slow
def test_rehearsal_update_with_several_micro_batches_is_within_15_percent(tmp_path):
    """A micro batch of one sample: two no-grad forwards in the log_prob phase (the second's units unshard
    beside the first's logits) and two update micro batches (the second's with the first's gradients)."""
    case = rehearse(tmp_path, samples=2, micro=1)
    assert case["batch"]["micro_batch"] == 1 and case["batch"]["samples_per_rank"] == 2
    for phase, row in case["phases"].items():
        assert abs(row["ratio"] - 1) <= 0.15, (phase, row["ratio"])


def test_gpu_check_imports_without_vllm():
    """The GPU machine has torch, transformers, accelerate and peft, and no vLLM (nor datasets, pandas,
    pyarrow, matplotlib): the GPU check's whole module graph imports there."""
    code = ("import sys\n"
            "for name in ('vllm', 'datasets', 'pandas', 'pyarrow', 'matplotlib'):\n"
            "    sys.modules[name] = None  # import fails\n"
            f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
            "import device_check, memory_rehearsal\n"
            "assert not any(m.split('.')[0] == 'vllm' for m, v in sys.modules.items() if v is not None)\n"
            "print('imported')\n")
    proc = run([sys.executable, "-c", code], timeout=300)
    assert proc.stdout.strip().endswith("imported")


def vl_rehearsal_config(tmp_path, arch: str, *overrides: str):
    """The flagship config on a VLM with a tower wider than its language model (the tower's terms dominate),
    on rows whose prompts each hold two 112 x 112 images (2 x 64 patches, 32 image tokens)."""
    import functools

    import make_assets
    from config import load_config

    model_dir = tmp_path / arch
    config = make_assets.vl_config(arch)
    vision = config.vision_config
    vision.depth, vision.num_heads = 2, 4
    if arch == "qwen2_vl":
        vision.embed_dim, vision.mlp_ratio = 256, 4
    else:
        vision.hidden_size, vision.intermediate_size, vision.fullatt_block_indexes = 256, 688, [1]
    config.save_pretrained(model_dir)  # config.json: the rehearsal fills the shards at random
    make_assets.vl_image_processor().save_pretrained(model_dir)

    def rows(num: int, seed: int) -> list[dict]:
        out = make_assets.shape_rows(num, seed, size=112)
        for row in out:
            row["images"] = row["images"] * 2
            row["prompt"][0]["content"] = "<image><image>" + row["prompt"][0]["content"].removeprefix("<image>")
        return out

    data = make_assets.write_splits(tmp_path / "data", functools.partial(rows), 4, 2, 0)
    return load_config(memory_rehearsal.FLAGSHIP, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}",
        f"data.val_files={data['val']}", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "data.max_prompt_length=48",
        "data.max_response_length=16", "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *overrides])


# One case in the suite (seconds). The same check on the others, run by hand (2026-12-04), planned / measured
# without the shards, log_prob / update: Qwen2.5-VL without checkpointing 1.08 / 1.02; Qwen2-VL with
# checkpointing 1.05 / 0.91, and with its tower frozen under it 1.05 / 0.85.
VL_CASES = [("qwen2_vl", ("actor_rollout_ref.model.enable_gradient_checkpointing=false",))]


@pytest.mark.parametrize("arch,overrides", VL_CASES, ids=["qwen2_vl"])
def test_a_vl_plan_is_within_15_percent_of_its_rehearsal(arch, overrides, vl_assets, tmp_path):
    """A VLM's plan (its tower's shards, gradients and AdamW state, the pixels held, the tower's activations,
    the images read from the data's headers) against the trainer's phases run in this process as rank 0 of 2
    (memory_rehearsal.rehearse_config, live storages, about 7 s): each phase within 15%; the shards and AdamW
    state exactly (plus the pixels the batch holds from the log-prob phase on); what is not shards, where the
    tower's activations and the pixels are most of it, within 8% without checkpointing (measured 0.99-1.05) and
    25% with it (under it the update is planned 9-15% low: not explained yet)."""
    cfg = vl_rehearsal_config(tmp_path, arch, *overrides)
    case = memory_rehearsal.rehearse_config(cfg, 2, torch.device("cpu"))
    assert case["phases"]["update"]["planned_items"]["pixels"] > 0
    for phase, row in case["phases"].items():
        items = row["planned_items"]
        shards = items["actor.params"] + items["actor.optimizer"] + items["ref.params"]
        held = items["pixels"] and 4 * 128 * 1176 * 4  # the batch column: 4 samples of 2 x 64 patches, float32
        assert 0 <= row["measured_resident"] - shards - held < 2**16, phase
        assert abs(row["ratio"] - 1) <= 0.15, (phase, row["ratio"])
        if phase != "sync":
            tolerance = 0.25 if cfg.actor_rollout_ref.model.enable_gradient_checkpointing else 0.08
            assert abs((row["planned"] - shards) / (row["measured"] - shards) - 1) <= tolerance, (phase, row)
