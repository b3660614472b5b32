"""The run directory (trainer.default_local_dir) as one job's own: a lock, what a checkpoint was trained
with, and requests to save and stop.

    run.lock      rank 0 holds it while the job runs: {job, host, pid, started}, its mtime the heartbeat
                  (a thread touches it every HEARTBEAT_S). A second job that starts on the directory
                  stops with the holder's job, host and pid, unless the lock is stale: its heartbeat older
                  than STALE_S, its process gone (same host), or the same SLURM job (a requeue, a torchrun
                  restart). Without it two jobs trip each other's watchdog and delete each other's
                  half-written checkpoints.
    stop          `touch <dir>/stop` (the sbatch wrappers do it on SLURM's early warning signal): every
                  rank saves at the end of the current step and exits 0. SIGTERM and SIGUSR2 to a rank do
                  the same (torchrun forwards SIGTERM to its workers, then kills them after 30 s: a step
                  that takes longer needs the early signal). The file is removed when a job starts.

What a checkpoint was trained with (`fingerprint`: every config key, the training files' names and
sizes, and the prompt count) is in its trainer state; a resume prints every key that changed, and
refuses the changes that would silently break the run (DANGEROUS: the data, its order and the batch
size, which decide which prompts the rest of the epoch draws; the model) unless
trainer.resume_force=true. The other changes take effect, the optimizer's lr, weight decay and betas
among them (models.set_optimizer_config), not the checkpoint's values.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from config import Config, ConfigError, flat_values, shown

LOCK_FILE, STOP_FILE = "run.lock", "stop"
HEARTBEAT_S, STALE_S = 30.0, 120.0
# Keys a restart may change without a word: where things go, how long the run is, how often it saves.
QUIET = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.resume_force", "trainer.total_training_steps",
         "trainer.total_epochs", "trainer.default_local_dir", "trainer.experiment_name", "trainer.project_name",
         "trainer.logger", "trainer.hang_timeout_s", "trainer.save_freq", "trainer.test_freq",
         "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.rollout_data_dir",
         "trainer.validation_data_dir", "trainer.val_before_train", "trainer.n_gpus_per_node", "trainer.nnodes")
DANGEROUS = ("data.train_files", "data.train_batch_size", "data.gen_batch_size", "data.seed", "data.shuffle",
             "trainer.seed", "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank", "critic.model.path")


class RunDirError(ConfigError):
    """The run directory is another job's, or a resume would change what must not change."""


# -----------------------------------------------------------------------------
# The lock


