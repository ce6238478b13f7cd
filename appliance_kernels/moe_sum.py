"""The last step of both fused-MoE paths (appliance_kernels/moe_triton.py,
appliance_kernels/moe_gemv.py): each token's top-k expert rows, already scaled by their routing
weights, summed, plus the sigmoid-gated shared expert of Qwen3.5."""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import jit, next_pow2, tl


@jit
def _moe_sum_kernel(
    rows_ptr,
    out_ptr,
    shared_ptr,
    gate_ptr,
    hidden,
    top_k,
    stride_r,
    stride_o,
    stride_s,
    stride_g,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        row = tl.load(rows_ptr + (t * top_k + j) * stride_r + cols, mask=ok, other=0.0)
        acc += row.to(tl.float32)
    if HAS_SHARED:
        gate = tl.load(gate_ptr + t * stride_g).to(tl.float32)
        shared = tl.load(shared_ptr + t * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
        acc += shared / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_sum(
    rows_out: torch.Tensor,  # [T * k, H] fp32, already scaled by the routing weights
    out: torch.Tensor,  # [T, H]
    top_k: int,
    shared_output: torch.Tensor | None,
    shared_gate: torch.Tensor | None,
) -> torch.Tensor:
    """out = the sum of each token's k rows (+ sigmoid(shared_gate) * shared_output)."""
    num_tokens, hidden = out.shape
    has_shared = shared_output is not None
    if has_shared and shared_gate is None:
        raise ValueError("fused_moe: shared_output needs shared_gate")
    block = min(next_pow2(hidden), 1024)
    _moe_sum_kernel[(num_tokens, -(-hidden // block))](
        rows_out,
        out,
        shared_output if has_shared else out,
        shared_gate if has_shared else out,
        hidden,
        top_k,
        rows_out.stride(0),
        out.stride(0),
        shared_output.stride(0) if has_shared else 0,
        shared_gate.stride(0) if has_shared else 0,
        HAS_SHARED=has_shared,
        BLOCK=block,
    )
    return out
