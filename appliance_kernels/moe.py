"""Mixture-of-experts: softmax top-k routing with renormalisation, and the expert SwiGLU computation
over fused weights. Called by appliance/models/layers/moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_ref(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] (gate rows first)
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x); returns [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.where(topk_ids == expert)
        h = F.linear(x[token_idx], w_gate_up[expert])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        out.index_add_(0, token_idx, y * weights[token_idx, k_idx, None])
    return out


def dequantize_expert_weight(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K] e4m3 with [E, N] (per channel) or [E] (per tensor) scales -> fp32."""
    scale = scale.float()
    return w_q.float() * (scale[..., None] if scale.dim() == 2 else scale[:, None, None])


def fused_moe_fp8_ref(
    x, w_gate_up_q, w_gate_up_scale, w_down_q, w_down_scale, topk_weights, topk_ids
) -> torch.Tensor:
    """fp8-weight MoE reference: dequantised weights, fp32 activations; returns x's dtype."""
    out = fused_moe_ref(
        x.float(),
        dequantize_expert_weight(w_gate_up_q, w_gate_up_scale),
        dequantize_expert_weight(w_down_q, w_down_scale),
        topk_weights,
        topk_ids,
    )
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] (e4m3 with w_gate_up_scale)
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    *,
    w_gate_up_scale: torch.Tensor | None = None,  # [E, 2I] or [E] for fp8 weights
    w_down_scale: torch.Tensor | None = None,  # [E, H] or [E]
    shared_output: torch.Tensor | None = None,  # [T, H] shared expert output
    shared_gate: torch.Tensor | None = None,  # [T, 1] shared expert gate logits
) -> torch.Tensor:
    """Dispatcher used by the MoE layer: Triton on CUDA, the references elsewhere. With
    shared_output, adds sigmoid(shared_gate) * shared_output (the Qwen3.5 shared expert)."""
    from appliance_kernels.triton_utils import use_triton

    if use_triton(x):
        from appliance_kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(
            x,
            w_gate_up,
            w_down,
            topk_weights,
            topk_ids,
            w_gate_up_scale=w_gate_up_scale,
            w_down_scale=w_down_scale,
            shared_output=shared_output,
            shared_gate=shared_gate,
        )
    if w_gate_up_scale is not None:
        out = fused_moe_fp8_ref(
            x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_weights, topk_ids
        )
    else:
        out = fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    if shared_output is not None:
        out = out + torch.sigmoid(shared_gate.float()).to(out.dtype) * shared_output
    return out


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for routing (weights cast to `out_dtype`): one Triton kernel on CUDA
    (appliance_kernels/moe_route.py), the reference's torch ops elsewhere and past the kernel's
    limits."""
    from appliance_kernels.moe_route import MAX_EXPERTS, MAX_TOP_K
    from appliance_kernels.triton_utils import use_triton

    experts = router_logits.shape[-1]
    fits = experts <= MAX_EXPERTS and 0 < top_k <= min(experts, MAX_TOP_K)
    if use_triton(router_logits) and fits:
        from appliance_kernels.moe_route import moe_route_triton

        return moe_route_triton(router_logits, top_k, renormalize, out_dtype)
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    return weights.to(out_dtype), ids
