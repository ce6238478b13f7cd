"""SiLU-and-mul for SwiGLU MLPs. Called by appliance/models/layers/mlp.py and kernels/moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] laid out [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
