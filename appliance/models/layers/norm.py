"""RMSNorm layers: zero-centred (Qwen3.5), ordinary (Qwen3-VL) with fused residual add, and the
gated norm of the GDN output. Thin wrappers over appliance_kernels/norm.py."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import copy_into
from appliance_kernels.gemv_norm import AddNorm, PendingNorm
from appliance_kernels.norm import gated_rms_norm, rms_norm


def _replicated(shape: int, fill: float) -> nn.Parameter:
    p = nn.Parameter(torch.full((shape,), fill), requires_grad=False)
    p.weight_loader = lambda param, w, shard_id=None: copy_into(param, w)
    return p


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, zero_centered: bool) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = _replicated(hidden, 0.0 if zero_centered else 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: returns normed x. With residual: returns (normed(x + r), x + r).
        x may carry head dims ([T, H, D] for q/k norms); the kernels see [rows, hidden]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        flat_res = None if residual is None else residual.reshape(-1, shape[-1])
        out, new_residual = rms_norm(flat, self.weight, self.eps, self.zero_centered, flat_res)
        if residual is None:
            return out.view(shape)
        return out.view(shape), new_residual.view(shape)

    def add(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """forward(x, residual), unless the GEMV that made x did it (a PendingNorm made with
        `split`): then x as it is and its residual."""
        if isinstance(x, PendingNorm):
            return x, x.residual
        return self(x, residual)

    def split(self, residual: torch.Tensor) -> AddNorm:
        """This norm of (output + residual), for a one-row GEMV to start (gemv_norm.py)."""
        return AddNorm(residual, self.weight, self.eps, self.zero_centered)


def rows(x: torch.Tensor | PendingNorm) -> int:
    """The token count of a layer input that may be a PendingNorm."""
    return (x.x_pre if isinstance(x, PendingNorm) else x).shape[0]


class GatedRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _replicated(hidden, 1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
