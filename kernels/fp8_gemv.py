"""Decode-sized fp8 linear as a weight read: y = x W^T with W stored fp8 e4m3 and x kept in
bf16/fp16 (weight-only fp8 at M <= GEMV_MAX_M rows).

At decode sizes a linear layer is the read of its weight: the time is bytes / bandwidth, so the
kernel's only jobs are to keep enough loads in flight and to spend nothing else. Quantising the
activations first (what the tiled and split-K fp8 GEMMs need) costs one more kernel per linear
and buys nothing here: the tensor cores are idle either way. So this kernel reads the bf16 rows
as they are, converts each weight tile to fp32 and multiply-adds (`fma`: a [M, BLOCK_N, BLOCK_K]
register tile summed over K at the end) or feeds it to the tensor cores with the rows padded to
16 (`dot`, weight tile in bf16). Each program owns BLOCK_N output channels and streams their
whole K, so no partial sums leave the SM and there is no second kernel.

Scales (dequantisation: w ~= w_q * s):
- per channel: s [N] (or one per tensor, [1]), applied to the sums;
- block: s [ceil(N / block_n), ceil(K / block_k)]; a program's BLOCK_N rows lie in one scale
  row (BLOCK_N divides block_n), so the scale folds into the activations per K group.
The reference, `fp8_gemv_ref`, is the product with the dequantised weight in fp32: what this kernel
computes up to summation order (it is closer to the full-precision layer than the fp8 x fp8
GEMMs, which also round the activations).
"""

from __future__ import annotations

import torch

from kernels.triton_utils import check_last_dim_contiguous, jit, tl

GEMV_MAX_M = 4  # rows: decode at batch 1-4 and a batch-1 MTP verify (k + 1 <= 4)


def fp8_gemv_ref(
    x: torch.Tensor,  # [M, K]
    w_q: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [N] / [1] per channel, or [ceil(N/bn), ceil(K/bk)] with block
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = w_q.shape
    w = w_q.float()
    if block is None:
        w = w * scale.float().reshape(-1, 1)
    else:
        bn, bk = block
        s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        w = w * s
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@jit
def _gemv_kernel(
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
    stride_sn,
    stride_om,
    BLOCKED: tl.constexpr,
    SCALE_N: tl.constexpr,  # block_n of block scales
    SCALE_K: tl.constexpr,  # block_k of block scales
    PER_COL: tl.constexpr,  # per-channel scales (else one per tensor)
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m_size
    n_ok = rn < n_size
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    s_row = s_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k = k0 + rk
        k_ok = k < k_size
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if BLOCKED:
            x = x * tl.load(s_row + k // SCALE_K, mask=k_ok, other=0.0)[None, :]
        if USE_DOT:
            acc = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
        else:
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    if USE_DOT:
        out = tl.trans(acc)
    else:
        out = tl.sum(acc, axis=2)
    if not BLOCKED:
        if PER_COL:
            out = out * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            out = out * tl.load(s_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def gemv_config(m: int, n: int, k: int) -> dict[str, int | bool]:
    """Tile and warps by shape (chosen from the H200 sweep in docs/benchmarks.md): small column
    blocks so that even N = 5120 gives several programs per SM, each streaming its K."""
    block_n = 8 if n <= 8192 else 16
    block_k = 512 if m <= 2 else 256
    return {"use_dot": False, "block_n": block_n, "block_k": block_k, "num_warps": 4}


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, M <= GEMV_MAX_M
    w_q: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [N] / [N, 1] / [1], or block scales [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int | bool] | None = None,
) -> torch.Tensor:
    """Same result as fp8_gemv_ref up to summation order."""
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w_q", w_q)
    (m, k), n = x.shape, w_q.shape[0]
    if w_q.shape[1] != k or m > GEMV_MAX_M:
        raise ValueError(f"fp8 GEMV: x {tuple(x.shape)} w {tuple(w_q.shape)} (M <= {GEMV_MAX_M})")
    cfg = config or gemv_config(m, n, k)
    block_n, block_k = int(cfg["block_n"]), int(cfg["block_k"])
    if block is not None and block[0] % block_n:  # a program's rows share one scale row
        raise ValueError(f"fp8 GEMV: block {block} with {block_n}-row tiles")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    s = scale.float().contiguous() if block is not None else scale.float().reshape(-1)
    _gemv_kernel[(-(-n // block_n),)](
        x,
        w_q,
        s,
        bias if bias is not None else s,
        out,
        m,
        n,
        k,
        x.stride(0),
        w_q.stride(0),
        s.stride(0) if block is not None else 0,
        out.stride(0),
        BLOCKED=block is not None,
        SCALE_N=block[0] if block is not None else 1,
        SCALE_K=block[1] if block is not None else 1,
        PER_COL=block is None and s.numel() > 1,
        HAS_BIAS=bias is not None,
        USE_DOT=bool(cfg["use_dot"]),
        EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_M=16 if cfg["use_dot"] else max(1, 1 << (m - 1).bit_length()),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=int(cfg["num_warps"]),
    )
    return out
