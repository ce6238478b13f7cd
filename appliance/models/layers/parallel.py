"""Tensor-parallel state and collectives for the model layers (torch.distributed; gloo on CPU, NCCL
on GPU).

The worker sets the TP group once (`set_tp`); layers read `tp_rank()` / `tp_size()` when built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None


def set_tp(rank: int, size: int, group=None) -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank, size, group


@contextlib.contextmanager
def tp_layout(rank: int, size: int) -> Iterator[None]:
    """Layers built inside take these shard sizes (no group: for building, never for running);
    the worker's state comes back after."""
    saved = _TP_RANK, _TP_SIZE, _TP_GROUP
    set_tp(rank, size)
    try:
        yield
    finally:
        set_tp(*saved)


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's even share of `total` items."""
    rank = tp_rank() if rank is None else rank
    size = tp_size() if size is None else size
    if total % size:
        raise ValueError(f"cannot split {total} evenly over tensor-parallel size {size}")
    per = total // size
    return rank * per, (rank + 1) * per
