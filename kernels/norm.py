"""RMSNorm variants used by Qwen3.5 / Qwen3-VL: zero-centred `(1 + w)`, ordinary `w`, and the gated norm
of the GDN output. Called by appliance/models/layers/norm.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,  # [T, H]; added to x before the norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual); new_residual = x + residual (or x)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if zero_centered:
        out = (h * (1.0 + w)).to(x.dtype)
    else:
        # ordinary Qwen RMSNorm: cast back before the weight multiply (HF Qwen3 / Qwen3-VL)
        out = w.to(x.dtype) * h.to(x.dtype)
    return out, x


def gated_rms_norm_ref(
    x: torch.Tensor,  # [N, D]
    gate: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(gate)`: the Gated DeltaNet output norm (norm before gate)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)
