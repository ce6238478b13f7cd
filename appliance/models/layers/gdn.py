"""Gated DeltaNet (linear attention) layer of Qwen3.5: projections, causal conv over [q|k|v], gates,
the gated delta rule with per-request fp32 state, gated RMSNorm, output projection. TP splits key and
value heads; conv and SSM state pools are bound by the runner."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.engine.context import get_forward_context
from appliance.models.layers.linear import ColumnLinear, RowLinear, copy_into, even_shard
from appliance.models.layers.norm import GatedRMSNorm
from appliance.models.layers.parallel import tp_size
from kernels.conv1d import causal_conv1d_ref
from kernels.gdn import gdn_ref


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel: int, eps: float) -> None:
        super().__init__()
        size = tp_size()
        if num_k_heads % size or num_v_heads % size:
            raise ValueError(f"linear heads {num_k_heads}/{num_v_heads} cannot be split over tp={size}")
        self.num_k_heads, self.num_v_heads = num_k_heads // size, num_v_heads // size
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.segments = [key_dim, key_dim, value_dim]
        self.local_segments = [s // size for s in self.segments]
        self.conv_dim = sum(self.local_segments)
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = ColumnLinear(hidden, self.segments)
        self.in_proj_z = ColumnLinear(hidden, [value_dim])
        self.in_proj_b = ColumnLinear(hidden, [num_v_heads])
        self.in_proj_a = ColumnLinear(hidden, [num_v_heads])
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel), requires_grad=False)
        self.conv1d_weight.weight_loader = self._load_conv
        self.A_log = self._head_param()
        self.dt_bias = self._head_param()
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowLinear(value_dim, hidden)
        self.conv_states: torch.Tensor | None = None  # [slots, conv_dim, K-1], bound by the runner
        self.ssm_states: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] fp32, bound by the runner

    def _head_param(self) -> nn.Parameter:
        p = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        p.weight_loader = lambda param, w, shard_id=None: copy_into(param, even_shard(w, 0))
        return p

    def _load_conv(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = loaded.reshape(loaded.shape[0], -1)  # checkpoint [C, 1, K] -> [C, K]
        parts = [even_shard(piece, 0) for piece in loaded.split(self.segments, dim=0)]
        copy_into(param, torch.cat(parts, dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        state_slots = ctx.req_slots
        mixed = causal_conv1d_ref(self.in_proj_qkv(x), self.conv1d_weight, self.conv_states,
                                  state_slots, ctx.cu_seqlens_q, ctx.has_initial_state)
        q, k, v = mixed.split(self.local_segments, dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = gdn_ref(q, k, v, g, beta, self.ssm_states, state_slots, ctx.cu_seqlens_q,
                      ctx.has_initial_state)  # [T, Hv, Dv]
        z = self.in_proj_z(x).reshape(num_tokens * self.num_v_heads, self.head_v_dim)
        out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(num_tokens, -1)
        return self.out_proj(out)
