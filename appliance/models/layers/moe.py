"""Sparse MoE block (Qwen3.5-MoE / Qwen3-VL-MoE): softmax top-k router with renormalisation, SwiGLU
experts sharded along the intermediate dim under TP, optional shared expert with a sigmoid gate.

Expert weights load from the fused Hub layout ([E, 2I, H] / [E, H, I]), its transposed Qwen3-VL-MoE
form, or per-expert tensors; `shard_id` says which (see `load_experts`). With fp8 experts each
weight has a `_scale` beside it (per output channel [E, rows] or per tile [E, rows/bn, cols/bk]),
cut like the weight (gate/up rows, down block columns; per-channel down scales stay whole)."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.linear import ReplicatedLinear, copy_into, even_shard
from appliance.models.layers.mlp import MLP
from appliance.models.layers.parallel import all_reduce, tp_size
from appliance.models.layers.quant import QuantConfig, UnsupportedQuantization, quant_for
from appliance.models.layers.quant_methods import channel_scale, linear_method
from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.fp8_moe import fused_moe_fp8_block
from appliance_kernels.moe import fused_moe, moe_route


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool = True,
        quant: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, norm_topk_prob
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        local = intermediate // tp_size()
        self.gate = ReplicatedLinear(hidden, num_experts, quant=quant_for(quant, f"{prefix}.gate"))
        experts = [f"{prefix}.experts.0.{p}_proj" for p in ("gate", "up", "down")]
        self.method = linear_method(quant_for(quant, *experts))
        self._check_block(local)
        lead = (num_experts,)
        self.w_gate_up = self.method.make_weight(2 * local, hidden, lead)
        self.w_down = self.method.make_weight(hidden, local, lead)
        self.w_gate_up_scale = self.method.make_scale(2 * local, hidden, lead)
        self.w_down_scale = self.method.make_scale(hidden, local, lead)
        for param in (self.w_gate_up, self.w_down, self.w_gate_up_scale, self.w_down_scale):
            if param is not None:
                param.weight_loader = self.load_experts
        self.shared_expert = None
        if shared_intermediate:
            shared = f"{prefix}.shared_expert"
            self.shared_expert = MLP(hidden, shared_intermediate, False, quant, shared)
            gate_quant = quant_for(quant, f"{prefix}.shared_expert_gate")
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, quant=gate_quant)

    def _check_block(self, local: int) -> None:
        block = self.method.block
        if block and (local % block[0] or (tp_size() > 1 and local % block[1])):
            raise UnsupportedQuantization(
                f"fp8 block {list(block)}: expert intermediate size {self.intermediate} over "
                f"tensor-parallel size {tp_size()} leaves {local} rows per rank, not a multiple "
                "of the block"
            )

    def _kind(self, param: torch.Tensor) -> str:
        if param is self.w_gate_up_scale or param is self.w_down_scale:
            return "channel" if self.method.block is None else "block"
        return "weight"

    def load_experts(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: None (fused, Hub orientation), "transposed" (fused [E,H,2I] / [E,I,H]), or
        (proj, expert) with proj in gate/up/down for per-expert tensors."""
        kind = self._kind(param)
        gate_up = param is self.w_gate_up or param is self.w_gate_up_scale
        if shard_id == "transposed":
            if kind != "weight" or loaded.dtype == FP8_DTYPE:
                raise UnsupportedQuantization(
                    "fp8 experts in the transposed fused layout ([E, H, 2I]) are not supported: "
                    "expected per-expert keys or fused [E, 2I, H] / [E, H, I]"
                )
            loaded, shard_id = loaded.transpose(1, 2), None
        target = param
        if kind == "channel":  # treated as weights with one column: rows are cut alike
            rows = param.shape[-1] * (tp_size() if gate_up else 1)
            if shard_id is None:
                loaded = loaded.reshape(loaded.shape[0], -1)
                if gate_up and loaded.shape[1] == 2:  # one scale for gate, one for up
                    loaded = loaded.repeat_interleave(rows // 2, dim=1)
                if loaded.shape[1] not in (1, rows):
                    raise ValueError(
                        f"fused expert scale of {loaded.shape[1]} values per expert: expected "
                        f"1 (per tensor){', 2 (gate, up)' if gate_up else ''} or {rows} "
                        "(per channel)"
                    )
                loaded = loaded.expand(-1, rows)[..., None]
            else:
                loaded = channel_scale(loaded, rows // (2 if gate_up else 1))[:, None]
            target = param.unsqueeze(-1)
        cut_columns = kind != "channel"  # down: weights and block scales split their input dim
        if shard_id is None:
            if gate_up:
                gate, up = loaded.chunk(2, dim=1)
                loaded = torch.cat([even_shard(gate, 1), even_shard(up, 1)], dim=1)
            elif cut_columns:
                loaded = even_shard(loaded, 2)
            copy_into(target, loaded)
            return
        proj, expert = shard_id
        if proj == "down":
            copy_into(target[expert], even_shard(loaded, 1) if cut_columns else loaded)
        else:
            half = target.shape[1] // 2
            offset = 0 if proj == "gate" else half
            copy_into(target[expert, offset : offset + half], even_shard(loaded, 0))

    def finish_loading(self) -> None:
        self.w_gate_up, self.w_gate_up_scale = self.method.finish(
            self.w_gate_up, self.w_gate_up_scale
        )
        self.w_down, self.w_down_scale = self.method.finish(self.w_down, self.w_down_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (the block-fp8 path takes fp32 weights, the others the activations' dtype, as before)
        fp32 = self.method.block is not None
        weights, ids = moe_route(
            self.gate(x), self.top_k, self.renormalize, torch.float32 if fp32 else x.dtype
        )
        shared = gate = None
        if self.shared_expert is not None:  # summed (times its sigmoid gate) inside the kernel
            shared, gate = self.shared_expert(x), self.shared_expert_gate(x)
        if self.method.block is not None:
            out = fused_moe_fp8_block(
                x,
                self.w_gate_up,
                self.w_gate_up_scale,
                self.w_down,
                self.w_down_scale,
                self.method.block,
                weights,
                ids,
                shared_output=shared,
                shared_gate=gate,
            )
            return all_reduce(out)
        out = fused_moe(
            x,
            self.w_gate_up,
            self.w_down,
            weights,
            ids,
            w_gate_up_scale=self.w_gate_up_scale,
            w_down_scale=self.w_down_scale,
            shared_output=shared,
            shared_gate=gate,
        )
        return all_reduce(out)
