"""SwiGLU MLP with gate/up column-parallel and down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ColumnLinear, RowLinear
from appliance.models.layers.parallel import all_reduce, tp_size
from appliance.models.layers.quant import QuantConfig, quant_for
from appliance_kernels.activation import silu_and_mul
from appliance_kernels.gemv_mlp import gemv_mlp, mlp_fits
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
        out = self._one_launch(x, add_norm)
        if out is not None:
            return out
        # one kernel where it runs (appliance_kernels/gemv_swiglu.py)
        act = self.gate_up_proj.swiglu(x)
        if act is None:
            act = silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(act, add_norm)

    def takes_pending(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_pending(x)

    def _one_launch(
        self, x: torch.Tensor | PendingNorm, add_norm: AddNorm | None
    ) -> torch.Tensor | PendingNorm | None:
        """The whole MLP of one row in one launch where appliance_kernels/gemv_mlp.py runs (when
        enabled): x may be a PendingNorm, finished inside; with `add_norm` at one tensor-parallel
        rank the result is the PendingNorm of the output plus the residual. None: the layers."""
        gate_up, down = self.gate_up_proj, self.down_proj
        row = x.x_pre if isinstance(x, PendingNorm) else x
        block = gate_up.method.block
        weights = (gate_up.weight, gate_up.weight_scale, down.weight, down.weight_scale, block)
        if (
            gate_up.bias is not None
            or down.bias is not None
            or len(gate_up.local) != 2
            or gate_up.local[0] != gate_up.local[1]
            or down.method.block != block
            or not mlp_fits(row, *weights)
        ):
            return None
        fused_add = add_norm if add_norm is not None and tp_size() == 1 and down.reduce else None
        norm_in = x if isinstance(x, PendingNorm) else None
        out = gemv_mlp(row, *weights, norm_in=norm_in, add_norm=fused_add)
        if fused_add is None and down.reduce:
            return all_reduce(out)
        return out
