"""Checkpoints that lose nothing: sharded model/optimizer state, trainer state, atomic publication.

Layout under trainer.default_local_dir:

    global_step_6/                  a complete checkpoint (only complete ones carry this name)
        actor/                      torch.distributed.checkpoint (DCP): model + optimizer, sharded
        critic/                     the same, for GAE runs
        trainer_state.json          step, data sampler position, lr schedules, KL controller, world size
        hf/                         the actor's HF config + tokenizer, so export_hf.py needs nothing else
                                    (+ adapter_config.json with LoRA, naming the base model)

With LoRA the model state is the adapter alone (the frozen base weights are the base model's, read
again from its path on resume and export), and the optimizer state exists for the adapter only.
    global_step_9.tmp/              being written (or died while being written): never resumed from

Every rank writes its shards into `global_step_N.tmp`; after a barrier rank 0 writes the trainer
state last and renames the directory, which is atomic on one filesystem. Old checkpoints beyond
trainer.max_actor_ckpt_to_keep are removed only after that rename. A save that fails on any rank (a
full disk) fails on every rank with a CheckpointError naming the cause, and leaves no `.tmp` behind.

The trainer state also lists every file of the checkpoint with its size and CRC-32 (`files`), each
rank hashing the shards it wrote while they are still in the page cache. Resume checks the sizes
(auto mode falls back to the newest checkpoint whose files are whole, and says so) and load_checkpoint
the CRCs: a damaged file is an error naming it, never a silent load of garbage. Checkpoints written
before this record load unchecked.

What is not saved, because nothing needs it: random-number-generator states. Every random choice
is a pure function of (trainer.seed, step, ...): vLLM's per-request sampling seeds, the mini-batch
shuffles and torch's global RNG are re-seeded from the step each step, so a resumed run draws
exactly what the uninterrupted run drew, at any world size.

DCP reshards on load, so a checkpoint written by 4 ranks resumes on 2. Tensors load with
weights_only=True; the trainer state is JSON. (DCP's own `.metadata` index is a pickle written by
DCP: resume only from checkpoints you wrote.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from config import ConfigError
from tracking import print0

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as it is; the message names the file and the cause."""


class DamagedCheckpointError(CheckpointError):
    """load_checkpoint's CRC check found files whose content changed: `problems` names each."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


def save_checkpoint(
    root: str | Path,
    step: int,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]],
    trainer_state: dict[str, Any],
    hf_source: Sequence[Any] | None = None,
    keep: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Collective: every rank calls it. `models` maps 'actor'/'critic' to (model, optimizer, scheduler).
    hf_source: objects with save_pretrained(dir) (the HF config, the tokenizer, a LoRA adapter's config).
    group: the ranks holding the models (a split job's trainers; None: every rank); the others pass no models.
    Raises CheckpointError on every rank when any rank fails to write (the previous checkpoints stay)."""
    root = Path(root)
    final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"
    rank, world = dist.get_rank(), dist.get_world_size()
    failure = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt that died mid-write
            tmp.mkdir(parents=True)
        except OSError as e:
            failure = f"rank 0: {e}"
    _raise_if_any(failure, tmp, step)
    digests: dict[str, list[Any]] = {}  # "actor/__0_0.distcp": [size, [CRC-32 of each piece]]
    try:
        for name, (model, optimizer, _) in models.items():
            model_sd, optim_sd = _state_dicts(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / name), process_group=group)
            digests.update(_digests(tmp, name, rank))  # this rank's shards, hot in the page cache
    except (Exception, CheckpointException) as e:  # DCP raises the same CheckpointException on every rank
        failure = _describe_failure(e, rank)
    _raise_if_any(failure, tmp, step)  # also the barrier: every shard is on disk before rank 0 goes on
    every_rank: list[Any] = [None] * world
    dist.all_gather_object(every_rank, digests)
    if rank == 0:
        try:
            for item in hf_source or ():
                item.save_pretrained(tmp / "hf")
            files = {k: v for part in every_rank for k, v in part.items()}
            files.update(_digests(tmp, "hf", None) if (tmp / "hf").is_dir() else {})
            state = dict(trainer_state, step=step, world_size=dist.get_world_size(group),  # the ranks with models
                         files=dict(sorted(files.items())),
                         schedulers={name: s.state_dict() for name, (_, _, s) in models.items()})
            with open(tmp / STATE_FILE, "w") as f:  # the completion marker, written last, on disk before the rename
                f.write(json.dumps(state, indent=1))
                f.flush()
                os.fsync(f.fileno())
            old = root / f"global_step_{step}.old"
            if final.exists():  # re-saving a step (after a resume): the complete one stays until the new one is in
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            failure = f"rank 0: {e}"
    _raise_if_any(failure, tmp, step)
    if rank == 0 and keep is not None and keep > 0:  # the newest `keep` up to this one; never a later one
        older = [p for p in complete_checkpoints(root) if step_of(p) < step]
        for old in older[:len(older) - (keep - 1)]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def _describe_failure(e: BaseException, rank: int) -> str:
    """One line per failed rank: DCP's CheckpointException carries every rank's exception."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


def _raise_if_any(failure: str | None, tmp: Path, step: int) -> None:
    """Collective: if any rank failed, every rank raises (rank 0 first removes the partial `.tmp`)."""
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [f for f in dict.fromkeys(failures) if f is not None]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back
    dist.barrier()  # before any rank raises: torchrun ends the others when the first one exits
    try:
        usage = shutil.disk_usage(tmp.parent)
        free = f"{_size(usage.free)} free of {_size(usage.total)} on {tmp.parent}"
    except OSError:
        free = f"{tmp.parent} unreadable"
    previous = complete_checkpoints(tmp.parent)
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
    raise CheckpointError(f"checkpoint step {step} could not be written to {tmp}: {'; '.join(failed)} ({free}). "
                          f"Nothing of it was kept, {kept}. Free space, or point trainer.default_local_dir elsewhere "
                          f"(trainer.max_actor_ckpt_to_keep prunes old checkpoints).")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _digests(root: Path, sub: str, rank: int | None) -> dict[str, list[Any]]:
    """{"sub/name": [size, [CRC-32 of each 64 MiB piece]]} of the files under root/sub that `rank` wrote
    (DCP names each rank's `__<rank>_*`; rank 0 also writes `.metadata`); rank None: all of them."""
    out = {}
    for path in sorted((root / sub).rglob("*")):
        name = path.relative_to(root / sub).as_posix()
        mine = (rank is None or name.startswith((f"__{rank}_", f"__{rank}."))
                or (rank == 0 and not name.startswith("__")))
        if path.is_file() and mine:
            out[f"{sub}/{name}"] = [path.stat().st_size, _crc32(path)]
    return out


_CRC_CHUNK = 64 << 20


def _crc32(path: Path) -> list[int]:
    """The CRC-32 of each 64 MiB piece of the file, computed on a few threads (zlib and reads release
    the GIL; one thread does ~3.5 GB/s, and a rank's share of a 7B run with Adam is ~10 GB)."""
    def piece(offset: int) -> int:
        with open(path, "rb") as f:
            f.seek(offset)
            return zlib.crc32(f.read(_CRC_CHUNK))

    offsets = range(0, max(path.stat().st_size, 1), _CRC_CHUNK)
    if len(offsets) == 1:
        return [piece(0)]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1, len(offsets))) as pool:
        return list(pool.map(piece, offsets))


