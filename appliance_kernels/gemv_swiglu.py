"""One row through a SwiGLU MLP's gate_up projection and its activation in one kernel:
out = silu(x Wg^T) * (x Wu^T) for W = [Wg; Wu] ([2I, K], gate rows first, as the MLP's
ColumnLinear lays them out), W in the model's 16-bit dtype or fp8 e4m3 with per-channel /
per-tensor scales, the row kept in bf16 / fp16.

The batch-1 decode step runs the gate_up GEMV (appliance_kernels/fp8_gemv.py) and then
appliance_kernels/activation.py's SiLU-and-mul: two launches per layer for what is one read of the
weight. Here each program owns BLOCK_N activation channels, streams the BLOCK_N gate rows and the
BLOCK_N up rows of the same channels over the whole K (so a program reads what two programs of the
plain GEMV read) and finishes the activation in registers: one kernel, no [1, 2I] intermediate. The
rounding follows the unfused path (gate and up rounded to the row's dtype as the GEMV stores them,
the SiLU rounded as F.silu's output), so the result is the same up to summation order.

Off by default (USE_SWIGLU; bench_static.py --swiglu on): on the H200 the 27B batch-1 step was
no faster with it (runs BA, BT; run CV in docs/benchmarks.md, with the split norms of
appliance_kernels/gemv_norm.py finished inside it and the down GEMV released early: online fp8
8.24 against 8.18 ms, bf16 13.60 against 13.29). Run AM fused the activation into the *down*
projection instead, where every program re-read the whole [gate | up] row, and lost; this fusion
reads each weight byte once.
"""

from __future__ import annotations

import torch

from appliance_kernels.activation import silu_and_mul_ref
from appliance_kernels.fp8_gemv import bf16_gemv_config, fp8_gemv_ref, gemv_config
from appliance_kernels.gemv_epilogue import load_partials, rstd_of, swiglu_store
from appliance_kernels.gemv_norm import PendingNorm, check_pending, norm_in_args
from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    gemv_pdl,
    jit,
    pdl_release,
    pdl_wait,
    tl,
    use_triton,
)

USE_SWIGLU = False  # the MLP's one-row gate_up + activation as one kernel (see the docstring)
# Under PDL the kernel lets the down projection's GEMV launch as its own programs start (a GEMV
# after a GEMV otherwise waits for the launch; see appliance_kernels/gemv_norm.py).
RELEASE_NEXT = True
SWIGLU_DTYPES = (torch.bfloat16, torch.float16)


def gemv_swiglu_ref(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [2I, K] (e4m3 with `scale`, or 16-bit)
    scale: torch.Tensor | None = None,  # [2I] / [1]
) -> torch.Tensor:
    """The unfused path: the projection as the GEMV stores it (x's dtype), then SiLU-and-mul."""
    ones = torch.ones(1, device=w.device)
    return silu_and_mul_ref(fp8_gemv_ref(x, w, scale if scale is not None else ones))


@jit
def _gemv_swiglu_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    inter,
    k_size,
    stride_wn,
    np_ptr,  # NORM_IN: x is a pending norm's x_pre (appliance_kernels/gemv_norm.py)
    n_parts,
    norm_eps,
    SCALED: tl.constexpr,
    PER_COL: tl.constexpr,
    EVEN: tl.constexpr,  # inter % BLOCK_N == 0 and K % BLOCK_K == 0
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_IN: tl.constexpr = False,
    PARTS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    RELEASE: tl.constexpr = False,
):
    if RELEASE:
        pdl_release(PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < inter
    gate_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (rn + inter).to(tl.int64)[:, None] * stride_wn
    pdl_wait(PDL)
    if NORM_IN:
        partials = load_partials(np_ptr, n_parts, PARTS)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        if EVEN:
            wg = tl.load(gate_rows + k[None, :])
            wu = tl.load(up_rows + k[None, :])
            x = tl.load(x_ptr + k)
        else:
            k_ok = k < k_size
            ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(gate_rows + k[None, :], mask=ok, other=0.0)
            wu = tl.load(up_rows + k[None, :], mask=ok, other=0.0)
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        xf = x.to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * xf
        acc_u += wu.to(tl.float32) * xf
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if NORM_IN:
        rstd = rstd_of(partials, k_size, norm_eps)
        gate, up = gate * rstd, up * rstd
    swiglu_store(gate, up, rn, n_ok, s_ptr, inter, out_ptr, SCALED, PER_COL)


def swiglu_config(inter: int, k: int, fp8: bool = True) -> dict[str, int]:
    """The plain GEMV's tile over the [2I, K] weight (appliance_kernels/fp8_gemv.py, fp8 or
    16-bit), half its rows per program for the gate and half for the up projection: the same
    bytes per program and K steps in flight."""
    cfg = dict(gemv_config(2 * inter, k) if fp8 else bf16_gemv_config(2 * inter, k))
    cfg["block_n"] = max(cfg["block_n"] // 2, 1)
    return cfg


def gemv_swiglu(
    x: torch.Tensor,  # [1, K] (or [K]) bf16 / fp16
    w: torch.Tensor,  # [2I, K] in x's dtype, or e4m3 with `scale`
    scale: torch.Tensor | None = None,  # [2I] per channel or [1] per tensor
    config: dict[str, int] | None = None,
    norm_in: PendingNorm | None = None,  # x is its x_pre: gate and up times its 1 / rms
) -> torch.Tensor:
    """Same result as gemv_swiglu_ref up to summation order: [1, I] (or [I] for a [K] row)."""
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w", w)
    rows, k = w.shape
    if x.shape[-1] != k or x.numel() != k or rows % 2:
        raise ValueError(f"gemv_swiglu: x {tuple(x.shape)} w {tuple(w.shape)} (one row of K)")
    if x.dtype not in SWIGLU_DTYPES or (scale is None and w.dtype != x.dtype):
        raise ValueError(f"gemv_swiglu: x {x.dtype} with w {w.dtype} (16-bit row; w alike or fp8)")
    if norm_in is not None:
        check_pending(x, norm_in)
    inter = rows // 2
    cfg = config or swiglu_config(inter, k, scale is not None)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    s = scale.float().reshape(-1) if scale is not None else out
    norm_args, norm_consts = norm_in_args(norm_in, out)
    _gemv_swiglu_kernel[(-(-inter // block_n),)](
        x,
        w,
        s,
        out,
        inter,
        k,
        w.stride(0),
        *norm_args,
        SCALED=scale is not None,
        PER_COL=scale is not None and s.numel() > 1,
        EVEN=inter % block_n == 0 and k % block_k == 0,
        STAGES=cfg.get("stages", 1),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
        **norm_consts,
        **release_pdl(gemv_pdl(w)),
    )
    return out


def release_pdl(options: dict) -> dict:
    """Its PDL launch options: the down projection's GEMV launches as its programs start
    (RELEASE_NEXT), as after a split norm's producer (appliance_kernels/gemv_norm.py)."""
    return options | {"RELEASE": True} if options and RELEASE_NEXT else options


def swiglu_fits(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the MLP may take gemv_swiglu (USE_SWIGLU, CUDA, one 16-bit row, a contiguous
    weight: 16-bit like the row, or fp8 with one scale per channel or tensor)."""
    return (
        USE_SWIGLU
        and use_triton(x)
        and x.numel() == x.shape[-1]
        and x.dtype in SWIGLU_DTYPES
        and x.stride(-1) == 1
        and w.stride(-1) == 1
        and (w.dtype == x.dtype if scale is None else scale.numel() in (1, w.shape[0]))
        and (scale is None or scale.dim() <= 1 or scale.shape[-1] == 1)
    )
