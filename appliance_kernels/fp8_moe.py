"""Experts with block-scaled fp8 weights (Qwen "-FP8" MoE checkpoints): the torch reference, which
runs each routed expert through the block GEMM reference (activations quantised per token and
group of block_k, as on the GPU), and the dispatcher `fused_moe_fp8_block` called by
appliance/models/layers/moe.py. Per-channel fp8 experts go through appliance_kernels/moe.py instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance_kernels.fp8_block import Block, fp8_block_linear


def fused_moe_fp8_block_ref(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] e4m3 (gate rows first)
    w_gate_up_scale: torch.Tensor,  # [E, 2I/bn, ceil(H/bk)]
    w_down: torch.Tensor,  # [E, H, I] e4m3
    w_down_scale: torch.Tensor,  # [E, ceil(H/bn), I/bk]
    block: Block,
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) over the routed experts; [T, H] in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        h = fp8_block_linear(x[token_idx], w_gate_up[expert], w_gate_up_scale[expert], block)
        gate, up = h.float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype)
        y = fp8_block_linear(act, w_down[expert], w_down_scale[expert], block).float()
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx, None].float())
    return out.to(x.dtype)


def fused_moe_fp8_block(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,
    w_gate_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    w_down_scale: torch.Tensor,
    block: Block,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_output: torch.Tensor | None = None,  # [T, H] shared expert output
    shared_gate: torch.Tensor | None = None,  # [T, 1] shared expert gate logits
) -> torch.Tensor:
    """Block-fp8 experts on every device through the per-expert path (on CUDA each expert's GEMMs
    are the Triton block kernel); adds sigmoid(shared_gate) * shared_output when given."""
    out = fused_moe_fp8_block_ref(
        x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, block, topk_weights, topk_ids
    )
    if shared_output is not None:
        out = out + torch.sigmoid(shared_gate.float()).to(out.dtype) * shared_output
    return out
