"""Sparse MoE block (Qwen3.5-MoE / Qwen3-VL-MoE): softmax top-k router with renormalisation, SwiGLU
experts sharded along the intermediate dim under TP, optional shared expert with a sigmoid gate.

Expert weights load from the fused Hub layout ([E, 2I, H] / [E, H, I]), its transposed Qwen3-VL-MoE
form, or per-expert tensors; `shard_id` says which (see `load_experts`)."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ReplicatedLinear, copy_into, even_shard
from appliance.models.layers.mlp import MLP
from appliance.models.layers.parallel import all_reduce, tp_size
from kernels.moe import fused_moe, moe_route


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, norm_topk_prob
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        local = intermediate // tp_size()
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.w_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden), requires_grad=False
        )
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, local), requires_grad=False)
        self.w_gate_up.weight_loader = self.load_experts
        self.w_down.weight_loader = self.load_experts
        self.shared_expert = None
        if shared_intermediate:
            self.shared_expert = MLP(hidden, shared_intermediate, reduce=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def load_experts(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: None (fused, Hub orientation), "transposed" (fused [E,H,2I] / [E,I,H]), or
        (proj, expert) with proj in gate/up/down for per-expert tensors."""
        if shard_id == "transposed":
            loaded, shard_id = loaded.transpose(1, 2), None
        if shard_id is None:
            if param is self.w_gate_up:
                gate, up = loaded.chunk(2, dim=1)
                loaded = torch.cat([even_shard(gate, 1), even_shard(up, 1)], dim=1)
            else:
                loaded = even_shard(loaded, 2)
            copy_into(param, loaded)
            return
        proj, expert = shard_id
        local = self.w_down.shape[2]
        if proj == "down":
            copy_into(param[expert], even_shard(loaded, 1))
        else:
            offset = 0 if proj == "gate" else local
            copy_into(param[expert, offset : offset + local], even_shard(loaded, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(self.gate(x), self.top_k, self.renormalize)
        shared = gate = None
        if self.shared_expert is not None:  # summed (times its sigmoid gate) inside the kernel
            shared, gate = self.shared_expert(x), self.shared_expert_gate(x)
        out = fused_moe(
            x,
            self.w_gate_up,
            self.w_down,
            weights.to(x.dtype),
            ids,
            shared_output=shared,
            shared_gate=gate,
        )
        return all_reduce(out)
