"""A rollout pool apart from the trainers, in one torchrun job (trainer.v1.trainer_mode=separate_async).

Ranks [0, T) train (their FSDP / HSDP and Ulysses meshes cover them alone); ranks [T, N) generate and score
(TP groups of consecutive ranks inside a node). mesh_utils.parallel_dims plans the layout and refuses what
cannot work; this module holds what runs: the groups each role talks over, the hand-off of a scored batch
from the pool to the trainers, and the weights' broadcast from trainer 0 to every engine.

vLLM's external launcher builds its groups over the whole torch.distributed world and reduces the free memory
over it at start-up, so every rank builds an engine, the trainers too: theirs is never synced nor asked to
generate (asleep for good where sleep mode exists). Generation takes no collective outside an engine's TP
group, so the pool generates while the trainers train.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mesh_utils import ParallelDims

Batch = dict[str, torch.Tensor]
Part = tuple[Batch, list[dict[str, float]], dict[str, float]]  # scored rows, their reward extras, metrics


# Each role's phases (watchdog.Progress's order) and their places in a step: the roles enter different phases,
# so the watchdog compares (step, place), and a rank that waits for the other role stands ahead of the one it
# waits for: the pool's sync (the broadcast from trainer 0) after the trainers' (the weights gathered); the
# trainers' generate (waiting for the hand-off) after the pool's; the pool's wait for the trainers' step end
# (the stop check) after their update; its validation (the weights, then the held-out set) after the trainers'
# update and before their wait for its metrics; the save together.
PHASE_ORDER = {
    "trainer": {"sync": 0, "generate": 3, "log_prob": 4, "update": 5, "validate": 7, "save": 9},
    "rollout": {"sync": 1, "generate": 2, "hand_off": 3, "generate_ahead": 4, "validate": 6, "wait_trainers": 8,
                "save": 9},
}


@dataclass(frozen=True)
class Pool:
    """This rank's place in a split job, and the groups between the roles (build_pool)."""

    trainers: int  # T: ranks [0, T) train
    world: int  # N: ranks [T, N) generate
    rank: int
    infer_tp: int
    trainer_group: Any  # ranks [0, T): the training reductions (metrics, checks) run over it
    pool_group: Any  # ranks [T, N): the pool's reductions (a reward function that fails)
    sync_group: Any  # trainer 0 and the pool: the weights' broadcast

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainers

    @property
    def leader(self) -> int:  # the pool's first rank: it gathers the batch and deals it to the trainers
        return self.trainers

    def role(self, rank: int) -> str:
        return "trainer" if rank < self.trainers else "rollout"


def build_pool(dims: ParallelDims, rank: int) -> Pool | None:
    """The groups of a split job (collective: every rank creates each); None when collocated."""
    if not dims.split:
        return None
    trainers, world = dims.world_size, dims.launched
    trainer_group = dist.new_group(list(range(trainers)))
    pool_group = dist.new_group(list(range(trainers, world)))
    sync_group = dist.new_group([0, *range(trainers, world)])
    return Pool(trainers, world, rank, dims.infer_tp, trainer_group, pool_group, sync_group)


# -----------------------------------------------------------------------------
# The batch: pool -> trainers


def hand_off(pool: Pool, part: Part | None) -> Part | None:
    """Every rank calls it. A pool rank gives its scored rows (its TP slice of its engine's samples,
    prompt-major), their reward extras and its generation metrics; the pool's first rank concatenates them in
    rank order (the prompt-major order of the whole batch, as collocated ranks hold it) and deals slice r to
    trainer r, with the pool's mean metrics. Returns the trainer's share; None on a pool rank."""
    whole = gather_batch(pool, part) if not pool.is_trainer else None
    shares: list[Any] = [None] * pool.world
    if whole is not None:
        rows, extras, metrics = whole
        per_trainer = len(extras) // pool.trainers  # divides: mesh_utils.plan_batches
        for r in range(pool.trainers):
            mine = slice(r * per_trainer, (r + 1) * per_trainer)
            shares[r] = ({key: value[mine] for key, value in rows.items()}, extras[mine], metrics)
    out: list[Any] = [None]
    dist.scatter_object_list(out, shares if pool.rank == pool.leader else None, src=pool.leader)
    return out[0]