def _owner() -> dict[str, Any]:
    return {"job": os.environ.get("SLURM_JOB_ID"), "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.time()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _stale_because(held: dict[str, Any] | None, age_s: float, me: dict[str, Any]) -> str | None:
    """Why the lock `held` (heartbeat age_s old) may be taken over by `me`, or None when it is in use."""
    if held is None:
        return "unreadable"
    if held.get("host") == me["host"] and held.get("pid") == me["pid"]:
        return "this process's own, from an earlier run in it"
    if held.get("job") is not None and held.get("job") == me["job"]:
        return f"the same SLURM job {me['job']}, restarted"
    if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
        return f"its process {held['pid']} is gone"
    if age_s > STALE_S:
        return f"no heartbeat for {age_s:.0f} s"
    return None


class RunLock:
    """run.lock, held by this process; a daemon thread touches it every HEARTBEAT_S until release()."""

    def __init__(self, path: Path, owner: dict[str, Any]) -> None:
        self.path, self.owner, self._done = path, owner, threading.Event()
        threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # removed (a later run of this process took it over): nothing to keep alive
                return

    def release(self) -> None:
        self._done.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def lock(out_dir: Path) -> tuple[RunLock, str | None]:
    """Take out_dir's run.lock (rank 0). Returns the lock and, when a stale one was taken over, why (to
    print). RunDirError when another live job holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path, me = out_dir / LOCK_FILE, _owner()
    taken_over = None
    for _ in range(3):  # another job may remove or create it between the two calls
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held, age = json.loads(path.read_text()), time.time() - path.stat().st_mtime
            except (OSError, ValueError):
                held, age = None, 0.0
            if isinstance(held, dict) or held is None:
                why = _stale_because(held if isinstance(held, dict) else None, age, me)
            else:
                why = "unreadable"
            if why is None:
                raise RunDirError(
                    f"trainer.default_local_dir={out_dir} is in use by another job (SLURM job {held.get('job')}, "
                    f"host {held.get('host')}, pid {held.get('pid')}; heartbeat {age:.0f} s ago): point this run "
                    f"at another directory. If that job is gone, the lock is taken over once its heartbeat is "
                    f"{STALE_S:.0f} s old, or delete {path}.") from None
            taken_over = f"took over the run directory's lock {path} ({why})"
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return RunLock(path, me), taken_over
    raise RunDirError(f"could not take the lock {path}: another job keeps creating it")


# -----------------------------------------------------------------------------
# Requests to save and stop


class StopRequests:
    """SIGTERM / SIGUSR2 to this rank (with `install`), or <out_dir>/stop: save and stop after this step."""

    def __init__(self, out_dir: Path, install: bool) -> None:
        self.file, self.signalled = out_dir / STOP_FILE, None
        if install:
            for sig in (signal.SIGTERM, signal.SIGUSR2):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:  # only a flag: the step goes on to its end
        self.signalled = signal.Signals(signum).name

    def local_reason(self) -> str | None:
        """Why this rank was asked to stop (a signal, the stop file), or None."""
        if self.signalled is not None:
            return self.signalled
        return f"{self.file} exists" if self.file.exists() else None


def clear_stop_file(out_dir: Path) -> None:
    """Rank 0 at start: a stop file left by an earlier job (its requeue brought this one) is spent."""
    (out_dir / STOP_FILE).unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# What a checkpoint was trained with


def fingerprint(cfg: Config, train_files: Sequence[str], num_prompts: int) -> dict[str, Any]:
    """Every config key's value (URLs redacted), and the training data: its files' names and sizes, and the
    prompts kept from them."""
    sizes = []
    for file in train_files:
        try:
            sizes.append(Path(file).stat().st_size)
        except OSError:
            sizes.append(None)  # a hub data set name, not a file
    return {"config": {k: shown(v, k) for k, v in flat_values(cfg).items()},
            "data": {"train_files": list(train_files), "bytes": sizes, "prompts": num_prompts}}


def resume_changes(saved: dict[str, Any] | None, now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(every change from the checkpoint's fingerprint to this run's, one line each; the dangerous ones)."""
    if saved is None:
        return ["the checkpoint records no config (written before this record): nothing can be compared"], []
    changes, dangerous = [], []
    old_cfg, new_cfg = saved.get("config", {}), now["config"]
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if key in QUIET or old_cfg.get(key) == new_cfg.get(key):
            continue
        line = f"{key}: {old_cfg.get(key, '<absent>')!r} -> {new_cfg.get(key, '<absent>')!r}"
        changes.append(line)
        if key in DANGEROUS:
            dangerous.append(line)
    if saved.get("data") != now["data"] and "data.train_files" not in {c.split(":")[0] for c in dangerous}:
        line = f"the training data: {saved.get('data')} -> {now['data']}"
        changes.append(line)
        dangerous.append(line)
    return changes, dangerous


def check_resume(path: Path, saved: dict[str, Any] | None, now: dict[str, Any], force: bool) -> list[str]:
    """The changes to print on resuming from `path`; RunDirError listing the dangerous ones unless `force`."""
    changes, dangerous = resume_changes(saved, now)
    if dangerous and not force:
        raise RunDirError(
            f"resuming from {path} with changes that break the run silently: " + "; ".join(dangerous) + ". The "
            "prompts still to come in this epoch, their order, or the model would not be the checkpoint's. Start "
            "in another trainer.default_local_dir (or trainer.resume_mode=disable), or set "
            "trainer.resume_force=true to resume anyway (the sampler then goes on from the prompts already "
            "drawn, rounded up to whole batches).")
    return changes
