"""fp8 e4m3 activation quantisation (per token, per tensor) and the scaled GEMM of per-channel fp8
linears and fp8 experts: references, Triton kernels and the dispatchers `fp8_quant`,
`fp8_scaled_mm` and `fp8_linear` (the backend chosen in appliance_kernels.backends,
APPLIANCE_FP8_GEMM). `fp8_linear` is what fp8 linear layers with per-channel weight scales run
(compressed-tensors FP8_DYNAMIC checkpoints, online --quantization fp8:
appliance/models/layers/quant_methods.py); block-scaled checkpoints (Qwen "-FP8") use
appliance_kernels/fp8_block.py. On the Triton route, decode sizes run the weight-only GEMV of
appliance_kernels/fp8_gemv.py (one row, where it wins: bf16 activations, no quantisation kernel) or,
with a long K (M <= 16, K >= 2N), the split-K kernel of appliance_kernels/fp8_splitk.py. Also called
by appliance_kernels/moe_triton.py (per-token activation quantisation of fp8 experts).

Scales are dequantisation scales: x ~= x_q * scale. Weights are [N, K] row-major e4m3 with a scale
per output channel [N] or one per tensor [1].
"""

from __future__ import annotations

import torch

from appliance_kernels import backends
from appliance_kernels.adapters import fp8_scaled_mm_external
from appliance_kernels.fp8_gemv import fp8_gemv, gemv_wins
from appliance_kernels.fp8_splitk import fp8_splitk_mm, splitk_wins
from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row quantises with this scale instead of dividing by zero


