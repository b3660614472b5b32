"""train_ppo.py end to end with a rollout pool apart from the trainers (actor_rollout_ref.hybrid_engine=false,
trainer.v1.trainer_mode=separate_async; placement.py): real torchrun / gloo ranks, the real vLLM CPU engine on
every rank (the trainers' idle), the warmed tiny model.

  1 trainer + 1 rollout rank at staleness 0 (separate_async.num_warmup_batches=0) against a collocated 1-rank
  run of the same config: the pool generates and scores the batch, hands it to the trainer, the trainer's
  weights come back to the pool's engine in buckets; the metrics must be the collocated run's, bit for bit
  (timings and memory aside). Both runs use the same kernels on this machine (the same CPU, one process each
  for the model that trains), so the floats can be compared exactly.
  1 + 1 one step off (num_warmup_batches=1), decoupled PPO: tests/dist_split_check.py keeps every weight
  version and finds which one sampled each trained batch: the one a step older than the update's.
"""
import json

import pytest
from conftest import torchrun
from short_runs import TINY
from test_checkpoint import compared
from test_train_ppo import step_rows

# the short runs' TINY on one rank: the whole batch in one mini batch
ONE_RANK = [*TINY, "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.resume_mode=disable"]
SPLIT = ["actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
         "actor_rollout_ref.rollout.nnodes=1", "trainer.v1.separate_async.parameter_sync_step=1"]


def launch(tmp_path, name: str, nproc: int, tiny_assets, sft_model, *overrides: str):
    out = tmp_path / name
    torchrun(nproc, "train_ppo.py", "--config", "configs/tiny_cpu.yaml", f"actor_rollout_ref.model.path={sft_model}",
             f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
             f"trainer.default_local_dir={out}", *ONE_RANK, *overrides)
    return out


@pytest.mark.slow
def test_one_trainer_and_one_rollout_rank_are_the_collocated_run(tmp_path, tiny_assets, sft_model):
    together = step_rows(launch(tmp_path, "collocated", 1, tiny_assets, sft_model))
    apart = step_rows(launch(tmp_path, "split", 2, tiny_assets, sft_model, *SPLIT,
                             "trainer.v1.separate_async.num_warmup_batches=0"))
    assert [r["step"] for r in together] == [r["step"] for r in apart] == [1, 2]
    for a, b in zip(together, apart, strict=True):
        assert {k: b.get(k) for k in compared(a)} == compared(a), a["step"]  # bit for bit
        # the pool's batch was sampled by the weights synced for the step: staleness 0
        assert b["training/off_policy/trajectory_staleness/max"] == 0
        assert b["training/off_policy/stale_token_fraction"] == 0


@pytest.mark.slow
def test_one_step_off_trains_each_batch_sampled_by_the_weights_one_update_old(tmp_path, tiny_assets, sft_model):
    """1 + 1 ranks, num_warmup_batches=1, decoupled PPO: tests/dist_split_check.py keeps every weight version on
    the trainer and recomputes each trained batch's log-probs with them. The version one update older than the
    step's (the first batch: version 0) gives the engine's log-probs (float32, < 1e-4); the step's own version
    does not (the check can tell them apart), and the versions logged say staleness 1 from step 2 on."""
    out = tmp_path / "gaps.json"
    torchrun(2, "tests/dist_split_check.py", str(out), f"actor_rollout_ref.model.path={sft_model}",
             f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
             f"trainer.default_local_dir={tmp_path / 'run'}", *ONE_RANK, *SPLIT,
             "trainer.v1.separate_async.num_warmup_batches=1", "trainer.total_training_steps=3",
             "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0")
    result = json.loads(out.read_text())
    gaps = {int(step): gap for step, gap in result["gaps"].items()}
    assert sorted(gaps) == [1, 2, 3]
    for step, gap in gaps.items():
        assert gap["sampler"] < 1e-4, (step, gap)
    assert gaps[1]["current"] == gaps[1]["sampler"]  # step 1: version 0 is both
    assert all(gaps[step]["current"] > 1e-3 for step in (2, 3)), gaps  # one update moved the actor
    staleness = [m["training/off_policy/trajectory_staleness/mean"] for m in result["metrics"]]
    assert staleness == [0, 1, 1], staleness
