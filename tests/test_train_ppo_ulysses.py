"""train_ppo.py end to end with Ulysses sequence parallelism: 2 GRPO steps on 2 real torchrun/gloo
ranks, sp=2 on the rollout's TP=2 group (the meshes compose), packed forwards cut by token budgets,
a KL loss to the reference model (whose forward is sequence-parallel too), the real vLLM CPU engine.
vLLM's logprobs of its own samples must equal the actor's packed, sequence-parallel forward; both
ranks train on all 256 samples (one sp group), so each sample counts once; the groups each rank
joined are the planner's."""

import json

import pytest
from conftest import short_run
from short_runs import CASES
from test_train_ppo import assert_common, assert_learning_signal, step_rows

from config import load_config
from mesh_utils import plan_device_map, validate


@pytest.mark.slow
@pytest.mark.short_run("ulysses")
def test_grpo_with_sequence_parallel(short_runs):
    """tests/short_runs.py's ulysses case."""
    out = short_run(short_runs, "ulysses")
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert_common(rows, prompts=32, samples=256)  # rollout/logprob_diff_max < 1e-3: the sp forward is exact
    assert_learning_signal(rows)
    # the reference starts as the actor; the actor moves away from it over the 2 x 2 optimizer steps
    assert all(r["actor/kl_loss"] >= 0 for r in rows) and rows[1]["actor/kl_loss"] > 0

    config_path, overrides = CASES["ulysses"]
    dims, plan = validate(load_config(config_path, overrides), 2)
    device_map = plan_device_map(dims)
    assert rows[0]["batch/ppo_mini_batch_size_per_rank"] == plan.actor_update.mini_batch_size == 128  # 16 x 8 / 1
    for rank in range(2):
        layout = json.loads((out / "layout" / f"rank{rank}.json").read_text())
        for key, groups in (("sp_group", device_map.sp_groups), ("train_dp_group", device_map.train_dp_groups),
                            ("fsdp_group", device_map.fsdp_groups), ("rollout_tp_group", device_map.rollout_tp_groups)):
            assert layout[key] == next(g for g in groups if rank in g), (rank, key, layout[key])
    assert [json.loads((out / "layout" / f"rank{r}.json").read_text())["sp_group"] for r in range(2)] == [[0, 1]] * 2