def gather_batch(pool: Pool, part: Part) -> Part | None:
    """The pool's ranks: their parts, whole on the pool's first rank (rows and extras in rank order, the mean
    of the metrics over the parts that hold rows); None elsewhere. A part with no rows (empty_part) adds
    nothing: a batch resumed from a checkpoint is whole on the first rank."""
    parts: list[Any] | None = [None] * (pool.world - pool.trainers) if pool.rank == pool.leader else None
    dist.gather_object(part, parts, dst=pool.leader, group=pool.pool_group)
    if parts is None:
        return None
    parts = [p for p in parts if p[1]]
    rows = {key: torch.cat([p[0][key] for p in parts]) for key in parts[0][0]}
    keys = sorted({k for p in parts for k in p[2]})
    return rows, [e for p in parts for e in p[1]], {k: sum(p[2].get(k, 0.0) for p in parts) / len(parts) for k in keys}


def empty_part(whole: Part) -> Part:
    """A part with the whole batch's keys and no rows (gather_batch skips it)."""
    return {key: value[:0] for key, value in whole[0].items()}, [], {}


# -----------------------------------------------------------------------------
# The pool's state in a checkpoint: its sampler and the batch it generated ahead


def pool_state(pool: Pool, sampler: dict[str, int] | None, part: Part | None) -> dict[str, Any]:
    """Every rank calls it when a checkpoint is written. The pool's sampler state (the pool draws the prompts)
    and the batch it generated ahead (part: each pool rank's, None when it holds none: sequential, or the
    last step) go to trainer 0, which returns them as checkpoint entries ({"sampler", "generated_ahead"});
    the other ranks return {}."""
    state: list[Any] = [None]
    if not pool.is_trainer:
        whole = gather_batch(pool, part) if part is not None else None  # the pool's ranks hold one alike
        if pool.rank == pool.leader:
            dist.send_object_list([{"sampler": sampler, "generated_ahead": batch_to_json(whole)}], dst=0)
    elif pool.rank == 0:
        dist.recv_object_list(state, src=pool.leader)
    return state[0] or {}


def batch_to_json(whole: Part | None) -> dict[str, Any] | None:
    """A whole batch as plain JSON, every value exact (floats of any width round-trip through Python floats)."""
    if whole is None:
        return None
    rows, extras, metrics = whole
    return {"rows": {key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "values": t.reshape(-1).tolist()} for key, t in rows.items()},
            "extras": extras, "metrics": metrics}


def batch_from_json(saved: dict[str, Any]) -> Part:
    """batch_to_json's inverse."""
    rows = {key: torch.tensor(t["values"], dtype=getattr(torch, t["dtype"])).reshape(t["shape"])
            for key, t in saved["rows"].items()}
    return rows, list(saved["extras"]), dict(saved["metrics"])


# -----------------------------------------------------------------------------
# The weights: trainer 0 -> every engine of the pool, in buckets


def send_weights(pool: Pool, named_tensors: Iterable[tuple[str, torch.Tensor]], probe_log_probs: Any,
                 bucket_bytes: int) -> None:
    """Trainers: consume named_tensors (every trainer in step: gathering full tensors is collective over the
    FSDP mesh); trainer 0 broadcasts them over the sync group in flat buckets of about bucket_bytes, then
    the actor's log-probs of the stale-weights probe (the pool checks that the weights landed)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if pool.rank != 0:
            continue
        bucket.append((name, tensor.detach().contiguous()))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            _broadcast_bucket(pool, bucket)
            bucket, size = [], 0
    if pool.rank != 0:
        return
    if bucket:
        _broadcast_bucket(pool, bucket)
    dist.broadcast_object_list([("end", probe_log_probs)], src=0, group=pool.sync_group)


def _broadcast_bucket(pool: Pool, bucket: list[tuple[str, torch.Tensor]]) -> None:
    header = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    dist.broadcast_object_list([("bucket", header)], src=0, group=pool.sync_group)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])  # (bytes,)
    dist.broadcast(flat, src=0, group=pool.sync_group)


def receive_weights(pool: Pool, device: torch.device, probe: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """A pool rank: the (name, full tensor) pairs trainer 0 broadcasts (send_weights), lazily, one bucket held
    at a time (rollout.sync_weights consumes them); the actor's probe log-probs land in probe[0] at the end."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=pool.sync_group)
        kind, body = message[0]
        if kind == "end":
            probe[0] = body
            return
        sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in body]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pool.sync_group)
        for (name, shape, dtype), part in zip(body, flat.split(sizes), strict=True):
            yield name, part.view(dtype).view(shape)

