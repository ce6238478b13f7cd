"""How a linear layer stores its weight and runs its GEMM, one strategy per quantization scheme:
unquantised, fp8 with a scale per output channel (checkpoint or online), fp8 with a scale per
[block_n, block_k] tile. Chosen by `linear_method`; used by linear.py (and the expert variants by
moe.py). The kernels live in appliance_kernels/fp8.py (backend from APPLIANCE_FP8_GEMM via
appliance_kernels.backends) and appliance_kernels/fp8_block.py.
"""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.quant import QuantConfig, UnsupportedQuantization
from appliance_kernels.fp8 import FP8_DTYPE, fp8_linear, one_row_gemv, per_token_quant_ref
from appliance_kernels.fp8_block import cublaslt_block_ready, fp8_block_linear
from appliance_kernels.fp8_gemv import (
    GEMV_DTYPES,
    GemvConv,
    bf16_gemv_config,
    bf16_gemv_wins,
    block_gemv_config,
    block_gemv_fits,
    fp8_gemv,
    fp8_gemv_block,
    gemv_config,
    gemv_wins,
    linear,
)
from appliance_kernels.gemv_norm import PendingNorm
from appliance_kernels.gemv_swiglu import gemv_swiglu, swiglu_fits
from appliance_kernels.triton_utils import use_triton


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Unquantized:
    """Weight in the model dtype; F.linear (one row on CUDA: the GEMV of
    appliance_kernels/fp8_gemv.py)."""

    block: tuple[int, int] | None = None  # (block_n, block_k) of block-scaled weights

    # Whether the GDN conv runs inside this method's one-row in_proj GEMV by default
    # (appliance/models/layers/gdn.py FUSE_CONV). 27B batch-1 step, H200, graphs (docs/
    # benchmarks.md): fp8 per channel 8.36 ms with against 8.53 without (run BR); block fp8 8.48 /
    # 8.59 against 8.54 / 8.64 since its GEMV's flat tile (run DH; 9.33 / 9.24 before, BR); bf16
    # 13.68 / 13.59 (BR), within the spread, so it keeps the conv kernel.
    GEMV_CONV = False

    def make_weight(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter:
        """[*lead, rows, cols]; `lead` = (num_experts,) for expert weights."""
        return _param(*lead, rows, cols)

    def make_scale(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter | None:
        return None

    def apply(self, x, weight, scale, bias) -> torch.Tensor:
        return linear(x, weight, bias)

    def gemv_route(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `apply` reads this weight with the one-row GEMV of appliance_kernels/fp8_gemv.py
        (the kernel that also takes a tail, a conv and a split norm)."""
        n, k = weight.shape
        return (
            _one_row(x)
            and x.dtype in GEMV_DTYPES
            and weight.dtype == x.dtype
            and weight.stride(-1) == 1
            and bf16_gemv_wins(1, n, k)
        )

    def _gemv(self, x, weight, scale, bias, **extras) -> torch.Tensor | PendingNorm:
        return fp8_gemv(x, weight, None, bias, bf16_gemv_config(*weight.shape), **extras)

    def gemv_block_k(self, weight: torch.Tensor) -> int:
        """The K step of this method's one-row GEMV over `weight`."""
        return bf16_gemv_config(*weight.shape)["block_k"]

    def one_row(self, x, weight, scale, bias=None, **extras) -> torch.Tensor | PendingNorm | None:
        """This method's one-row GEMV of x [1, K] with fp8_gemv's extras (tail, conv, norm_in,
        add_norm); None where that GEMV is not its route for x."""
        if not self.gemv_route(x, weight):
            return None
        return self._gemv(x.reshape(1, -1), weight, scale, bias, **extras)

    def swiglu(self, x, weight, scale, norm_in=None) -> torch.Tensor | None:
        """SiLU(gate) * up of a [gate; up] weight in one kernel where appliance_kernels.gemv_swiglu
        runs (one row on CUDA, when enabled), x a PendingNorm's x_pre with `norm_in`; None: the
        caller runs apply + silu_and_mul."""
        if swiglu_fits(x, weight, None):
            return gemv_swiglu(x, weight, None, None, norm_in)
        return None

    def apply_with_tail(
        self, x, weight, scale, tail, conv: GemvConv | None = None
    ) -> torch.Tensor | None:
        """[x W^T, x tail^T] for one row x and a small 16-bit weight `tail` (or None), in one
        launch where this method's one-row GEMV runs (the GDN layer's bf16 b / a beside its fp8
        in_proj); with a `conv` the first C outputs leave through the GDN layer's conv
        (fp8_gemv.GemvConv). None: the caller runs the layers. A 16-bit in_proj holds b / a
        already, so this method takes the call only for its conv."""
        if conv is None or not tail_fits(x, tail):
            return None
        return self.one_row(x, weight, scale, tail=tail, conv=conv)

    def finish(self, weight, scale) -> tuple[nn.Parameter, nn.Parameter | None]:
        """Called once every tensor is loaded; returns the (weight, scale) to keep."""
        return weight, scale


def _flat(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """Run a 2-D fp8 GEMM over the last dim of x [.., K]."""
    out = fn(x.reshape(-1, x.shape[-1]), *args)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8Channel(Unquantized):
    """e4m3 weight [N, K], fp32 scale [N]; activations quantised per token on the fly."""

    GEMV_CONV = True

    def make_weight(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter:
        return _param(*lead, rows, cols, dtype=FP8_DTYPE)

    def make_scale(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter | None:
        return _param(*lead, rows, dtype=torch.float32)

    def apply(self, x, weight, scale, bias) -> torch.Tensor:
        return _flat(fp8_linear, x, weight, scale, bias)

    def gemv_route(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return _one_row(x) and one_row_gemv(x.reshape(1, -1), weight)

    def _gemv(self, x, weight, scale, bias, **extras) -> torch.Tensor | PendingNorm:
        return fp8_gemv(x, weight, scale, bias, **extras)

    def gemv_block_k(self, weight: torch.Tensor) -> int:
        return gemv_config(*weight.shape)["block_k"]

    def swiglu(self, x, weight, scale, norm_in=None) -> torch.Tensor | None:
        if swiglu_fits(x, weight, scale) and one_row_gemv(x.reshape(1, -1), weight):
            return gemv_swiglu(x, weight, scale, None, norm_in)
        return None

    def apply_with_tail(self, x, weight, scale, tail, conv=None) -> torch.Tensor | None:
        if tail_fits(x, tail):
            return self.one_row(x, weight, scale, tail=tail, conv=conv)
        return None


class Fp8Online(Fp8Channel):
    """Loads the bf16/fp32 weight, then quantises it per output channel (vLLM's dynamic fp8)."""

    def make_weight(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter:
        return _param(*lead, rows, cols)

    def make_scale(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter | None:
        return None

    def finish(self, weight, scale) -> tuple[nn.Parameter, nn.Parameter | None]:
        if weight.dtype == FP8_DTYPE:  # finished already
            return weight, scale
        flat = weight.data.reshape(-1, weight.shape[-1])
        w_q, w_scale = per_token_quant_ref(flat)  # one scale per output row
        w_q = nn.Parameter(w_q.reshape(weight.shape), requires_grad=False)
        return w_q, nn.Parameter(w_scale.reshape(weight.shape[:-1]), requires_grad=False)


class Fp8Block(Unquantized):
    """e4m3 weight [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)]; activations quantised per token
    and group of bk columns."""

    GEMV_CONV = True

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def make_weight(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter:
        return _param(*lead, rows, cols, dtype=FP8_DTYPE)

    def make_scale(self, rows: int, cols: int, lead: tuple[int, ...] = ()) -> nn.Parameter | None:
        block_n, block_k = self.block
        return _param(*lead, -(-rows // block_n), -(-cols // block_k), dtype=torch.float32)

    def apply(self, x, weight, scale, bias) -> torch.Tensor:
        return _flat(fp8_block_linear, x, weight, scale, self.block, bias)

    def swiglu(self, x, weight, scale, norm_in=None) -> torch.Tensor | None:
        return None  # block scales: the block GEMV, then silu_and_mul

    def finish(self, weight, scale) -> tuple[nn.Parameter, nn.Parameter | None]:
        """On CUDA, decides now (not inside a graph capture) whether cuBLASLt's block recipe runs
        here: the prefill graphs then capture the route eager prefill takes."""
        if weight.is_cuda:
            cublaslt_block_ready(weight.device)
        return weight, scale

    def gemv_route(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return _one_row(x) and gemv_wins(1, n, k) and block_gemv_fits(self.block, n, k)

    def _gemv(self, x, weight, scale, bias, **extras) -> torch.Tensor | PendingNorm:
        return fp8_gemv_block(x, weight, scale, self.block, bias, **extras)

    def gemv_block_k(self, weight: torch.Tensor) -> int:
        return block_gemv_config(*weight.shape)["block_k"]

    def apply_with_tail(self, x, weight, scale, tail, conv=None) -> torch.Tensor | None:
        if tail_fits(x, tail):
            return self.one_row(x, weight, scale, tail=tail, conv=conv)
        return None


def _one_row(x: torch.Tensor) -> bool:
    """One contiguous row on the Triton route."""
    return use_triton(x) and x.numel() == x.shape[-1] and x.stride(-1) == 1


def tail_fits(x: torch.Tensor, tail: torch.Tensor | None) -> bool:
    """Whether a one-row GEMV can read `tail` after its own weight: one row on the Triton route
    and a contiguous tail weight (if any) in x's dtype."""
    return _one_row(x) and (tail is None or (tail.dtype == x.dtype and tail.is_contiguous()))


def linear_method(quant: QuantConfig | None) -> Unquantized:
    if quant is None:
        return Unquantized()
    if quant.online:
        return Fp8Online()
    if quant.scheme == "fp8_channel":
        return Fp8Channel()
    if quant.scheme == "fp8_block":
        return Fp8Block(quant.block)
    raise UnsupportedQuantization(f"quantization scheme {quant.scheme!r}")


def channel_scale(loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's per-channel ([N, 1] / [N]) or per-tensor ([1] / []) scale as [rows]."""
    flat = loaded.reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows)
    if flat.numel() != rows:
        raise ValueError(f"weight scale of {tuple(loaded.shape)} for {rows} output channels")
    return flat


def block_rows(shard_fn, rows: int, block_n: int) -> tuple[int, int]:
    """(first scale row, scale rows) of this rank's part of a segment of `rows` weight rows, cut by
    `shard_fn`; the part must start on a block boundary and end on one or at the segment end."""
    local = shard_fn(torch.arange(rows), 0)
    first, count = int(local[0]) if local.numel() else 0, local.numel()
    aligned = first % block_n == 0 and (count % block_n == 0 or first + count == rows)
    if not aligned or not torch.equal(local, torch.arange(first, first + count)):
        raise UnsupportedQuantization(
            f"fp8 block scales: this rank's rows [{first}, {first + count}) of a {rows}-row weight "
            f"do not fall on block_n = {block_n} boundaries (use a smaller tensor-parallel size)"
        )
    return first // block_n, -(-count // block_n)
