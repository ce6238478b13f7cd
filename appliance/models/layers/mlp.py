"""SwiGLU MLP with gate/up column-parallel and down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ColumnLinear, RowLinear
from kernels.activation import silu_and_mul


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, [intermediate, intermediate])  # shard 0 gate, 1 up
        self.down_proj = RowLinear(intermediate, hidden, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
