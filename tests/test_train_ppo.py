"""train_ppo.py end to end: real torchrun/gloo process groups, the real vLLM CPU engine, real files.

Each launch pays an engine start-up per rank, so each checks as much as it can from its metrics file:
  GRPO, world 2, TP 2   (the TP-group gather of GRPO's group baselines, validation, the plot)
  GAE + KL, world 2     (critic, reference model, KL in reward with an adaptive controller, KL loss)
  the seed's 6-rank job (60 prompts -> 720 samples -> 120 per rank), two steps on a tiny model
  a learning check      (the demo's task, short: the validation score must rise)
Config errors are checked with plain `python` runs: they must fail before any model loads.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run, torchrun

from mesh_utils import plan_device_map, validate
from tracking import read_metrics


def train(nproc: int, args: list[str], timeout: int = 900) -> None:
    torchrun(nproc, "train_ppo.py", *args, timeout=timeout)


def tiny(assets: dict, out: Path, model: Path | None = None) -> list[str]:
    return [f"actor_rollout_ref.model.path={model or assets['tiny-qwen2']}", f"data.train_files={assets['train']}",
            f"data.val_files={assets['val']}", f"trainer.default_local_dir={out}"]


def step_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


def assert_common(rows: list[dict], prompts: int, samples: int) -> None:
    for r in rows:
        assert r["batch/num_prompts"] == prompts and r["batch/num_samples"] == samples
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean", "perf/throughput",
                    "timing_s/gen", "timing_s/sync_weights", "timing_s/update_actor", "response_length/mean"):
            assert math.isfinite(r[key]), (key, r[key])
        # the sync check: vLLM's logprobs of its own samples equal the actor's (float32 on CPU)
        assert r["rollout/logprob_diff_max"] < 1e-3
        assert r["actor/skipped_steps"] == 0


def test_grpo_tp2(tiny_assets, tmp_path):
    out = tmp_path / "grpo"
    train(2, ["--config", "configs/tiny_cpu.yaml", *tiny(tiny_assets, out),
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.total_training_steps=3",
                 "trainer.test_freq=3", "data.max_val_samples=16"])
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_common(rows, prompts=32, samples=256)
    assert "val/score" in rows[-1] and rows[-1]["val/num_samples"] == 16
    assert read_metrics(out / "metrics.jsonl")[0]["step"] == 0  # val_before_train
    assert (out / "metrics.png").stat().st_size > 0
    layouts = [json.loads((out / "layout" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [lay["rollout_tp_group"] for lay in layouts] == [[0, 1], [0, 1]]


def test_gae_with_kl(tiny_assets, tmp_path):
    out = tmp_path / "gae"
    train(2, ["--config", "configs/tiny_cpu.yaml", *tiny(tiny_assets, out), "algorithm.adv_estimator=gae",
                 "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                 "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1"])
    rows = step_rows(out)
    assert len(rows) == 2
    assert_common(rows, prompts=32, samples=256)
    for r in rows:
        for key in ("critic/vf_loss", "critic/grad_norm", "timing_s/values", "timing_s/ref", "timing_s/update_critic",
                    "actor/kl_loss", "actor/reward_kl_penalty", "actor/entropy_loss"):
            assert math.isfinite(r[key]), key
    # before any update the reference equals the actor, so the first step's KL penalty is ~0
    assert abs(rows[0]["actor/reward_kl_penalty"]) < 1e-5
    assert rows[1]["actor/reward_kl_penalty_coeff"] != 0.001  # the adaptive controller moved


@pytest.mark.slow
def test_seed_six_rank_job(tiny_assets, tmp_path):
    """The seed's 6-GPU config, as is but for a tiny model: its metrics show the seed's numbers."""
    out = tmp_path / "seed"
    args = ["--config", "configs/gsm8k_grpo_1node_6gpu.yaml", *tiny(tiny_assets, out), "data.max_prompt_length=16",
            "data.max_response_length=8", "trainer.total_training_steps=2", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.actor.optim.lr=1e-4"]
    train(6, args, timeout=1200)
    rows = step_rows(out)
    assert_common(rows, prompts=60, samples=720)
    assert all(r["batch/ppo_mini_batch_size_per_rank"] == 120 for r in rows)
    from config import load_config

    dims, _ = validate(load_config("configs/gsm8k_grpo_1node_6gpu.yaml"), 6)
    groups = plan_device_map(dims).rollout_tp_groups
    for rank in range(6):
        layout = json.loads((out / "layout" / f"rank{rank}.json").read_text())
        assert layout["rollout_tp_group"] == groups[rank // 2] and layout["fsdp_group"] == list(range(6))


@pytest.mark.slow
def test_score_improves(tiny_assets, sft_model, tmp_path):
    """The demo's task, shortened: after 40 GRPO steps the greedy validation score is clearly higher."""
    out = tmp_path / "learn"
    train(2, ["--config", "configs/tiny_cpu.yaml", *tiny(tiny_assets, out, sft_model),
                 "trainer.total_training_steps=40", "trainer.test_freq=40"])
    val = [r["val/score"] for r in read_metrics(out / "metrics.jsonl") if "val/score" in r]
    assert len(val) == 2
    assert val[1] >= val[0] + 0.1, val


def run_python(args: list[str]) -> subprocess.CompletedProcess:
    return run([sys.executable, "train_ppo.py", "--config", "configs/tiny_cpu.yaml", "trainer.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1", *args], timeout=300, check=False)


@pytest.mark.parametrize("case", ["missing_file", "empty_data", "reward_name", "too_long", "layout", "timeout"])
def test_bad_input_fails_before_models_load(case, tiny_assets, tmp_path):
    base = tiny(tiny_assets, tmp_path / "out")
    if case == "missing_file":
        args, expect = [*base, f"data.train_files={tmp_path / 'nope.parquet'}"], "data.train_files"
    elif case == "empty_data":
        import pyarrow as pa
        import pyarrow.parquet as pq

        empty = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
        args, expect = [*base, f"data.train_files={empty}"], "has no rows"
    elif case == "reward_name":
        fn = tmp_path / "my_reward.py"
        fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
        args = [*base, f"custom_reward_function.path={fn}", "custom_reward_function.name=scroe"]
        expect = "custom_reward_function.name='scroe'"
    elif case == "too_long":
        args, expect = [*base, "data.max_prompt_length=500", "data.max_response_length=100"], "max_position_embeddings"
    elif case == "timeout":
        args, expect = [*base, "actor_rollout_ref.nccl_timeout=0"], "actor_rollout_ref.nccl_timeout=0"
    else:
        args, expect = [*base, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size"
    proc = run_python(args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expect in proc.stdout
    assert "config error" in proc.stdout and "Loading weights" not in proc.stdout + proc.stderr
