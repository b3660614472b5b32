"""The collectives the trainer's maths needs beyond torch.distributed's own: gather a tensor's rows or a
list of Python objects over a group in group-rank order and keep this rank's part back, and raise on every
rank together when one fails. The meshes and groups they take come from mesh_utils.build_meshes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """dist.all_gather_single (torch >= 2.13), or all_gather_into_tensor, its deprecated name, which
    is all that older releases (2.11 on some GPU images) have."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def gather_in_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate equal-sized 1D tensors of every rank of `group`, in group-rank order."""
    out = torch.empty(x.numel() * dist.get_world_size(group), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)
    return out


def gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's rows of x (the same shape on each), in group-rank order: (B, ...) -> (B * size, ...).
    With my_rows, the one way to compute on the step's whole batch and keep this rank's part. Collective."""
    return gather_in_group(x.flatten(), group).view(-1, *x.shape[1:])


def gather_items(items: list[Any], group: Any) -> list[Any]:
    """Every rank's list, concatenated in group-rank order: gather_rows for per-row Python objects (each
    sample's reward extras), so that they stay beside their rows. Collective."""
    every_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, items, group=group)
    return [item for rank_items in every_rank for item in rank_items]


@contextlib.contextmanager
def failing_together(error_type: type[Exception], device: torch.device, group: Any = None) -> Iterator[None]:
    """Collective over `group` (None: every rank): run the block on each of its ranks, then raise on each if
    it raised error_type on any (a failed rank its own error, the others one naming it). Without this, the
    ranks that succeeded would wait in the next collective for one that is gone, until a timeout."""
    failure = None
    try:
        yield
    except error_type as e:
        failure = e
    failed = torch.tensor([failure is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed, group=group)  # how many ranks failed
    if failed.item() == 0:
        return
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if failure is None else str(failure).splitlines()[0], group=group)
    if failure is not None:
        raise failure
    ranks = [r if group is None else dist.get_global_rank(group, r) for r, m in enumerate(messages) if m is not None]
    raise error_type(f"rank {ranks[0]} failed{f' (and ranks {ranks[1:]})' if ranks[1:] else ''}: {messages[ranks[0]]}")


def my_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's rows of a tensor gather_rows made: (B * size, ...) -> (B, ...)."""
    rows = len(x) // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return x[rank * rows:(rank + 1) * rows]
