"""SwiGLU MLP with gate/up column-parallel and down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ColumnLinear, RowLinear
from appliance.models.layers.norm import rows
from appliance.models.layers.quant import QuantConfig, quant_for
from appliance_kernels import l2_prefetch as l2
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
        side = None
        if act is None:
            gate_up = self.gate_up_proj(x)
            # the first of down's weight into L2 while the SiLU-and-mul runs (l2_prefetch)
            side = l2.side_prefetch(self.down_proj.weight, l2.SIDE_PREFETCH_DOWN_MIB, rows(x))
            act = silu_and_mul(gate_up)
        out = self.down_proj(act, add_norm)
        l2.join(side)
        return out

    def takes_pending(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_pending(x)
