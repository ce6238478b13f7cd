"""A few rows times a weight, as a weight read on the tensor cores: y = x W^T for 2-16 rows x
(an MTP verify at batch 1-4, a small decode batch) and W in the model's 16-bit dtype or fp8 e4m3
with per-channel / per-tensor scales (weight-only: the rows stay 16-bit).

At these sizes the time is the weight's bytes over the bandwidth, as for one row
(appliance_kernels/fp8_gemv.py); what changes is the arithmetic. The one-row GEMV's register tile
([BLOCK_N, BLOCK_K] fp32 multiply-adds) grows with every row (`_gemv_rows_kernel` holds
[ROWS, BLOCK_N, BLOCK_K]), so past one row it runs out of registers or of issue slots before it
runs out of bandwidth. Here each program owns BLOCK_N output channels, streams their whole K
(no partial sums leave the SM, no second kernel) and multiplies each [BLOCK_N, BLOCK_K] weight
tile into the rows with one `tl.dot` of [BLOCK_M = 16, BLOCK_K] x [BLOCK_K, BLOCK_N] (rows past
M are masked to zero): the accumulator is [16, BLOCK_N] whatever M is, and the K loop is
software-pipelined to keep the weight loads in flight. An fp8 tile is converted to the rows'
dtype before the dot (one e4m3 -> 16-bit conversion per element, as the GEMV does to fp32) and
the per-channel scale is applied to the [16, BLOCK_N] result.

The reference is the product with the dequantised weight in fp32 (fp8_gemv_ref): the same up to
summation order.
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    gemv_pdl,
    jit,
    pdl_release,
    pdl_wait,
    tl,
)

ROWS_MAX = 16  # one tl.dot tile of rows
USE_ROWS = True  # False: the routes before this kernel (bench_static.py --rows off)
ROUTED_ROWS = (2, 8)  # the row counts `linear` sends here
ROWS_DTYPES = (torch.bfloat16, torch.float16)


@jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    m_size,
    n_size,
    k_size,
    stride_xm,
    stride_wn,
    stride_om,
    SCALED: tl.constexpr,  # an fp8 weight's scales (a 16-bit weight has none)
    PER_COL: tl.constexpr,  # per-channel scales (else one per tensor)
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 16: the dot's smallest row tile
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    RELEASE: tl.constexpr = False,
):
    if RELEASE:
        pdl_release(PDL)
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m_size
    n_ok = rn < n_size
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        if EVEN:
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = k < k_size
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    store_rows(
        acc, s_ptr, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, SCALED, PER_COL, HAS_BIAS
    )


@jit
def store_rows(
    acc,  # [rows, BLOCK_N] fp32 products of rows rm and output channels rn
    s_ptr,
    bias_ptr,
    out_ptr,
    rm,
    rn,
    m_ok,
    n_ok,
    stride_om,
    SCALED: tl.constexpr,
    PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The rows GEMVs' epilogue (this kernel's and appliance_kernels/fp8_gemv.py's FMA one): the
    weight's scales, the bias, the masked store in the output's dtype."""
    if SCALED:
        if PER_COL:
            acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def rows_wins(m: int, n: int, k: int) -> bool:
    """Where `linear` takes this kernel for a 16-bit weight (after the one-row GEMV and the FMA
    rows GEMV of a long K, appliance_kernels.fp8_gemv.bf16_gemv_wins): 2-8 rows. On the H200 (run
    AU, ops/bench/bench_gemv_rows.py, 27B projections at 2 / 4 / 8 rows, µs) it read gate_up in 85
    against cuBLAS's 88, in_proj 40.8 / 41.2, qkv 36.3 / 36.6, out_proj 18.1 / 18.1, and the down
    projection in 45 against cuBLAS's 52 (the FMA rows kernel: 42 at 2-4 rows). An fp8 weight stays
    on the fp8 x fp8 route: its e4m3 -> bf16 conversion made this kernel 1.3-2.9x slower there
    (gate_up 65 µs against 53)."""
    return USE_ROWS and ROUTED_ROWS[0] <= m <= ROUTED_ROWS[1]


def rows_config(n: int, k: int) -> dict[str, int]:
    """Tile, warps and K-loop stages: run AU's best at each 27B projection (64 output channels
    a program everywhere; 128-wide K steps up to K = 5120, 4 in flight, 3 for the widest N;
    256-wide K steps, 4 in flight, past it). 16 x 256 tiles were 15-40 % slower."""
    if k <= 5120:
        return {"block_n": 64, "block_k": 128, "num_warps": 4, "stages": 3 if n > 20000 else 4}
    return {"block_n": 64, "block_k": 256, "num_warps": 4, "stages": 4}


def gemv_rows(
    x: torch.Tensor,  # [M, K] (or [..., K]) bf16 / fp16, M <= ROWS_MAX
    w: torch.Tensor,  # [N, K] in x's dtype, or e4m3 with `scale`
    scale: torch.Tensor | None = None,  # [N] / [N, 1] per channel, or [1] per tensor
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Same result as appliance_kernels.fp8_gemv.fp8_gemv_ref up to summation order; [..., N]."""
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w", w)
    n, k = w.shape
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if x.shape[-1] != k or not 1 <= m <= ROWS_MAX:
        raise ValueError(
            f"gemv_rows: x {tuple(x.shape)} w {tuple(w.shape)} (1-{ROWS_MAX} rows of K)"
        )
    if x.dtype not in ROWS_DTYPES or (scale is None and w.dtype != x.dtype):
        raise ValueError(f"gemv_rows: x {x.dtype} with w {w.dtype} (16-bit rows; w alike or fp8)")
    cfg = config or rows_config(n, k)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = scale.float().reshape(-1) if scale is not None else out
    _gemv_dot_kernel[(-(-n // block_n),)](
        rows,
        w,
        s,
        bias if bias is not None else s,
        out,
        m,
        n,
        k,
        rows.stride(0),
        w.stride(0),
        out.stride(0),
        SCALED=scale is not None,
        PER_COL=scale is not None and s.numel() > 1,
        HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0,
        STAGES=cfg.get("stages", 1),
        BLOCK_M=ROWS_MAX,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
        **gemv_pdl(w),
    )
    return out.reshape(*x.shape[:-1], n)