def check_files(path: str | Path, deep: bool = False, part: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the files of checkpoint `path` against its trainer state's record: one line
    per missing file, wrong size, or (deep) wrong CRC-32; [] when whole, or when it predates the record.
    part=(i, n): check only every n-th file from the i-th (ranks share the reading)."""
    path = Path(path)
    try:
        files = json.loads((path / STATE_FILE).read_text()).get("files")
    except (OSError, ValueError) as e:
        return [f"{path / STATE_FILE}: unreadable ({e})"]
    problems = []
    for name, (size, crc) in list((files or {}).items())[part[0]::part[1]]:
        file = path / name
        try:
            actual = file.stat().st_size
        except OSError:
            problems.append(f"{file}: missing")
            continue
        if actual != size:
            how = "truncated" if actual < size else "grown"
            problems.append(f"{file}: {actual} bytes, {size} when written ({how})")
        elif deep and (now := _crc32(file)) != crc:
            at = next(i for i, (a, b) in enumerate(zip(now, crc, strict=True)) if a != b) * _CRC_CHUNK
            problems.append(f"{file}: its content changed since it was written (CRC-32 mismatch in bytes "
                            f"{at}..{min(at + _CRC_CHUNK, size)})")
    return problems


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_of(path: Path) -> int:
    """N of a global_step_N directory."""
    return int(_STEP_DIR.match(path.name).group(1))


def abandon_later(root: str | Path, path: Path) -> list[Path]:
    """Resuming from `path` below the newest checkpoint of root (a rewind): move the later ones to
    root/abandoned/, so that pruning and a later automatic resume follow the rewound run, not the
    abandoned one. Returns where they went (rank 0 calls it)."""
    root = Path(root)
    if path.parent.resolve() != root.resolve():
        return []
    moved = []
    for later in [p for p in complete_checkpoints(root) if step_of(p) > step_of(path)]:
        target = root / "abandoned" / later.name
        if target.exists():
            target = target.with_name(f"{later.name}.{int(time.time())}")
        target.parent.mkdir(exist_ok=True)
        os.replace(later, target)
        moved.append(target)
    return moved


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a `.tmp` directory is never one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_resume_path(mode: str, root: str | Path, resume_from_path: str | None,
                     damaged: dict[Path, list[str]] | None = None) -> Path | None:
    """trainer.resume_mode: auto (latest complete under root whose files are whole, else start fresh),
    disable, resume_path. In auto mode a damaged newer checkpoint is skipped, and said so; `damaged`: those
    whose content a load found changed (resume_checkpoint), with their problems."""
    if mode == "disable":
        return None
    if mode == "resume_path":
        if resume_from_path is None:
            raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>.")
        path = Path(resume_from_path)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                f"trainer.resume_from_path={resume_from_path!r} is not a complete checkpoint (no {STATE_FILE}); "
                f"complete ones under it: {[p.name for p in complete_checkpoints(path.parent)]}."
            )
        problems = check_files(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}. Resume from another one "
                                  f"(complete ones: {[p.name for p in complete_checkpoints(path.parent)]}).")
        return path
    skipped = []
    for path in reversed(complete_checkpoints(root)):
        problems = (damaged or {}).get(path) or check_files(path)
        if not problems:
            if skipped:
                print0(f"warning: skipping damaged checkpoint(s): {'; '.join(skipped)}. Resuming from {path} instead.")
            return path
        skipped.append(f"{path.name} ({'; '.join(problems)})")
    if skipped:  # starting over silently would throw the run away
        raise CheckpointError(f"every checkpoint under {root} is damaged: {'; '.join(skipped)}. Set "
                              f"trainer.resume_mode=disable to start fresh.")
    return None


def resume_checkpoint(
    mode: str, root: str | Path, resume_from_path: str | None,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]], group: dist.ProcessGroup | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """Collective: rank 0 picks the checkpoint (find_resume_path, then prepare(path): its checks of the pick,
    which may raise ConfigError / CheckpointError), every rank gets the pick or the error, and loads it
    (load_checkpoint: every file's CRC-32 first). In auto mode a checkpoint whose content changed at its size
    (which find_resume_path's size check cannot see) is skipped, said so, and the next older one picked, as a
    truncated one is; when none is left, the error. Rank 0 first removes the .tmp directories of saves that died
    mid-write. Returns (path, trainer state); None: start fresh."""
    damaged: dict[Path, list[str]] = {}
    if dist.get_rank() == 0:  # saves that died mid-write; the run directory is this run's (run_dir.RunLock)
        for stale in sorted(Path(root).glob("global_step_*.tmp")):
            shutil.rmtree(stale, ignore_errors=True)
            print0(f"removed {stale}: a save that did not finish")
    while True:
        choice: list[Any] = [None, None]  # (the path, or the error every rank raises)
        if dist.get_rank() == 0:
            try:
                path = find_resume_path(mode, root, resume_from_path, damaged)
                if path is not None and prepare is not None:
                    prepare(path)
                choice[0] = None if path is None else str(path)
            except (ConfigError, CheckpointError) as e:
                choice[1] = e
        dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise choice[1]
        if choice[0] is None:
            return None
        path = Path(choice[0])
        try:
            return path, load_checkpoint(path, models, group)
        except DamagedCheckpointError as e:  # nothing was loaded: the check runs first
            if mode != "auto":
                raise
            damaged[path] = e.problems


def load_checkpoint(
    path: str | Path, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Collective: check every file's CRC-32 (the ranks share the reading), load every model/optimizer
    (resharding to the size of `group`, the ranks holding the models; the others pass none) and return the
    trainer state (its schedulers already restored)."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    problems = check_files(path, deep=True, part=(dist.get_rank(), dist.get_world_size()))
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, problems)
    problems = [p for part in every_rank for p in part]
    if problems:
        raise DamagedCheckpointError(
            f"checkpoint {path} is damaged, not loading it: {'; '.join(problems)}. Resume from an earlier one: "
            f"trainer.resume_mode=resume_path trainer.resume_from_path=<one of "
            f"{[p.name for p in complete_checkpoints(path.parent) if p != path]}>.", problems)
    for name, (model, optimizer, sched) in models.items():
        if not (path / name).is_dir():
            raise ConfigError(f"checkpoint {path} has no {name!r} state (was it written by a run without a {name}?).")
        model_sd, optim_sd = _state_dicts(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(path / name), process_group=group)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                       options=_options(model))
        sched.load_state_dict(dict(state["schedulers"][name]))  # LambdaLR: numbers only, JSON-safe
    return state


def _options(model: torch.nn.Module) -> StateDictOptions | None:
    """A model with frozen parameters (LoRA's base weights) saves and loads its trainable ones only."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts to save or load: with frozen parameters, the trainable ones only
    (ignore_frozen_params keeps a tied frozen alias, e.g. lm_head.weight, so the names are filtered too)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    if _options(model) is not None:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {name: value for name, value in model_sd.items() if name in trainable}
    return model_sd, optim_sd


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of everything random in a step, so that a resumed step repeats exactly."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63)
