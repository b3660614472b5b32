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
trainer.max_actor_ckpt_to_keep are removed only after that rename.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from config import ConfigError

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"


def save_checkpoint(
    root: str | Path,
    step: int,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]],
    trainer_state: dict[str, Any],
    hf_source: Sequence[Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Collective: every rank calls it. `models` maps 'actor'/'critic' to (model, optimizer, scheduler).
    hf_source: objects with save_pretrained(dir) (the HF config, the tokenizer, a LoRA adapter's config)."""
    root = Path(root)
    final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt that died mid-write
        tmp.mkdir(parents=True)
    dist.barrier()
    for name, (model, optimizer, _) in models.items():
        model_sd, optim_sd = _state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / name))
    dist.barrier()  # every shard is on disk before the checkpoint becomes visible
    if dist.get_rank() == 0:
        state = dict(trainer_state, step=step, world_size=dist.get_world_size(),
                     schedulers={name: s.state_dict() for name, (_, _, s) in models.items()})
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        for item in hf_source or ():
            item.save_pretrained(tmp / "hf")
        if final.exists():  # re-saving a step (after a resume): replace it only now
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep is not None and keep > 0:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old)
    dist.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a `.tmp` directory is never one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_resume_path(mode: str, root: str | Path, resume_from_path: str | None) -> Path | None:
    """trainer.resume_mode: auto (latest complete under root, else start fresh), disable, resume_path."""
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
        return path
    found = complete_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(
    path: str | Path, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]]
) -> dict[str, Any]:
    """Collective: load every model/optimizer (resharding to this world size) and return the
    trainer state (its schedulers already restored)."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    for name, (model, optimizer, sched) in models.items():
        if not (path / name).is_dir():
            raise ConfigError(f"checkpoint {path} has no {name!r} state (was it written by a run without a {name}?).")
        model_sd, optim_sd = _state_dicts(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(path / name))
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
