"""Mixture-of-experts: softmax top-k routing with renormalisation, and the expert SwiGLU computation over
fused weights. Called by appliance/models/layers/moe.py."""

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
