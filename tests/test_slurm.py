"""The sbatch wrappers under a real SLURM: `launch/slurm_local.sh` starts munged, slurmctld and two
slurmd (two node names on this host) in a temp dir, the tests submit the wrappers as a user would and
read the job's state, log, metrics and layout files, and the fixture stops the daemons by pid.

Skipped unless pytest gets --slurm (`make test-slurm`): it needs root, and installs SLURM and munge
with apt-get when they are missing. Three training runs (one node x 2 ranks, two nodes x 1 rank, and a split
job of two nodes x 1 rank: a trainer node and a rollout node) of 2 steps each on the raw tiny model: the
wrappers are under test here, not learning.
"""

import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from test_launch import job_env

pytestmark = pytest.mark.slurm

STEPS = 2


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def start_cluster(env: dict[str, str], nodes: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "launch" / "slurm_local.sh"), "start", str(nodes)], env=env,
                          capture_output=True, text=True, timeout=600)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    """A local SLURM cluster of two nodes (of one where two cannot run on this host: the script says
    why, and the multi-node test skips with that reason). Its daemons are stopped by pid afterwards,
    whatever happened: a failed start, a failed test, Ctrl-C or SIGTERM (as from `timeout`)."""
    state = tmp_path_factory.mktemp("slurm")
    port = free_ports(3)  # slurmctld, then one per slurmd
    env = job_env(SLURM_LOCAL_DIR=str(state / "cluster"), SLURMCTLD_PORT=str(port), SLURMD_PORT=str(port + 1))
    previous_handler = signal.signal(signal.SIGTERM, interrupt)
    try:
        nodes = 2
        proc = start_cluster(env, nodes)
        refused = ""
        if proc.returncode != 0 and f"cannot run {nodes} nodes on this host" in proc.stderr:
            nodes, refused = 1, proc.stderr.strip()
            proc = start_cluster(env, nodes)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield {"env": {**env, "SLURM_CONF": str(state / "cluster" / "slurm.conf")}, "dir": state / "cluster",
               "nodes": nodes, "multinode_refused": refused}
    finally:
        stop = subprocess.run(["bash", str(ROOT / "launch" / "slurm_local.sh"), "stop"], env=env,
                              capture_output=True, text=True, timeout=120)
        signal.signal(signal.SIGTERM, previous_handler)
        assert stop.returncode == 0, stop.stdout + stop.stderr


