"""Fused MoE in Triton: rows sorted by expert (no host sync), a grouped gate_up GEMM with
SiLU-and-mul fused, a grouped down GEMM scaled by the routing weight, and a sum over the top-k rows
that adds the sigmoid-gated shared expert. bf16 / fp16 weights, or e4m3 weights with per-channel or
per-tensor scales (activations then quantised per token). Called by `fused_moe` in
appliance_kernels/moe.py.
"""

from __future__ import annotations

import torch

import appliance_kernels.moe_gemv as moe_gemv
from appliance_kernels.fp8 import FP8_DTYPE, per_token_quant_triton
from appliance_kernels.moe_gemv import expert_weight_scales, fused_moe_gemv, scale_args
from appliance_kernels.moe_sum import moe_sum
from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, slot) rows by expert, each expert padded to a multiple of block_m.
    Returns (sorted_rows [capacity] with T*k as padding, block_expert [capacity / block_m] with -1
    for unused blocks); capacity is the worst case, so nothing here waits for the device."""
    flat = topk_ids.flatten().long()  # [T*k]
    rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows, device=device) - first_of_expert[flat[order]]
    capacity = rows + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_rows = torch.full((capacity,), rows, dtype=torch.int32, device=device)
    sorted_rows[starts[flat[order]] + rank] = order.int()
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).int()
    return sorted_rows, block_expert


@jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    a_scale_ptr,
    w_scale_ptr,
    route_w_ptr,
    num_rows,
    n_size,
    k_size,
    top_k,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    stride_se,
    GATE_UP: tl.constexpr,  # True: silu(A Wg^T) * (A Wu^T) over tokens; False: A W^T over rows
    FP8: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    ids = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (token, slot) rows
    valid = ids < num_rows
    if GATE_UP:
        a_rows = ids // top_k
    else:
        a_rows = ids
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_size
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_at + kk[None, :]
    w_base = w_ptr + expert * stride_we + kk[:, None]
    b1_ptrs = w_base + n[None, :].to(tl.int64) * stride_wn  # [BLOCK_K, BLOCK_N]
    b2_ptrs = w_base + (n + n_size)[None, :].to(tl.int64) * stride_wn  # up rows follow gate rows
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k_ok = kk + k0 < k_size
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b1 = tl.load(b1_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:  # fp32 activations: exact products (tests), not tf32
            acc1 = tl.dot(a, b1, acc1, input_precision="ieee")
        else:
            acc1 = tl.dot(a, b1, acc1)
        if GATE_UP:
            b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(a, b2, acc2)
        a_ptrs += BLOCK_K
        b1_ptrs += BLOCK_K
        b2_ptrs += BLOCK_K
    if FP8:
        sa = tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)[:, None]
        s1, s2 = expert_weight_scales(
            w_scale_ptr, expert, stride_se, n, n_ok, n_size, GATE_UP, W_PER_CHANNEL
        )
        acc1 = acc1 * sa * s1[None, :]
        acc2 = acc2 * sa * s2[None, :]
    if GATE_UP:
        result = acc1 / (1.0 + tl.exp(-acc1)) * acc2
    else:
        result = acc1
    if ROUTE_WEIGHT:
        result = result * tl.load(route_w_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + ids.to(tl.int64)[:, None] * stride_ot + n[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )


def _block_m(num_rows: int, num_experts: int) -> int:
    per_expert = num_rows / max(num_experts, 1)
    return 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] bf16/fp16, or e4m3 with w_gate_up_scale
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    *,
    w_gate_up_scale: torch.Tensor | None = None,  # [E, 2I] per channel or [E] per tensor (fp8)
    w_down_scale: torch.Tensor | None = None,  # [E, H] or [E] (fp8)
    shared_output: torch.Tensor | None = None,  # [T, H] shared expert output
    shared_gate: torch.Tensor | None = None,  # [T, 1] shared expert gate logits (sigmoid applied)
) -> torch.Tensor:
    """Same result as fused_moe_ref (+ sigmoid(shared_gate) * shared_output when given); at
    most moe_gemv.GEMV_MAX_ROWS (token, slot) pairs run appliance_kernels/moe_gemv.py instead."""
    kwargs = dict(
        w_gate_up_scale=w_gate_up_scale,
        w_down_scale=w_down_scale,
        shared_output=shared_output,
        shared_gate=shared_gate,
    )
    if 0 < topk_ids.numel() <= moe_gemv.GEMV_MAX_ROWS:
        return fused_moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, **kwargs)
    return fused_moe_grouped(x, w_gate_up, w_down, topk_weights, topk_ids, **kwargs)


def fused_moe_grouped(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    shared_output: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe_triton's grouped GEMMs over the rows sorted by expert, at any size."""
    check_last_dim_contiguous("x", x)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    fp8 = w_gate_up.dtype == FP8_DTYPE
    if fp8 and (w_gate_up_scale is None or w_down_scale is None or w_down.dtype != FP8_DTYPE):
        raise ValueError("fused_moe: fp8 weights need both weight scales")
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    num_rows = num_tokens * top_k
    block_m = _block_m(num_rows, num_experts)
    sorted_rows, block_expert = moe_align(topk_ids, num_experts, block_m)
    route_w = topk_weights.reshape(-1).float().contiguous()
    a, a_scale = per_token_quant_triton(x) if fp8 else (x, route_w)
    a_scale = a_scale.reshape(-1)
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up per row
    block_n = min(next_pow2(inter), 64 if block_m <= 32 else 128)
    block_k = 128 if fp8 else 64
    grid = (block_expert.shape[0], -(-inter // block_n))
    w1_scale, stride_s1, per_channel1 = scale_args(w_gate_up_scale if fp8 else None, route_w)
    _moe_gemm_kernel[grid](
        a,
        w_gate_up,
        h,
        sorted_rows,
        block_expert,
        a_scale,
        w1_scale,
        route_w,
        num_rows,
        inter,
        hidden,
        top_k,
        a.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        stride_s1,
        GATE_UP=True,
        FP8=fp8,
        W_PER_CHANNEL=per_channel1,
        ROUTE_WEIGHT=False,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    h_in, h_scale = per_token_quant_triton(h) if fp8 else (h, route_w)
    h_scale = h_scale.reshape(-1)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    block_n2 = min(next_pow2(hidden), 64 if block_m <= 32 else 128)
    w2_scale, stride_s2, per_channel2 = scale_args(w_down_scale if fp8 else None, route_w)
    _moe_gemm_kernel[(block_expert.shape[0], -(-hidden // block_n2))](
        h_in,
        w_down,
        rows_out,
        sorted_rows,
        block_expert,
        h_scale,
        w2_scale,
        route_w,
        num_rows,
        hidden,
        inter,
        1,
        h_in.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        rows_out.stride(0),
        stride_s2,
        GATE_UP=False,
        FP8=fp8,
        W_PER_CHANNEL=per_channel2,
        ROUTE_WEIGHT=True,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n2,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return moe_sum(rows_out, out, top_k, shared_output, shared_gate)
