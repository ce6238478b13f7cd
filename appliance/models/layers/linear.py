"""TP-aware linear layers. Each parameter carries a `weight_loader(param, loaded, shard_id)` that
cuts this rank's shard out of a full checkpoint tensor, so the model loader never knows about TP.

Column layers split the output dim (per logical segment), row layers split the input dim and
all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.layers.parallel import all_reduce, shard_range, tp_size

ShardFn = Callable[
    [torch.Tensor, int], torch.Tensor
]  # (full segment tensor, dim) -> this rank's part


def even_shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    start, end = shard_range(tensor.shape[dim])
    return tensor.narrow(dim, start, end - start)


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs loaded {tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


class ColumnLinear(nn.Module):
    """y = x W^T with W's rows made of `segments` (e.g. [q, k, v]); each segment is sharded on its
    own.

    `shard_sizes` gives each segment's local size (defaults to segment / tp); `shard_fn` cuts the
    local part from a full segment (defaults to an even split)."""

    def __init__(
        self,
        in_features: int,
        segments: list[int],
        bias: bool = False,
        shard_sizes: list[int] | None = None,
        shard_fn: ShardFn = even_shard,
    ) -> None:
        super().__init__()
        self.segments = list(segments)
        self.local = shard_sizes or [s // tp_size() for s in segments]
        self.offsets = [sum(self.local[:i]) for i in range(len(self.local))]
        self.shard_fn = shard_fn
        self.weight = nn.Parameter(torch.empty(sum(self.local), in_features), requires_grad=False)
        self.weight.weight_loader = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local)), requires_grad=False)
            self.bias.weight_loader = self._load

    def _load(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | tuple | None = None
    ) -> None:
        if shard_id is None and len(self.segments) == 1:
            shard_id = 0
        if shard_id is None:  # one checkpoint tensor holding every segment
            shard_id = tuple(range(len(self.segments)))
        if isinstance(shard_id, tuple):  # one checkpoint tensor holding these segments, in order
            sizes = [self.segments[i] for i in shard_id]
            if loaded.shape[0] != sum(sizes):
                raise ValueError(
                    f"shape mismatch: segments {sizes} vs loaded {tuple(loaded.shape)}"
                )
            for i, piece in zip(shard_id, loaded.split(sizes, dim=0)):
                self._load(param, piece, i)
            return
        part = self.shard_fn(loaded, 0)
        copy_into(param.narrow(0, self.offsets[shard_id], self.local[shard_id]), part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = all_reduce(x_local W_local^T): input dim sharded. `reduce=False` leaves a partial sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True
    ) -> None:
        super().__init__()
        self.reduce = reduce
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features // tp_size()), requires_grad=False
        )
        self.weight.weight_loader = lambda p, w, shard_id=None: copy_into(p, even_shard(w, 1))
        self.bias = None
        if bias:  # added once (rank 0) so the all-reduce does not multiply it
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from appliance.models.layers.parallel import tp_rank

        bias = self.bias if (self.bias is not None and tp_rank() == 0) else None
        y = F.linear(x, self.weight, bias)
        return all_reduce(y) if self.reduce else y


class ReplicatedLinear(nn.Module):
    """The full weight on every rank (routers, small gates)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
