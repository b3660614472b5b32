"""train_ppo.py end to end with Ulysses sequence parallelism: 2 GRPO steps on 2 real torchrun/gloo
ranks, sp=2 on the rollout's TP=2 group (the meshes compose), packed forwards cut by token budgets,
a KL loss to the reference model (whose forward is sequence-parallel too), the real vLLM CPU engine.
vLLM's logprobs of its own samples must equal the actor's packed, sequence-parallel forward; both
ranks train on all 256 samples (one sp group), so each sample counts once; the groups each rank
joined are the planner's."""

import json

import pytest
from test_train_ppo import assert_common, assert_learning_signal, step_rows, tiny, train

from config import load_config
from mesh_utils import plan_device_map, validate

OVERRIDES = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
             # a sample is at most 16 + 12 tokens: micro batches of a few samples, 1/2 of their tokens per rank
             "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=300", "actor_rollout_ref.actor.use_kl_loss=true",
             # the sp ranks must shuffle alike: different micro batches on them would not even line up
             "actor_rollout_ref.actor.shuffle=true",
             "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=0"]


@pytest.mark.slow
def test_grpo_with_sequence_parallel(tiny_assets, sft_model, tmp_path):
    out = tmp_path / "run"
    args = ["--config", "configs/tiny_cpu.yaml", *tiny(tiny_assets, out, sft_model), *OVERRIDES]
    train(2, args)
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert_common(rows, prompts=32, samples=256)  # rollout/logprob_diff_max < 1e-3: the sp forward is exact
    assert_learning_signal(rows)
    # the reference starts as the actor; the actor moves away from it over the 2 x 2 optimizer steps
    assert all(r["actor/kl_loss"] >= 0 for r in rows) and rows[1]["actor/kl_loss"] > 0

    dims, plan = validate(load_config(args[1], args[2:]), 2)
    device_map = plan_device_map(dims)
    assert rows[0]["batch/ppo_mini_batch_size_per_rank"] == plan.actor_update.mini_batch_size == 128  # 16 x 8 / 1
    for rank in range(2):
        layout = json.loads((out / "layout" / f"rank{rank}.json").read_text())
        for key, groups in (("sp_group", device_map.sp_groups), ("train_dp_group", device_map.train_dp_groups),
                            ("fsdp_group", device_map.fsdp_groups), ("rollout_tp_group", device_map.rollout_tp_groups)):
            assert layout[key] == next(g for g in groups if rank in g), (rank, key, layout[key])
    assert [json.loads((out / "layout" / f"rank{r}.json").read_text())["sp_group"] for r in range(2)] == [[0, 1]] * 2
