"""TP-aware linear layers. Each parameter carries a `weight_loader(param, loaded, shard_id)` that
cuts this rank's shard out of a full checkpoint tensor, so the model loader never knows about TP.

Column layers split the output dim (per logical segment), row layers split the input dim and
all-reduce. The weight's storage and GEMM come from a quantization method (quant_methods.py): fp8
layers add `weight_scale` (per output channel [N], or per tile [N/bn, K/bk]) cut like the weight:
column layers cut scale rows, row layers cut block-scale columns and keep per-channel scales whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from appliance.models.layers.parallel import all_reduce, shard_range, tp_rank, tp_size
from appliance.models.layers.quant import QuantConfig, UnsupportedQuantization
from appliance.models.layers.quant_methods import (
    Unquantized,
    block_rows,
    channel_scale,
    linear_method,
    tail_fits,
)
from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.fp8_gemv import GemvConv
from appliance_kernels.gemv_norm import AddNorm, PendingNorm
from appliance_kernels.head_norm import PendingHeadNorm, head_norm_fits

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
    if (param.dtype == FP8_DTYPE) != (loaded.dtype == FP8_DTYPE):
        # a cast between fp8 and a float type without its scale would silently be wrong
        why = (
            "a layer served in 16-bit here: the embeddings and lm_head always (quantised ones "
            "are not supported; a checkpoint lists them in its ignore list), other layers where "
            "the checkpoint's quantization_config keeps them unquantised"
            if loaded.dtype == FP8_DTYPE
            else "the checkpoint's quantization_config does not describe this tensor"
        )
        raise ValueError(
            f"dtype mismatch: parameter {param.dtype} vs loaded {loaded.dtype} ({why})"
        )
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


class _QuantLinear(nn.Module):
    """Weight [rows, cols] (+ weight_scale) from a quantization method; `finish_loading` runs once
    every tensor is in (online quantization)."""

    def _init_weight(self, rows: int, cols: int, quant: QuantConfig | None, loader) -> None:
        self.method = linear_method(quant)
        self.weight = self.method.make_weight(rows, cols)
        self.weight.weight_loader = loader
        self.weight_scale = self.method.make_scale(rows, cols)
        if self.weight_scale is not None:
            self.weight_scale.weight_loader = loader

    def _matmul(self, x: torch.Tensor | PendingNorm, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias); a PendingNorm x (appliance_kernels/gemv_norm.py) is finished inside
        the one-row GEMV where that is the route, else normalised first."""
        if isinstance(x, PendingNorm):
            out = self.method.one_row(x.x_pre, self.weight, self.weight_scale, bias, norm_in=x)
            if out is not None:
                return out
            x = x.materialize()
        return self.method.apply(x, self.weight, self.weight_scale, bias)

    def takes_pending(self, x: torch.Tensor) -> bool:
        """Whether a PendingNorm of rows like x is finished inside this layer's GEMV."""
        return self.method.gemv_route(x, self.weight)

    def finish_loading(self) -> None:
        weight, scale = self.method.finish(self.weight, self.weight_scale)
        self.weight, self.weight_scale = weight, scale

    def _scale_kind(self, param: torch.Tensor) -> str:
        """ "weight" (weights, biases), "channel" or "block" (scales)."""
        if self.weight_scale is None or param is not self.weight_scale:
            return "weight"
        return "channel" if self.method.block is None else "block"


def blocks_fit(local_sizes: list[int], quant: QuantConfig | None) -> bool:
    """Whether segments of these local sizes can share one weight under `quant`: a block scale
    covers block_n rows of one segment, so each segment must start on a block_n boundary."""
    block = linear_method(quant).block
    return block is None or all(
        sum(local_sizes[:i]) % block[0] == 0 for i in range(len(local_sizes))
    )


