"""Depthwise causal conv1d with per-request state (the GDN short conv): varlen prefill and decode in one
reference op. Called by appliance/models/layers/gdn.py.

conv_states[state_slot] holds the last K-1 inputs of the request (its left context); the op reads it
when has_initial_state, and overwrites it with the last K-1 inputs after this step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    activation: str | None = "silu",
) -> torch.Tensor:
    """Returns [T, C] in x's dtype and updates conv_states in place."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    cu = cu_seqlens.tolist()
    for b, (slot, has_init) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        xs = x[start:end].t()  # [C, L]
        if has_init:
            left = conv_states[slot].to(x.dtype)
        else:
            left = torch.zeros(x.shape[1], width - 1, dtype=x.dtype, device=x.device)
        full = torch.cat([left, xs], dim=1)  # [C, K-1+L]
        y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=x.shape[1])[0]
        if activation == "silu":
            y = F.silu(y)
        out[start:end] = y.t().to(x.dtype)
        conv_states[slot] = full[:, -(width - 1):].to(conv_states.dtype)
    return out
