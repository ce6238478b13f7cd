"""Decode-sized fp8 GEMM: split-K over the weight, for M <= SPLITK_MAX_M rows.

At decode sizes an fp8 linear is a read of its weight: a tiled GEMM launches only N / BLOCK_N
programs (80 for N = 5120), too few to keep HBM busy, and cuBLASLt reads fp8 weights no faster than
bf16 ones there. Here every program reads a [BLOCK_N, K / SPLIT] slice of the weight, enough
programs for every SM, and writes fp32 partial sums; a second kernel adds the SPLIT partials,
applies the scales and bias and casts. One kernel serves both weight layouts:
- per channel (`fp8_splitk_mm`): per-token activation scale [M, 1] or [1], weight scale [N] or
  [1], applied once by the reduction (appliance_kernels/fp8.py's fp8_scaled_mm_ref contract);
- block (`fp8_splitk_block_mm`): activation scales per [1, block_k] group, weight scales per
  [block_n, block_k] tile, applied to each K block's partial product in the first kernel
  (appliance_kernels/fp8_block.py's fp8_block_mm_ref contract).
The references stay in appliance_kernels/fp8.py and appliance_kernels/fp8_block.py; their
dispatchers call this file.
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, num_sms, tl

SPLITK_MAX_M = 16  # one 16-row MMA tile; above it the tiled kernels are no longer launch-starved
# measured on the H200 (docs/benchmarks.md): split-K wins only where K is long against N (the
# 27B down projection, K = 17408, N = 5120: 1.2-1.4x the tiled kernel, 1.6x for block scales);
# at N = 5120 = K and N = 34816 the tiled kernels are 2x faster


def splitk_wins(m: int, n: int, k: int) -> bool:
    return m <= SPLITK_MAX_M and k >= 2 * n


BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128
REDUCE_BLOCK = 256


@jit
def _splitk_kernel(
    a_ptr,
    b_ptr,
    ws_ptr,
    sa_ptr,
    sb_ptr,
    m_size,
    n_size,
    k_size,
    k_per_split,
    stride_am,
    stride_bn,
    stride_sam,
    stride_sbn,
    BLOCKED: tl.constexpr,
    SCALE_N: tl.constexpr,  # block_n of the weight scales (BLOCKED)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m_size
    n_ok = rn < n_size
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_size)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k0 + rk < k_end
        a = tl.load(
            a_ptr + rm.to(tl.int64)[:, None] * stride_am + (k0 + rk)[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn.to(tl.int64)[None, :] * stride_bn + (k0 + rk)[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if BLOCKED:
            kb = k0 // BLOCK_K
            sa = tl.load(sa_ptr + rm * stride_sam + kb, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + (rn // SCALE_N) * stride_sbn + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
    tl.store(
        ws_ptr + (pid_k * m_size + rm.to(tl.int64))[:, None] * n_size + rn[None, :],
        acc,
        mask=m_ok[:, None] & n_ok[None, :],
    )


@jit
def _reduce_kernel(
    ws_ptr,
    out_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    m_size,
    n_size,
    stride_om,
    SPLIT: tl.constexpr,
    SCALED: tl.constexpr,
    SA_PER_ROW: tl.constexpr,
    SB_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = rn < n_size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + (s * m_size + m).to(tl.int64) * n_size + rn, mask=n_ok, other=0.0)
    if SCALED:
        if SA_PER_ROW:
            acc = acc * tl.load(sa_ptr + m)
        else:
            acc = acc * tl.load(sa_ptr)
        if SB_PER_COL:
            acc = acc * tl.load(sb_ptr + rn, mask=n_ok, other=0.0)
        else:
            acc = acc * tl.load(sb_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def num_splits(n: int, k: int, device: torch.device) -> int:
    """Enough programs for two waves of the SMs, each split a whole number of K blocks."""
    n_blocks = -(-n // BLOCK_N)
    k_blocks = -(-k // BLOCK_K)
    return max(1, min(k_blocks, -(-2 * num_sms(device) // n_blocks), 32))


def _launch(a_q, b_q, sa, sb, out_dtype, bias, blocked, scale_n=1, stride_sa=0, stride_sb=0):
    check_last_dim_contiguous("a_q", a_q)
    check_last_dim_contiguous("b_q", b_q)
    (m, k), n = a_q.shape, b_q.shape[0]
    if b_q.shape[1] != k or m > SPLITK_MAX_M:
        raise ValueError(f"fp8 split-K GEMM: a {tuple(a_q.shape)} b {tuple(b_q.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    split = num_splits(n, k, a_q.device)
    k_blocks = -(-k // BLOCK_K)
    k_per_split = -(-k_blocks // split) * BLOCK_K
    split = -(-k // k_per_split)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=a_q.device)
    _splitk_kernel[(-(-n // BLOCK_N), split)](
        a_q,
        b_q,
        ws,
        sa,
        sb,
        m,
        n,
        k,
        k_per_split,
        a_q.stride(0),
        b_q.stride(0),
        stride_sa,
        stride_sb,
        BLOCKED=blocked,
        SCALE_N=scale_n,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=4,
    )
    _reduce_kernel[(m, -(-n // REDUCE_BLOCK))](
        ws,
        out,
        sa,
        sb,
        bias if bias is not None else ws,
        m,
        n,
        out.stride(0),
        SPLIT=split,
        SCALED=not blocked,
        SA_PER_ROW=sa.numel() > 1,
        SB_PER_COL=sb.numel() > 1,
        HAS_BIAS=bias is not None,
        BLOCK=REDUCE_BLOCK,
        num_warps=4,
    )
    return out


def fp8_splitk_mm(
    a_q: torch.Tensor,  # [M, K] e4m3, M <= SPLITK_MAX_M
    b_q: torch.Tensor,  # [N, K] e4m3
    scale_a: torch.Tensor,  # [M, 1] or [1] fp32
    scale_b: torch.Tensor,  # [N] / [N, 1] or [1] fp32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Same result as appliance_kernels.fp8.fp8_scaled_mm_ref (fp32 accumulation)."""
    sa, sb = scale_a.float().reshape(-1), scale_b.float().reshape(-1)
    return _launch(a_q, b_q, sa, sb, out_dtype, bias, blocked=False)


def fp8_splitk_block_mm(
    a_q: torch.Tensor,  # [M, K] e4m3, M <= SPLITK_MAX_M
    a_scale: torch.Tensor,  # [M, ceil(K / block_k)] fp32
    b_q: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] fp32
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Same result as appliance_kernels.fp8_block.fp8_block_mm_ref; needs block_k == BLOCK_K and
    block_n a multiple of BLOCK_N (Qwen's 128 x 128 blocks)."""
    if block[1] != BLOCK_K or block[0] % BLOCK_N:
        raise ValueError(f"fp8 split-K block GEMM: block {block} (needs [k*{BLOCK_N}, {BLOCK_K}])")
    sa, sb = a_scale.float().contiguous(), b_scale.float().contiguous()
    return _launch(a_q, b_q, sa, sb, out_dtype, bias, True, block[0], sa.stride(0), sb.stride(0))
