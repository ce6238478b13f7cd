"""Fused MoE for decode sizes: one program per (token, slot) pair and block of output columns,
no sorting by expert.

At batch 1 the grouped-GEMM path (appliance_kernels/moe_triton.py) launches its grids for the worst
case (every expert padded to a 16-row block: 241 row blocks for 8 rows of Qwen3.5-35B-A3B, nearly
all of them empty) after a dozen small sorting kernels, while the work is a read of 8 experts'
weights. Here the gate_up kernel computes silu(gate) * up for each pair as a matrix-vector product
over its expert's weight rows, the down kernel multiplies by the routing weight, and
appliance_kernels/moe_sum.py adds the top-k rows and the gated shared expert: three launches, each
sized by the T * k pairs. fp8 weights are dequantised as they are read (per-channel or per-tensor
scales), the math of appliance_kernels.moe.fused_moe_fp8_ref. Called by fused_moe_triton for at most
GEMV_MAX_ROWS pairs.
"""

from __future__ import annotations

import torch

from appliance_kernels.moe_sum import moe_sum
from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl

# T * k pairs: 32 tokens of Qwen3.5-35B-A3B (top 8). On the H200 (docs/benchmarks.md, runs BB
# and BC, in CUDA graphs) these kernels beat the grouped GEMMs up to 256 pairs (bf16 at 16 tokens
# 191 against 238 us, the touched experts' floor 157; fp8 at 32 tokens 189 against 224) and lose
# at 512, where token pairs re-read experts that the grouped GEMM reads once for all its rows;
# the 35B-A3B decode step at batch 16 / 24 / 32: 11.79 / 15.35 / 18.43 ms against 12.97 / 16.46
# / 18.66 with the grouped GEMMs.
GEMV_MAX_ROWS = 256
BLOCK_N = 32
BLOCK_K = 128


@jit
def _gemv_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    w_scale_ptr,
    route_w_ptr,
    n_size,
    k_size,
    top_k,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    stride_se,
    GATE_UP: tl.constexpr,  # True: silu(W_g a) * (W_u a), a = x[pair // k]; False: w * W h[pair]
    SCALED: tl.constexpr,  # fp8 weights: dequantisation scales
    W_PER_CHANNEL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if GATE_UP:
        row = pair // top_k
    else:
        row = pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_size
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + row.to(tl.int64) * stride_at
    w1 = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    w2 = w1 + n_size * stride_wn  # up rows follow the gate rows
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k_ok = k0 + kk < k_size
        a = tl.load(a_base + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        acc1 += tl.sum(tl.load(w1 + k0, mask=mask, other=0.0).to(tl.float32) * a[None, :], 1)
        if GATE_UP:
            acc2 += tl.sum(tl.load(w2 + k0, mask=mask, other=0.0).to(tl.float32) * a[None, :], 1)
    if SCALED:
        s1, s2 = expert_weight_scales(
            w_scale_ptr, expert, stride_se, n, n_ok, n_size, GATE_UP, W_PER_CHANNEL
        )
        acc1 = acc1 * s1
        acc2 = acc2 * s2
    if GATE_UP:
        result = acc1 / (1.0 + tl.exp(-acc1)) * acc2
    else:
        result = acc1 * tl.load(route_w_ptr + pair)
    tl.store(out_ptr + pair * stride_ot + n, result.to(out_ptr.dtype.element_ty), mask=n_ok)


@jit
def expert_weight_scales(
    w_scale_ptr,
    expert,
    stride_se,
    n,
    n_ok,
    n_size,
    GATE_UP: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
):
    """The fp8 dequantisation scales of an expert's output columns `n` [BLOCK_N]: per channel
    ([E, N], the up rows' scales after the gate rows' when GATE_UP) or one per expert ([E])."""
    base = w_scale_ptr + expert * stride_se
    if W_PER_CHANNEL:
        s1 = tl.load(base + n, mask=n_ok, other=0.0)
        s2 = s1
        if GATE_UP:
            s2 = tl.load(base + n_size + n, mask=n_ok, other=0.0)
    else:
        s1 = tl.load(base + n * 0, mask=n_ok, other=0.0)  # the expert's scale, per column
        s2 = s1
    return s1, s2


def scale_args(scale: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """Kernel arguments for optional expert weight scales: the fp32 tensor (`dummy` when there
    are none: never read), its expert stride and whether it is per channel."""
    if scale is None:
        return dummy, 0, False
    scale = scale.float()
    return scale, scale.stride(0), scale.dim() == 2


def _launch(a, w, out, ids, scale, route_w, n, k, top_k, gate_up):
    scaled = scale is not None
    scale, stride_se, per_channel = scale_args(scale, route_w)
    block_n = min(next_pow2(n), BLOCK_N)
    _gemv_kernel[(ids.numel(), -(-n // block_n))](
        a,
        w,
        out,
        ids,
        scale,
        route_w,
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        stride_se,
        GATE_UP=gate_up,
        SCALED=scaled,
        W_PER_CHANNEL=per_channel,
        BLOCK_N=block_n,
        BLOCK_K=min(next_pow2(k), BLOCK_K),
        num_warps=4,
    )


def fused_moe_gemv(
    x: torch.Tensor,  # [T, H], T * k <= GEMV_MAX_ROWS
    w_gate_up: torch.Tensor,  # [E, 2I, H] bf16/fp16, or e4m3 with w_gate_up_scale
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    *,
    w_gate_up_scale: torch.Tensor | None = None,  # [E, 2I] per channel or [E] per tensor (fp8)
    w_down_scale: torch.Tensor | None = None,  # [E, H] or [E] (fp8)
    shared_output: torch.Tensor | None = None,  # [T, H]
    shared_gate: torch.Tensor | None = None,  # [T, 1] logits (sigmoid applied)
) -> torch.Tensor:
    """Same result as fused_moe_ref / fused_moe_fp8_ref (+ the gated shared expert)."""
    check_last_dim_contiguous("x", x)
    num_tokens, hidden = x.shape
    inter = w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    if num_tokens * top_k > GEMV_MAX_ROWS:
        raise ValueError(f"fused_moe_gemv: {num_tokens} x {top_k} rows > {GEMV_MAX_ROWS}")
    if (w_gate_up_scale is None) != (w_down_scale is None):
        raise ValueError("fused_moe: fp8 weights need both weight scales")
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    ids = topk_ids.reshape(-1).contiguous()
    route_w = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(ids.numel(), inter, dtype=torch.float32, device=x.device)
    _launch(x, w_gate_up, h, ids, w_gate_up_scale, route_w, inter, hidden, top_k, True)
    rows = torch.empty(ids.numel(), hidden, dtype=torch.float32, device=x.device)
    _launch(h, w_down, rows, ids, w_down_scale, route_w, hidden, inter, 1, False)
    return moe_sum(rows, out, top_k, shared_output, shared_gate)
