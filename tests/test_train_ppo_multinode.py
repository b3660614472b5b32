"""Two nodes on one machine: two torchrun agents (`--nnodes=2`, c10d rendezvous on a free local port),
each the "node" of a 2 x 2 job with rollout TP=2, run the real training program end to end.

Checked: two training steps finish and log the planned batch; every rank joined exactly the groups the
planner's `plan_device_map` gives for the same config, on the node it gives (each TP pair inside one
node, FSDP across both); and a launch whose processes per node disagree with the config stops with the
config error naming the key before any model is loaded.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import clean_env, torchrun_cmd

from config import load_config
from mesh_utils import plan_device_map, validate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"
NNODES, NPROC_PER_NODE, TP = 2, 2, 2
# 8 prompts -> 2 rollout groups x 4 -> x n=2 = 16 samples -> 4 per rank; one mini batch, one micro batch
TRAIN = [
    f"trainer.nnodes={NNODES}", f"trainer.n_gpus_per_node={NPROC_PER_NODE}",
    f"actor_rollout_ref.rollout.tensor_model_parallel_size={TP}",
    "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
]
FAILED_NODE_GRACE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(nproc_per_node: int, overrides: list[str], log_dir: Path, timeout: float) -> list[tuple[int, str]]:
    """Start one torchrun per node at once, as srun would on two hosts; (exit code, output) per node."""
    port, rdzv_id = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    env = clean_env()
    procs, logs = [], []
    for node in range(NNODES):
        # No --node_rank: the c10d rendezvous numbers the nodes itself (as under srun).
        cmd = torchrun_cmd(nproc_per_node, "train_ppo.py", "--config", CONFIG, *overrides,
                           launcher=(f"--nnodes={NNODES}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                                     f"--rdzv_id={rdzv_id}"))
        log = open(log_dir / f"node{node}.log", "w")  # a file, not a pipe: vLLM logs would fill a pipe
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    # Wait for both; once one node has failed, the other may hang waiting for its peers: give it
    # FAILED_NODE_GRACE_S to notice, then stop it.
    deadline, start = time.monotonic() + timeout, time.monotonic()
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAILED_NODE_GRACE_S)
        if time.monotonic() > deadline:
            for p in procs:  # each torchrun leads its own session: stop it and the workers it started
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        try:
            next(p for p in procs if p.poll() is None).wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    for log in logs:
        log.close()
    note = f"\n[test: nodes exited {[p.returncode for p in procs]} after {time.monotonic() - start:.0f} s]"
    return [(p.returncode, (log_dir / f"node{i}.log").read_text() + note) for i, p in enumerate(procs)]


@pytest.fixture(scope="module")
def two_node_run(tiny_assets, tmp_path_factory) -> dict:
    """One 2 x 2 training launch for the whole module (the expensive part: four vLLM engines)."""
    run_dir = tmp_path_factory.mktemp("run")
    # The untrained tiny-qwen2 is enough: this is about plumbing, not learning.
    overrides = [f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}",
                 f"data.train_files={tiny_assets['train']}", f"data.val_files={tiny_assets['val']}",
                 f"trainer.default_local_dir={run_dir}", *TRAIN]
    started = time.monotonic()
    results = launch_nodes(NPROC_PER_NODE, overrides, tmp_path_factory.mktemp("logs"), timeout=480)
    print(f"2 x {NPROC_PER_NODE} training launch: {time.monotonic() - started:.0f} s")
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{output[-6000:]}"
    return {"run_dir": run_dir, "overrides": overrides, "outputs": [out for _, out in results]}


@pytest.mark.slow
def test_two_nodes_train_two_steps(two_node_run):
    lines = (two_node_run["run_dir"] / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["batch/num_prompts"] == 8
        assert s["batch/num_samples"] == 16
        assert s["batch/ppo_mini_batch_size_per_rank"] == 4  # 8 prompts x n=2 / 4 ranks
        assert 0 < s["response_length/mean"] <= 12  # data.max_response_length of the tiny config


@pytest.mark.slow
def test_each_rank_joined_the_planned_groups_on_the_planned_node(two_node_run):
    dims, _ = validate(load_config(str(ROOT / CONFIG), two_node_run["overrides"]))
    planned = plan_device_map(dims)
    world = NNODES * NPROC_PER_NODE
    files = sorted((two_node_run["run_dir"] / "layout").glob("rank*.json"))
    assert len(files) == world
    layout = {r["rank"]: r for r in (json.loads(f.read_text()) for f in files)}
    assert sorted(layout) == list(range(world))
    for rank, got in layout.items():
        member = lambda groups: next(g for g in groups if rank in g)  # noqa: B023, E731
        assert got["node_rank"] == planned.node_of_rank[rank], (rank, got)
        assert got["fsdp_group"] == member(planned.fsdp_groups), (rank, got)
        assert got["rollout_tp_group"] == member(planned.rollout_tp_groups), (rank, got)
        assert got["rollout_dp_rank"] == planned.rollout_tp_groups.index(got["rollout_tp_group"]), (rank, got)
    # Both agents took part, each with its own node's ranks, and no TP group crosses a node.
    assert sorted(r["node_rank"] for r in layout.values()) == [0, 0, 1, 1]
    for group in planned.rollout_tp_groups:
        assert len({layout[r]["node_rank"] for r in group}) == 1, group
    assert len({layout[r]["node_rank"] for r in planned.fsdp_groups[0]}) == NNODES  # FSDP spans both nodes


@pytest.mark.parametrize("config_nodes,expected", [
    # world 2 = 1 x 2 as planned, but 1 process per node: a TP pair would cross the network
    ("trainer.nnodes=1", "torchrun launched 1 processes on this node but trainer.n_gpus_per_node=2"),
    # world 2, planned 2 x 2 = 4
    ("trainer.nnodes=2", "trainer.nnodes x trainer.n_gpus_per_node = 2 x 2 = 4"),
])
def test_processes_per_node_mismatch_fails_before_any_model_loads(tmp_path, config_nodes, expected):
    run_dir = tmp_path / "run"
    # A model path that does not exist: had the program got as far as loading it, it would fail
    # with a different error than the one asserted below.
    overrides = [config_nodes, "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 f"actor_rollout_ref.model.path={tmp_path / 'no-such-model'}", f"trainer.default_local_dir={run_dir}"]
    results = launch_nodes(1, overrides, tmp_path, timeout=180)
    for node, (code, output) in enumerate(results):
        assert code != 0, f"node {node} accepted a launch that does not match the config:\n{output[-3000:]}"
        assert "config error:" in output and expected in output, output[-3000:]
        assert re.search(r"exitcode\s*:\s*2\b", output), output[-3000:]  # train_ppo.py's config-error exit
    assert not (run_dir / "layout").exists(), "meshes were built before the launch was checked"
