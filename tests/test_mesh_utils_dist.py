"""Real process groups (torchrun + gloo): every rank's groups, read back from the DeviceMeshes that
`build_meshes` makes, must equal the planner's pure `plan_device_map`, rank by rank."""

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run, torchrun

from config import load_config
from mesh_utils import plan_device_map, validate

WORKER = ROOT / "tests" / "dist_mesh_check.py"
BASE = "data.train_batch_size=12 actor_rollout_ref.actor.ppo_mini_batch_size=6 actor_rollout_ref.rollout.n=2 " \
       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 algorithm.adv_estimator=grpo " \
       "data.train_files=train.parquet"

# world size -> layouts run in one launch (one process group, several mesh sets)
LAYOUTS = {
    1: ["actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
    2: ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
    4: ["actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
    6: ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.actor.fsdp_config.fsdp_size=3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=3 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
}


_CACHE: dict[int, list[dict]] = {}


def run_world(world: int, tmp_path: Path) -> list[dict]:
    """One launch per world size for the whole module (engine-free, but still seconds each)."""
    if world in _CACHE:
        return _CACHE[world]
    layouts = [f"{BASE} {layout}" for layout in LAYOUTS[world]]
    if world == 1:  # a plain python run must work as world size 1, no torchrun
        run([sys.executable, str(WORKER), str(tmp_path), *layouts], timeout=300)
    else:
        torchrun(world, WORKER, str(tmp_path), *layouts, timeout=300)
    _CACHE[world] = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    return _CACHE[world]


def expected_groups(layout: str, world: int, rank: int) -> dict:
    cfg = load_config(None, layout.split() + [f"trainer.n_gpus_per_node={world}"])
    dims, plan = validate(cfg, world)
    dm = plan_device_map(dims)
    member = lambda groups: next(g for g in groups if rank in g)  # noqa: E731
    return {
        "fsdp_group": member(dm.fsdp_groups),
        "ddp_group": member(dm.ddp_groups),
        "rollout_tp_group": member(dm.rollout_tp_groups),
        # the rollout dp dimension: the ranks at the same infer_tp position in every TP group
        "rollout_dp_group": [g[rank % dims.infer_tp] for g in dm.rollout_tp_groups],
        "rollout_dp_rank": next(i for i, g in enumerate(dm.rollout_tp_groups) if rank in g),
        "sp_group": member(dm.sp_groups) if dims.sp > 1 else None,
        "train_dp_group": member(dm.train_dp_groups),
        "ppo_mini_batch_size_per_rank": plan.actor_update.mini_batch_size,
    }


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_meshes_match_planner(world, tmp_path):
    results = run_world(world, tmp_path)
    for rank, res in enumerate(results):
        assert res["world_size"] == world
        assert len(res["layouts"]) == len(LAYOUTS[world])
        for entry in res["layouts"]:
            want = expected_groups(entry["layout"], world, rank)
            for key, value in want.items():
                assert entry[key] == value, (world, rank, entry["layout"], key, entry[key], value)
            # build_meshes(timeout_s=...) reaches every group, not only the default one
            assert entry["group_timeouts_s"] == [1234.0], (world, rank, entry["layout"], entry["group_timeouts_s"])


def test_seed_layouts_on_six_ranks(tmp_path):
    """The seed's named cases, spelled out: fsdp_size -1 / 2 / 3 and the (3,2) rollout mesh."""
    results = run_world(6, tmp_path)
    full, hsdp2, hsdp3, sp2 = (results[0]["layouts"][i] for i in range(4))
    assert full["fsdp_mesh_dims"] == ["fsdp"] and full["fsdp_shape"] == [6]
    assert hsdp2["fsdp_mesh_dims"] == ["ddp", "fsdp"] and hsdp2["fsdp_shape"] == [3, 2]
    assert hsdp3["fsdp_shape"] == [2, 3]
    assert full["rollout_shape"] == [3, 2]
    assert [r["layouts"][0]["rollout_tp_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    assert sp2["sp_shape"] == [3, 2] and sp2["rollout_shape"] == [2, 3]
    assert [r["layouts"][2]["ddp_group"] for r in results] == [[0, 3], [1, 4], [2, 5], [0, 3], [1, 4], [2, 5]]