# ------------------------------------------- references -------------------------------------------


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (x_q [T, H] e4m3, scale [T, 1] fp32)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_tensor_quant_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (x_q e4m3, scale [1] fp32); a given scale is static, else the tensor's amax."""
    if scale is None:
        scale = (x.float().abs().amax() / FP8_MAX).clamp_min(MIN_SCALE).reshape(1)
    scale = scale.float().reshape(1)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_scaled_mm_ref(
    a_q: torch.Tensor,  # [M, K] e4m3
    b_q: torch.Tensor,  # [N, K] e4m3
    scale_a: torch.Tensor,  # [M, 1] per token or [1] per tensor
    scale_b: torch.Tensor,  # [N] / [N, 1] per channel or [1] per tensor
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Dequantise both operands and multiply in fp32."""
    a = a_q.float() * scale_a.float().reshape(-1, 1)
    b = b_q.float() * scale_b.float().reshape(-1, 1)
    out = a @ b.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# --------------------------------------------- Triton ---------------------------------------------


@jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, hidden, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < hidden)


@jit
def _amax_kernel(
    x_ptr, amax_ptr, rows, hidden, stride_x, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    amax = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = (r < rows)[:, None] & (cols < hidden)[None, :]
        x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(tl.max(amax, 1), 0))


@jit
def _static_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    hidden,
    stride_x,
    stride_q,
    FROM_AMAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (cols < hidden)[None, :]
    scale = tl.load(s_ptr)
    if FROM_AMAX:
        scale = tl.maximum(scale / 448.0, 1e-12)
    x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + r[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_last_dim_contiguous("x", x)
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(next_pow2(hidden), 4096)
        _per_token_quant_kernel[(rows,)](
            x,
            q,
            scale,
            hidden,
            x.stride(0),
            q.stride(0),
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    return q, scale


def per_tensor_quant_triton(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_last_dim_contiguous("x", x)
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=FP8_DTYPE, device=x.device)
    block_r, block_h = 4, min(next_pow2(hidden), 1024)
    if scale is None:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        if rows:
            _amax_kernel[(-(-rows // block_r),)](
                x, amax, rows, hidden, x.stride(0), BLOCK_R=block_r, BLOCK_H=block_h
            )
        source, from_amax = amax, True
    else:
        source, from_amax = scale.float().reshape(1), False
    if rows:
        grid = (-(-rows // block_r), -(-hidden // block_h))
        _static_quant_kernel[grid](
            x,
            q,
            source,
            rows,
            hidden,
            x.stride(0),
            q.stride(0),
            FROM_AMAX=from_amax,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
        )
    if from_amax:
        source = (source / FP8_MAX).clamp_min(MIN_SCALE)
    return q, source


@jit
def _fp8_mm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    m_size,
    n_size,
    k_size,
    stride_am,
    stride_bn,
    stride_om,
    stride_sam,  # block scales only: row stride of the activation / weight scale tables
    stride_sbn,
    SA_PER_ROW: tl.constexpr,
    SB_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,  # False: one scale per row / column / tensor, applied after the
    # K loop; True (appliance_kernels/fp8_block.py): the weight's scale per [SCALE_ROWS_N, BLOCK_K]
    # tile and the activation's per row and BLOCK_K group, applied at every K step
    SCALE_ROWS_N: tl.constexpr,  # block_n of the weight's block scales (1 without them)
    SUB: tl.constexpr = 1,  # block scales: K groups per loop step, their dots issued together
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(m_size, BLOCK_M)
    num_n = tl.cdiv(n_size, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < m_size, rn < n_size
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    sa_ptrs = sa_ptr + rm.to(tl.int64) * stride_sam
    sb_ptrs = sb_ptr + (rn // SCALE_ROWS_N).to(tl.int64) * stride_sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    groups = tl.cdiv(k_size, BLOCK_K)
    for kb in range(0, tl.cdiv(groups, SUB)):
        k_ok = rk + kb * SUB * BLOCK_K < k_size
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if BLOCK_SCALES:
            g = kb * SUB
            sa = tl.load(sa_ptrs + g, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptrs + g, mask=n_ok, other=0.0)
            if SUB == 2:  # the second group's dot issued before the first is scaled
                k1_ok = rk + (g + 1) * BLOCK_K < k_size
                a1 = tl.load(a_ptrs + BLOCK_K, mask=m_ok[:, None] & k1_ok[None, :], other=0.0)
                b1 = tl.load(b_ptrs + BLOCK_K, mask=n_ok[None, :] & k1_ok[:, None], other=0.0)
                d0 = tl.dot(a, b)
                d1 = tl.dot(a1, b1)
                g1 = tl.minimum(g + 1, groups - 1)  # past the last group d1 is zero
                sa1 = tl.load(sa_ptrs + g1, mask=m_ok, other=0.0)
                sb1 = tl.load(sb_ptrs + g1, mask=n_ok, other=0.0)
                acc += d0 * sa[:, None] * sb[None, :] + d1 * sa1[:, None] * sb1[None, :]
            else:
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += SUB * BLOCK_K
        b_ptrs += SUB * BLOCK_K
    if not BLOCK_SCALES:
        if SA_PER_ROW:
            acc = acc * tl.load(sa_ptr + rm, mask=m_ok, other=0.0)[:, None]
        else:
            acc = acc * tl.load(sa_ptr)
        if SB_PER_COL:
            acc = acc * tl.load(sb_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            acc = acc * tl.load(sb_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def launch_fp8_mm(
    a_q: torch.Tensor,  # [M, K] e4m3
    b_q: torch.Tensor,  # [N, K] e4m3
    sa: torch.Tensor,  # fp32: [M] / [1], or [M, K/bk] with block scales
    sb: torch.Tensor,  # fp32: [N] / [1], or [N/bn, K/bk] with block scales
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,  # [N]
    cfg: dict[str, int],  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages
    scale_block_n: int = 0,  # block_n of block scales (BLOCK_K is then their block_k); 0: none
) -> torch.Tensor:
    """The one fp8 GEMM kernel for both scale granularities (shapes checked by the callers)."""
    m, n, k = a_q.shape[0], b_q.shape[0], a_q.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    block = scale_block_n > 0
    if cfg.get("SUB", 1) != 1 and not block:
        raise ValueError(f"fp8 GEMM: SUB {cfg['SUB']} needs block scales")
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]),)
    _fp8_mm_kernel[grid](
        a_q,
        b_q,
        out,
        sa,
        sb,
        bias if bias is not None else sb,
        m,
        n,
        k,
        a_q.stride(0),
        b_q.stride(0),
        out.stride(0),
        sa.stride(0) if block else 0,
        sb.stride(0) if block else 0,
        SA_PER_ROW=sa.numel() > 1,
        SB_PER_COL=sb.numel() > 1,
        HAS_BIAS=bias is not None,
        BLOCK_SCALES=block,
        SCALE_ROWS_N=max(1, scale_block_n),
        **cfg,
    )
    return out


def _mm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Block sizes per size class of M (and at decode sizes of the weight's shape), fixed from H200
    measurements (docs/benchmarks.md; an autotuned variant picked slower tiles for small M at
    N = K = 5120 and was dropped). Decode sizes, ops/gpu/fp8_mm_probe.py at the 27B projections
    (run CD): up to 16 rows 64 x 256 tiles, 4 stages, except the widest N (gate_up, 34816: 64 x 128,
    3 stages, 47.1 µs against 51.3); 17-64 rows 64 x 256 tiles, 5 stages where K > 5120 (down 27.6
    µs against 43.9 for 64 x 128 x 4, out_proj 11.6 against 16.7), 128 x 128 x 3 at the widest N
    (gate_up 48.9 against 53.1), 64 x 256 x 3 elsewhere (in_proj 24.2 against 25.0)."""
    if m <= 16:
        if n > 20000:
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        if k > 5120:
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=5)
        if n > 20000:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def fp8_scaled_mm_triton(
    a_q: torch.Tensor,  # [M, K] e4m3
    b_q: torch.Tensor,  # [N, K] e4m3
    scale_a: torch.Tensor,  # [M, 1] or [1] fp32
    scale_b: torch.Tensor,  # [N] / [N, 1] or [1] fp32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Same result as fp8_scaled_mm_ref (fp32 accumulation)."""
    check_last_dim_contiguous("a_q", a_q)
    check_last_dim_contiguous("b_q", b_q)
    m, k = a_q.shape
    if b_q.shape[1] != k:
        raise ValueError(f"fp8_scaled_mm: a {a_q.shape} b {b_q.shape}")
    sa, sb = scale_a.float().reshape(-1), scale_b.float().reshape(-1)
    return launch_fp8_mm(a_q, b_q, sa, sb, out_dtype, bias, _mm_config(m, b_q.shape[0], k))


# ------------------------------------------ dispatchers ------------------------------------------


def fp8_quant(
    x: torch.Tensor, per_token: bool = True, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (default) or per-tensor (dynamic, or static with `scale`) e4m3 quantisation."""
    if per_token:
        return per_token_quant_triton(x) if use_triton(x) else per_token_quant_ref(x)
    return per_tensor_quant_triton(x, scale) if use_triton(x) else per_tensor_quant_ref(x, scale)


def fp8_scaled_mm(
    a_q: torch.Tensor,  # [M, K] e4m3
    b_q: torch.Tensor,  # [N, K] e4m3
    scale_a: torch.Tensor,  # [M, 1] or [1]
    scale_b: torch.Tensor,  # [N] / [N, 1] or [1]
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scaled GEMM through the backend chosen in appliance_kernels.backends (the reference on
    CPU)."""
    if not a_q.is_cuda:
        return fp8_scaled_mm_ref(a_q, b_q, scale_a, scale_b, out_dtype, bias)
    route = fp8_gemm_route(backends.selected("fp8_gemm"), a_q.shape[0], a_q.device)
    if route == "triton":
        if splitk_wins(a_q.shape[0], b_q.shape[0], a_q.shape[1]):  # decode sizes, long K
            return fp8_splitk_mm(a_q, b_q, scale_a, scale_b, out_dtype, bias)
        return fp8_scaled_mm_triton(a_q, b_q, scale_a, scale_b, out_dtype, bias)
    if route == "reference":
        return fp8_scaled_mm_ref(a_q, b_q, scale_a, scale_b, out_dtype, bias)
    return fp8_scaled_mm_external(route, a_q, b_q, scale_a, scale_b, out_dtype, bias)


def fp8_gemm_route(backend: str, m: int, device: torch.device) -> str:
    """Where one GEMM of M rows on a CUDA device runs, given the configured backend: "triton",
    "reference", or an adapter of appliance_kernels.adapters ("torch" = cuBLASLt, "sgl",
    "cutlass")."""
    if backend == backends.MIXED_FP8:
        backend = "triton" if m <= backends.FP8_TRITON_MAX_M else "torch"
    if backend == "torch" and torch.cuda.get_device_capability(device) < (9, 0):
        return "reference"  # cuBLASLt row-wise scales need SM90+; below it dequantise + matmul
    return backend


def one_row_gemv(x: torch.Tensor, weight_q: torch.Tensor) -> bool:
    """Whether fp8_linear reads this weight with the one-row GEMV (CUDA, the Triton route, where
    appliance_kernels.fp8_gemv.gemv_wins)."""
    return (
        use_triton(x)
        and gemv_wins(x.shape[0], *weight_q.shape)
        and fp8_gemm_route(backends.selected("fp8_gemm"), x.shape[0], x.device) == "triton"
    )


def fp8_linear(
    x: torch.Tensor,  # [T, K] bf16 / fp16
    weight_q: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] or [1]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x W^T for an fp8 weight: dynamic per-token activation quant, then the scaled GEMM; at
    batch 1 on the Triton route, where it wins, the weight-only GEMV of
    appliance_kernels/fp8_gemv.py."""
    if one_row_gemv(x, weight_q):
        return fp8_gemv(x, weight_q, weight_scale, bias=bias)
    x_q, x_scale = fp8_quant(x, per_token=True)
    return fp8_scaled_mm(x_q, weight_q, x_scale, weight_scale, x.dtype, bias)
