"""SwiGLU MLP with gate/up column-parallel and down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ColumnLinear, RowLinear
from appliance.models.layers.quant import QuantConfig, quant_for
from appliance_kernels.activation import silu_and_mul
from appliance_kernels.gemv_norm import AddNorm, PendingNorm


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        reduce: bool = True,
        quant: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        gate_up = quant_for(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        # shard 0 gate, 1 up
        self.gate_up_proj = ColumnLinear(
            hidden,
            [intermediate, intermediate],
            quant=gate_up,
            segment_names=["gate_proj", "up_proj"],
        )
        down = quant_for(quant, f"{prefix}.down_proj")
        self.down_proj = RowLinear(intermediate, hidden, reduce=reduce, quant=down)

    def forward(
        self, x: torch.Tensor | PendingNorm, add_norm: AddNorm | None = None
    ) -> torch.Tensor | PendingNorm:
        """x may be a PendingNorm; with `add_norm` the down projection may return one
        (RowLinear.forward)."""
        # one kernel where it runs (appliance_kernels/gemv_swiglu.py)
        act = self.gate_up_proj.swiglu(x)
        if act is None:
            act = silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(act, add_norm)

    def takes_pending(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_pending(x)
