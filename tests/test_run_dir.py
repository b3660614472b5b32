"""The run directory loses nothing (run_dir.py, checkpoint.py's pruning and rewind, tracking's metric file):
the lock between jobs, the config and data a checkpoint was trained with, pruning after a rewind (the
audit's repro: save 100/200/300, rewind to 200, save 210/220/230), torn metric lines, the sampler and
the optimizer after a change. The end-to-end save on SIGTERM is in tests/test_checkpoint.py."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import run_gloo

import run_dir
from checkpoint import abandon_later, complete_checkpoints, find_resume_path, save_checkpoint
from config import load_config
from data import PromptSampler
from models import make_optimizer, set_optimizer_config
from tracking import truncate_metrics


def foreign_lock(out, host="another-node", pid=1, job="999", age_s=0.0):
    out.mkdir(parents=True, exist_ok=True)
    path = out / run_dir.LOCK_FILE
    path.write_text(json.dumps({"job": job, "host": host, "pid": pid, "started": 0}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_second_job_on_a_live_run_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    foreign_lock(tmp_path)
    with pytest.raises(run_dir.RunDirError, match=r"in use by another job \(SLURM job 999, host another-node, pid 1"):
        run_dir.lock(tmp_path)


@pytest.mark.parametrize("how, why", [
    ("old heartbeat", "no heartbeat for"),
    ("dead process", "is gone"),
    ("same job", "the same SLURM job 999, restarted"),
    ("this process", "this process's own"),
])
def test_a_stale_lock_is_taken_over_and_said_so(tmp_path, monkeypatch, how, why):
    monkeypatch.setenv("SLURM_JOB_ID", "999" if how == "same job" else "1000")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    kwargs = {"old heartbeat": dict(age_s=run_dir.STALE_S + 5),
              "dead process": dict(host=socket.gethostname(), pid=dead.pid),
              "same job": {}, "this process": dict(host=socket.gethostname(), pid=os.getpid(), job=None)}[how]
    foreign_lock(tmp_path, **kwargs)
    lock, took_over = run_dir.lock(tmp_path)
    assert why in took_over
    assert json.loads((tmp_path / run_dir.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / run_dir.LOCK_FILE).exists()


def test_the_lock_is_held_and_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "HEARTBEAT_S", 0.05)
    lock, took_over = run_dir.lock(tmp_path)
    assert took_over is None
    path = tmp_path / run_dir.LOCK_FILE
    os.utime(path, (0, 0))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 5  # the heartbeat thread touched it
    # another process (another pid on this host, alive) is refused
    code = f"import run_dir, pathlib; run_dir.lock(pathlib.Path({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(run_dir.Path(
        run_dir.__file__).parent), env={**os.environ, "SLURM_JOB_ID": "another"})
    assert out.returncode != 0 and "is in use by another job" in out.stderr
    lock.release()


def test_a_resume_names_every_change_and_refuses_the_dangerous_ones(tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"x" * 10)
    cfg = load_config("configs/tiny_cpu.yaml", [f"data.train_files={data}"])
    saved = run_dir.fingerprint(cfg, [str(data)], 100)
    assert run_dir.check_resume(tmp_path, saved, saved, force=False) == []
    changed = load_config("configs/tiny_cpu.yaml", [f"data.train_files={data}", "actor_rollout_ref.actor.optim.lr=1e-5",
                                                   "trainer.total_training_steps=99"])  # the length: quiet
    lines = run_dir.check_resume(tmp_path, saved, run_dir.fingerprint(changed, [str(data)], 100), force=False)
    assert lines == ["actor_rollout_ref.actor.optim.lr: 0.0003 -> 1e-05"]
    bigger = load_config("configs/tiny_cpu.yaml", [f"data.train_files={data}", "data.train_batch_size=16"])
    now = run_dir.fingerprint(bigger, [str(data)], 100)
    with pytest.raises(run_dir.RunDirError, match="data.train_batch_size: 32 -> 16.*trainer.resume_force=true"):
        run_dir.check_resume(tmp_path, saved, now, force=False)
    assert run_dir.check_resume(tmp_path, saved, now, force=True) == ["data.train_batch_size: 32 -> 16"]
    data.write_bytes(b"y" * 11)  # the same file name, other data
    with pytest.raises(run_dir.RunDirError, match="the training data"):
        run_dir.check_resume(tmp_path, saved, run_dir.fingerprint(cfg, [str(data)], 100), force=False)
    assert "records no config" in run_dir.check_resume(tmp_path, None, saved, force=False)[0]


def test_a_changed_batch_size_goes_on_from_the_prompts_drawn():
    before = PromptSampler(100, 8, seed=0)
    drawn = [i for _ in range(5) for i in before.next_batch()]  # 40 prompts
    after = PromptSampler(100, 16, seed=0)
    after.load_state_dict(before.state_dict())
    assert set(after.next_batch()).isdisjoint(drawn)  # 3 batches of 16 = 48 >= 40: none twice
    same = PromptSampler(100, 8, seed=0)
    same.load_state_dict(before.state_dict())
    assert same.next_batch() == before.next_batch()


def test_the_configs_lr_weight_decay_and_betas_replace_the_checkpoints():
    model = torch.nn.Linear(2, 2)
    cfg = {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01, "lr_warmup_steps": 4, "lr_warmup_steps_ratio": 0.0,
           "lr_scheduler_type": "constant", "warmup_style": None, "min_lr_ratio": 0.0, "total_training_steps": -1}
    optimizer, sched = make_optimizer(model, cfg, total_steps=10)
    for _ in range(2):
        optimizer.step()
        sched.step()
    assert set_optimizer_config(optimizer, sched, cfg) == []
    lr_before = optimizer.param_groups[0]["lr"]
    changes = set_optimizer_config(optimizer, sched, {**cfg, "lr": 1e-2, "weight_decay": 0.1})
    assert changes == ["weight_decay: 0.01 -> 0.1", "lr: 0.001 -> 0.01"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_before * 10)  # the warm-up's position kept
    sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 4)


def test_torn_metric_lines_are_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"\n\x00\x00\n')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert "dropped 2 unreadable line(s)" in capsys.readouterr().out


def _prune_and_rewind(rank, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(root.stat().st_ino % 20000 + 30000))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    models = {"actor": (model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))}

    def save(step, keep):
        save_checkpoint(root, step, models, {}, keep=keep)
        return [p.name for p in complete_checkpoints(root)]

    assert [save(s, 2) for s in (100, 200, 300)][-1] == ["global_step_200", "global_step_300"]
    rewind = find_resume_path("resume_path", root, str(root / "global_step_200"))
    moved = abandon_later(root, rewind)  # what train_ppo.resume does on rank 0
    assert [p.relative_to(root).as_posix() for p in moved] == ["abandoned/global_step_300"]
    assert save(210, 2) == ["global_step_200", "global_step_210"]
    assert save(220, 2) == ["global_step_210", "global_step_220"]
    assert save(230, 1) == ["global_step_230"]  # before: the checkpoint just written was the one deleted
    assert find_resume_path("auto", root, None) == root / "global_step_230"
    save(300, 1)  # a later step saved beside an earlier one (no rewind): never pruned by an earlier save
    models_kept = save(240, 1)
    assert models_kept == ["global_step_240", "global_step_300"]
    dist.destroy_process_group()


def test_pruning_keeps_the_checkpoint_just_written_after_a_rewind(tmp_path):
    run_gloo(_prune_and_rewind, 1, tmp_path)