def submit(cluster: dict, tmp_path: Path, script: str, sbatch_args: list[str], train_args: list[str],
           **env: str) -> str:
    """sbatch from the repository root, the job log into tmp_path; returns the job id."""
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%x-%j.out", *sbatch_args,
                           f"launch/{script}", *train_args],
                          cwd=ROOT, env={**cluster["env"], **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_for_job(cluster: dict, job_id: str, timeout_s: float = 400) -> dict[str, str]:
    """Poll `scontrol show job` (no accounting database here) until the job ends; its fields."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=cluster["env"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=cluster["env"], timeout=30)
            pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout_s:.0f} s")
        time.sleep(1)


def job_log(tmp_path: Path) -> str:
    (log,) = tmp_path.glob("slurm-*.out")
    return log.read_text()


def steps_launched(cluster: dict, job_id: str) -> dict[str, int]:
    """How many tasks of the job's steps each slurmd launched, from the slurmd logs."""
    return {log.name: len(re.findall(rf"launch task StepId={job_id}\.\d+ ", log.read_text()))
            for log in sorted(cluster["dir"].glob("slurmd-*.log"))}


def tiny_args(tiny_assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """configs/tiny_cpu.yaml on the raw tiny model and the temp-dir data, STEPS steps."""
    return ["configs/tiny_cpu.yaml", f"trainer.total_training_steps={STEPS}",
            f"actor_rollout_ref.model.path={tiny_assets['tiny-qwen2']}", f"data.train_files={tiny_assets['train']}",
            f"data.val_files={tiny_assets['val']}", f"trainer.default_local_dir={out}", *extra]


def check_training_run(out: Path, log: str, nodes: int, nproc: int) -> None:
    """STEPS steps logged by rank 0, metrics for each, one layout file per rank on the planned node."""
    assert f"step {STEPS}/{STEPS} |" in log, log[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in trained] == list(range(1, STEPS + 1))
    assert all(m["batch/num_samples"] == 32 * 8 for m in trained)  # tiny_cpu: train_batch_size x rollout.n
    layout = sorted((json.loads(p.read_text()) for p in (out / "layout").glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["node_rank"]) for r in layout] == [(i, i // nproc) for i in range(nodes * nproc)]


def test_1node_wrapper_trains(cluster, tiny_assets, tmp_path):
    out = tmp_path / "out"
    job = submit(cluster, tmp_path, "slurm_1node.sbatch", ["--gpus-per-node=0", "--cpus-per-task=2"],
                 tiny_args(tiny_assets, out), NGPU="2")
    state = wait_for_job(cluster, job)
    log = job_log(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert re.search(rf"config configs/tiny_cpu.yaml: 1 node x 2 processes on \S+, job {job}\n", log)
    assert "Device map: 1 node(s) x 2 devices = world 2" in log
    check_training_run(out, log, nodes=1, nproc=2)
    assert sum(steps_launched(cluster, job).values()) == 1  # one srun task: one torchrun


def test_multinode_wrapper_trains(cluster, tiny_assets, tmp_path):
    if cluster["nodes"] < 2:
        pytest.skip(cluster["multinode_refused"])
    out = tmp_path / "out"
    job = submit(cluster, tmp_path, "slurm_multinode.sbatch", ["--gpus-per-node=0", "--cpus-per-task=1"],
                 tiny_args(tiny_assets, out), NGPU="1")
    state = wait_for_job(cluster, job)
    log = job_log(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert re.search(rf"2 node\(s\) x 1 processes, rendezvous \S+:{29400 + int(job) % 1000}, job {job}", log)
    check_training_run(out, log, nodes=2, nproc=1)
    # One torchrun on each node, started by that node's slurmd.
    assert list(steps_launched(cluster, job).values()) == [1, 1]


def test_multinode_wrapper_runs_a_split_job_with_a_node_of_rollout(cluster, tiny_assets, tmp_path):
    """Two nodes x 1 process, actor_rollout_ref.rollout.nnodes=1: the wrapper gives the trainers one node
    (trainer.nnodes=1) and the rollout pool the other; one step off, with a checkpoint at each step (the batch
    generated ahead in the first). Rank 0 trains on one node, rank 1 generates on the other."""
    if cluster["nodes"] < 2:
        pytest.skip(cluster["multinode_refused"])
    out = tmp_path / "out"
    split = ["actor_rollout_ref.hybrid_engine=false", "trainer.v1.trainer_mode=separate_async",
             "actor_rollout_ref.rollout.nnodes=1", "trainer.v1.separate_async.parameter_sync_step=2",
             "trainer.v1.separate_async.num_warmup_batches=1", "algorithm.rollout_correction.rollout_is=token",
             "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1"]
    job = submit(cluster, tmp_path, "slurm_multinode.sbatch", ["--gpus-per-node=0", "--cpus-per-task=1"],
                 tiny_args(tiny_assets, out, *split), NGPU="1")
    state = wait_for_job(cluster, job)
    log = job_log(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert "split: trainers on 1 node(s), the rollout pool on 1 (actor_rollout_ref.rollout.nnodes)" in log, log
    check_training_run(out, log, nodes=2, nproc=1)
    assert list(steps_launched(cluster, job).values()) == [1, 1]
    layout = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (out / "layout").glob("rank*.json")}
    assert layout[0]["node_rank"] != layout[1]["node_rank"]
    roles = {r: (out / "logs" / f"rank{r}.progress").read_text().split("\n", 1)[0] for r in (0, 1)}
    assert " role=trainer " in roles[0] and " role=rollout " in roles[1], roles
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/off_policy/trajectory_staleness/mean"] for r in rows if "actor/pg_loss" in r] == [0, 1]
    ahead = json.loads((out / "global_step_1" / "trainer_state.json").read_text())["generated_ahead"]
    assert set(ahead["rows"]["rollout_versions"]["values"]) - {-1} == {0}  # step 2's batch, sampled by version 0


def test_refused_config_fails_the_job_before_srun(cluster, tiny_assets, tmp_path):
    """A rollout TP group of 3 on 2 processes: the planner refuses it, the job fails, srun never runs."""
    job = submit(cluster, tmp_path, "slurm_1node.sbatch", ["--gpus-per-node=0", "--cpus-per-task=1"],
                 tiny_args(tiny_assets, tmp_path / "out", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"),
                 NGPU="2")
    state = wait_for_job(cluster, job, timeout_s=120)
    log = job_log(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0"), log
    assert "invalid config: actor_rollout_ref.rollout.tensor_model_parallel_size=3" in log, log
    assert sum(steps_launched(cluster, job).values()) == 0, "srun ran although the planner refused the config"
    assert not (tmp_path / "out").exists()


def test_a_preempted_job_saves_requeues_and_finishes(cluster, tiny_assets, tmp_path):
    """SLURM's early warning (what `--signal=B:USR2@600` sends before the time limit or a preemption, here
    sent at once with scancel): every rank saves after its step and exits, the job requeues itself, and
    the requeued job resumes from that checkpoint and finishes: no step lost, none repeated."""
    out, steps = tmp_path / "out", 4
    job = submit(cluster, tmp_path, "slurm_1node.sbatch", ["--gpus-per-node=0", "--cpus-per-task=2",
                                                           "--open-mode=append"],
                 tiny_args(tiny_assets, out, f"trainer.total_training_steps={steps}"), NGPU="2")
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
    while not (metrics.is_file() and '"step": 1' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=cluster["env"], check=True, timeout=30)
    state = wait_for_job(cluster, job, timeout_s=900)
    log = job_log(tmp_path)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert int(state["Restarts"]) == 1, state
    assert "SLURM asked to stop early" in log and "as asked (" in log, log[-6000:]
    saved = re.search(r"stopping after step (\d+) as asked", log)
    assert saved and f"resumed from {out}/global_step_{saved.group(1)}" in log, log[-6000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    trained = [r["step"] for r in rows if "actor/pg_loss" in r]
    assert trained == list(range(1, steps + 1))  # each step once, across the requeue
