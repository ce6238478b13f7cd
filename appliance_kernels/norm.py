"""RMSNorm variants used by Qwen3.5 / Qwen3-VL: zero-centred `(1 + w)`, ordinary `w`, and the gated
norm of the GDN output. Called by appliance/models/layers/norm.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,  # [T, H]; added to x before the norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual = x + residual (or x)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if zero_centered:
        out = (h * (1.0 + w)).to(x.dtype)
    else:
        # ordinary Qwen RMSNorm: cast back before the weight multiply (HF Qwen3 / Qwen3-VL)
        out = w.to(x.dtype) * h.to(x.dtype)
    return out, x


def gated_rms_norm_ref(
    x: torch.Tensor,  # [N, D]
    gate: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(gate)`: the Gated DeltaNet output norm (norm before gate)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


# -------------------------------------------------------------------------------------------------
# Triton: one program per row (RMSNorm over the hidden size) or per block of rows (gated norm over a
# head dim). Rounding follows the references step by step (the residual sum and, for the ordinary
# norm, the weight product happen in the activation dtype), so bf16 results match them bit for bit
# up to the order of the fp32 sum of squares.
# -------------------------------------------------------------------------------------------------


@jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)
        tl.store(new_res_ptr + row * stride_nr + cols, x.to(dtype), mask=ok)
    h = x / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = h * (1.0 + w)
    else:
        y = w.to(dtype).to(tl.float32) * h.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rms_norm_ref: (normed, x + residual or x)."""
    check_last_dim_contiguous("x", x)
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    new_res = x
    if residual is not None:
        check_last_dim_contiguous("residual", residual)
        new_res = torch.empty_like(out)
    if rows == 0:
        return out, new_res
    block = next_pow2(hidden)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_res,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        new_res.stride(0),
        hidden,
        eps,
        BLOCK=block,
        HAS_RES=residual is not None,
        ZERO_CENTERED=zero_centered,
        num_warps=min(max(block // 512, 1), 16),
        **pdl(x),
    )
    return out, new_res


# rows per program and warps of the gated norm at [393216, 128] on the H200 (ops/gpu/gdn_probe.py):
# 32 x 8 76.9 us, 8 x 1 77.4, 16 x 4 80.5, 32 x 4 83.8, 16 x 2 85.4; compiled reference 77.5
GATED_TUNING = {"rows": 32, "warps": 8}


@jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    rows,
    dim,
    stride_x,
    gate_heads,  # gate rows per token: row r is head r % gate_heads of token r // gate_heads
    stride_gt,
    stride_gh,
    stride_o,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (r < rows)[:, None] & (d < dim)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    h = x / tl.sqrt(tl.sum(x * x, 1) / dim + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
    y = w[None, :] * h.to(dtype).to(tl.float32)
    if ROUND_WEIGHTED:
        y = y.to(dtype).to(tl.float32)
    g_row = (r // gate_heads) * stride_gt + (r % gate_heads) * stride_gh
    gate = tl.load(gate_ptr + g_row[:, None] + d[None, :], mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    y = y * (gate / (1.0 + tl.exp(-gate)))
    tl.store(
        out_ptr + r[:, None] * stride_o + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
    )


def gated_rms_norm_triton(
    x: torch.Tensor,  # [N, D] (row stride free)
    gate: torch.Tensor,  # [N, D], or [T, H, D] with T * H = N (token and head strides free)
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """Same result as gated_rms_norm_ref. A 3-D gate is read in place: the GDN layer's z is a
    strided view of its input projection, which a reshape to [N, D] would copy for T > 1."""
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("gate", gate)
    rows, dim = x.shape
    gate3 = gate if gate.dim() == 3 else gate[:, None, :]
    if gate3.shape[0] * gate3.shape[1] != rows or gate3.shape[2] != dim:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} vs x {tuple(x.shape)}")
    out = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_d = next_pow2(dim)
    block_r = max(1, min(GATED_TUNING["rows"], 4096 // block_d))
    _gated_rms_norm_kernel[(-(-rows // block_r),)](
        x,
        gate,
        weight,
        out,
        rows,
        dim,
        x.stride(0),
        gate3.shape[1],
        gate3.stride(0),
        gate3.stride(1),
        out.stride(0),
        eps,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        ROUND_WEIGHTED=weight.dtype == x.dtype and x.dtype != torch.float32,
        num_warps=GATED_TUNING["warps"],
        **pdl(x),
    )
    return out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher used by the model layers: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, zero_centered, residual)
    return rms_norm_ref(x, weight, eps, zero_centered, residual)


def gated_rms_norm(
    x: torch.Tensor,  # [N, D]
    gate: torch.Tensor,  # [N, D], or [T, H, D] with T * H = N
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """Dispatcher used by the GDN layer: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate.reshape(x.shape), weight, eps)