class ColumnLinear(_QuantLinear):
    """y = x W^T with W's rows made of `segments` (e.g. [q, k, v]); each segment is sharded on its
    own.

    `shard_sizes` gives each segment's local size (defaults to segment / tp); `shard_fn` cuts the
    local part from a full segment (defaults to an even split): one fn for every segment, or a
    list with one per segment (q split evenly, k/v by kv head). `segment_names` (checkpoint module
    names, siblings of this layer) lets the loader name a segment no tensor filled."""

    def __init__(
        self,
        in_features: int,
        segments: list[int],
        bias: bool = False,
        shard_sizes: list[int] | None = None,
        shard_fn: ShardFn | list[ShardFn] = even_shard,
        quant: QuantConfig | None = None,
        segment_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.segments = list(segments)
        self.local = shard_sizes or [s // tp_size() for s in segments]
        self.offsets = [sum(self.local[:i]) for i in range(len(self.local))]
        self.shard_fns = shard_fn if isinstance(shard_fn, list) else [shard_fn] * len(segments)
        if len(self.shard_fns) != len(segments):
            raise ValueError(f"{len(self.shard_fns)} shard fns for {len(segments)} segments")
        self._init_weight(sum(self.local), in_features, quant, self._load)
        if not blocks_fit(self.local, quant):
            raise UnsupportedQuantization(self._unfit_blocks(segment_names, quant))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local)), requires_grad=False)
            self.bias.weight_loader = self._load
        if segment_names is not None:
            for param in (self.weight, self.weight_scale, self.bias):
                if param is not None:
                    param.segment_names = list(segment_names)
                    param.loaded_segments = set()

    def _unfit_blocks(self, segment_names: list[str] | None, quant: QuantConfig | None) -> str:
        """Why the block scales cannot cover these segments: the tensor-parallel split when the
        whole segments fit (a smaller size would load), else the checkpoint's own shapes."""
        block_n = self.method.block[0]
        names = segment_names if segment_names and len(segment_names) == len(self.segments) else []
        odd = list(dict.fromkeys(n for n, size in zip(names, self.local) if size % block_n))
        what = f" ({', '.join(odd)})" if odd else ""
        if tp_size() > 1 and blocks_fit(self.segments, quant):
            return (
                f"fp8 block {list(self.method.block)} over tensor-parallel size {tp_size()}: "
                f"fused segments of {self.segments} rows{what} split into {self.local} rows a "
                f"rank, which do not start on block_n = {block_n} boundaries; use a smaller "
                "tensor-parallel size"
            )
        hint = (
            f" ({', '.join(odd)} not a whole number of blocks: a checkpoint keeps such "
            "projections in 16-bit, named in its modules_to_not_convert / ignore list)"
            if odd
            else ""
        )
        return (
            f"fp8 block {list(self.method.block)}: fused segments of local sizes {self.local} "
            f"do not start on block_n boundaries{hint}"
        )

    def _load(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | tuple | None = None
    ) -> None:
        if shard_id is None and len(self.segments) == 1:
            shard_id = 0
        if shard_id is None:  # one checkpoint tensor holding every segment
            shard_id = tuple(range(len(self.segments)))
        kind = self._scale_kind(param)
        if isinstance(shard_id, tuple):  # one checkpoint tensor holding these segments, in order
            sizes = [self.segments[i] for i in shard_id]
            if kind == "channel":
                loaded = channel_scale(loaded, sum(sizes))
            if kind == "block":
                block_n = self.method.block[0]
                sizes = [-(-s // block_n) for s in sizes]  # scale rows (offsets are aligned)
            if loaded.shape[0] != sum(sizes):
                raise ValueError(
                    f"shape mismatch: segments {sizes} vs loaded {tuple(loaded.shape)}"
                )
            for i, piece in zip(shard_id, loaded.split(sizes, dim=0)):
                self._load(param, piece, i)
            return
        if kind == "block":
            block_n = self.method.block[0]
            first, count = block_rows(self.shard_fns[shard_id], self.segments[shard_id], block_n)
            target = param.narrow(0, self.offsets[shard_id] // block_n, count)
            copy_into(target, loaded.narrow(0, first, count))
        else:
            if kind == "channel":
                loaded = channel_scale(loaded, self.segments[shard_id])
            part = self.shard_fns[shard_id](loaded, 0)
            copy_into(param.narrow(0, self.offsets[shard_id], self.local[shard_id]), part)
        if hasattr(param, "loaded_segments"):
            param.loaded_segments.add(shard_id)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def with_tail(
        self,
        x: torch.Tensor | PendingNorm,
        tail: ColumnLinear | None,
        conv: GemvConv | None = None,
    ) -> torch.Tensor | None:
        """[self(x), tail(x)] in one launch where the method's one-row GEMV can also read the
        unquantised `tail` layer's weight (or no tail), its first outputs through a GDN `conv`
        (quant_methods.Unquantized.apply_with_tail), a PendingNorm x finished inside it; None:
        call the layers."""
        if not self._takes_tail(tail):
            return None
        tail_weight = tail.weight if tail is not None else None
        if isinstance(x, PendingNorm):
            if conv is None and tail is None:
                return None
            return self.method.one_row(
                x.x_pre, self.weight, self.weight_scale, tail=tail_weight, conv=conv, norm_in=x
            )
        return self.method.apply_with_tail(x, self.weight, self.weight_scale, tail_weight, conv)

    def _takes_tail(self, tail: ColumnLinear | None) -> bool:
        no_bias = self.bias is None and (tail is None or tail.bias is None)
        return no_bias and (tail is None or type(tail.method) is Unquantized)

    def takes_pending_with(self, x: torch.Tensor, tail: ColumnLinear) -> bool:
        """Whether with_tail finishes a PendingNorm of rows like x for this layer and `tail`."""
        return self._takes_tail(tail) and self.takes_pending(x) and tail_fits(x, tail.weight)

    def swiglu(self, x: torch.Tensor | PendingNorm) -> torch.Tensor | None:
        """SiLU(gate) * up of this [gate, up] layer in one kernel where the method has one (see
        quant_methods.Unquantized.swiglu); None: run forward, then silu_and_mul."""
        if self.bias is not None or len(self.local) != 2 or self.local[0] != self.local[1]:
            return None
        if isinstance(x, PendingNorm):
            return self.method.swiglu(x.x_pre, self.weight, self.weight_scale, norm_in=x)
        return self.method.swiglu(x, self.weight, self.weight_scale)


def unloaded_segments(name: str, param: torch.Tensor) -> list[str]:
    """Names of the segments of a ColumnLinear parameter built with `segment_names` that no
    checkpoint tensor filled (`a.qkv_proj.weight` missing k -> `a.k_proj.weight`): a fused weight
    with one part absent would otherwise load with uninitialised rows."""
    names = getattr(param, "segment_names", None) or []
    module, _, leaf = name.rpartition(".")
    parent = module.rpartition(".")[0]
    missing = [
        ".".join(p for p in (parent, segment, leaf) if p)
        for i, segment in enumerate(names)
        if i not in param.loaded_segments
    ]
    return list(dict.fromkeys(missing))  # one name for a module that fills several segments


class RowLinear(_QuantLinear):
    """y = all_reduce(x_local W_local^T): input dim sharded. `reduce=False` leaves a partial sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        reduce: bool = True,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.reduce = reduce
        self.out_features = out_features
        local = in_features // tp_size()
        self._init_weight(out_features, local, quant, self._load)
        block = self.method.block
        if block is not None and tp_size() > 1 and local % block[1]:
            raise UnsupportedQuantization(
                f"fp8 block {list(block)}: {in_features} input features over tensor-parallel "
                f"size {tp_size()} leave {local} per rank, not a multiple of block_k"
            )
        self.bias = None
        if bias:  # added once (rank 0) so the all-reduce does not multiply it
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        kind = self._scale_kind(param)
        if kind == "channel":  # every rank holds all output rows
            copy_into(param, channel_scale(loaded, self.out_features))
        else:  # weight columns, or block-scale columns (aligned, checked at construction)
            copy_into(param, even_shard(loaded, 1))

    def forward(
        self, x: torch.Tensor | PendingHeadNorm, add_norm: AddNorm | None = None
    ) -> torch.Tensor | PendingNorm:
        """With `add_norm` (one tensor-parallel rank): the PendingNorm of (x W^T + residual) where
        the one-row GEMV is the route (appliance_kernels/gemv_norm.py), else x W^T as without.
        x may be a PendingHeadNorm (the GDN layer's split gated norm): finished inside the
        one-row GEMV where that is the route (`takes_head_norm`), else materialised first."""
        bias = self.bias if (self.bias is not None and tp_rank() == 0) else None
        fused_add = add_norm is not None and tp_size() == 1 and self.reduce
        if isinstance(x, PendingHeadNorm):
            extras = {"head_norm": x, "add_norm": add_norm if fused_add else None}
            out = self.method.one_row(x.y, self.weight, self.weight_scale, bias, **extras)
            if out is not None:
                return all_reduce(out) if self.reduce and not fused_add else out
            x = x.materialize()
        if fused_add:
            out = self.method.one_row(x, self.weight, self.weight_scale, bias, add_norm=add_norm)
            if out is not None:
                return out
        y = self._matmul(x, bias)
        return all_reduce(y) if self.reduce else y

    def takes_head_norm(self, x: torch.Tensor, head_dim: int) -> bool:
        """Whether forward finishes a PendingHeadNorm over heads of head_dim inside its one-row
        GEMV, for a row like x (dtype, device, one contiguous row)."""
        if not self.method.gemv_route(x, self.weight):
            return False
        return head_norm_fits(self.weight.shape[1], head_dim, self.method.gemv_block_k(self.weight))


class ReplicatedLinear(_QuantLinear):
    """The full weight on every rank (routers, small gates)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.out_features = out_features
        self._init_weight(out_features, in_features, quant, self._load)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into(p, w)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if self._scale_kind(param) == "channel":
            loaded = channel_scale(loaded, self.out_features)
        copy_into(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)
