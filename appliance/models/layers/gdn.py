"""Gated DeltaNet (linear attention) layer of Qwen3.5: projections, causal conv over [q|k|v], gates,
the gated delta rule with per-request fp32 state, gated RMSNorm, output projection. TP splits key
and value heads; conv and SSM state pools are bound by the runner."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.context import get_forward_context
from appliance.models.layers.linear import ColumnLinear, RowLinear, copy_into, even_shard
from appliance.models.layers.norm import GatedRMSNorm, rows
from appliance.models.layers.parallel import tp_size
from appliance.models.layers.quant import QuantConfig, quant_for
from appliance_kernels.conv1d import causal_conv1d, causal_conv1d_verify
from appliance_kernels.fp8_gemv import GemvConv
from appliance_kernels.gdn import gdn_gated, gdn_verify_gated
from appliance_kernels.gdn_gate import RawGates
from appliance_kernels.gemv_norm import AddNorm, PendingNorm
from appliance_kernels.head_norm import GateNorm

# checkpoint projection -> the fused in_proj's segments it fills (shard ids of ColumnLinear)
IN_PROJ_SHARDS = {"in_proj_qkv": (0, 1, 2), "in_proj_z": 3, "in_proj_b": 4, "in_proj_a": 5}
BA_SHARDS = {4: 0, 5: 1}  # in_proj segments b, a -> in_proj_ba's, when that layer is separate
# At one row, the conv inside the in_proj GEMV's store (GemvConv). None: where the in_proj's
# quantisation method measured faster that way (quant_methods.Unquantized.GEMV_CONV); True / False:
# always / never (tests, ops/bench/bench_static.py --gemv-conv).
FUSE_CONV: bool | None = None
# At one row, the gated output norm split between the recurrence and the out_proj GEMV
# (appliance_kernels/head_norm.py): one launch fewer a layer. Off until the H200 has timed it
# (ops/bench/bench_static.py --gdn-split-norm).
SPLIT_GATED_NORM = False


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        quant: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        size = tp_size()
        if num_k_heads % size or num_v_heads % size:
            raise ValueError(
                f"linear heads {num_k_heads}/{num_v_heads} cannot be split over tp={size}"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads // size, num_v_heads // size
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.segments = [key_dim, key_dim, value_dim]
        self.local_segments = [s // size for s in self.segments]
        self.conv_dim = sum(self.local_segments)
        self.conv_kernel = conv_kernel
        # One GEMM for the four input projections (checkpoint in_proj_qkv, _z, _b, _a are its
        # segments, see IN_PROJ_SHARDS): [q | k | v | z | b | a] per rank. fp8 checkpoints keep
        # b and a (one row per head) in bf16: then they are a second GEMM, `in_proj_ba`.
        main = quant_for(quant, f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z")
        ba = quant_for(quant, f"{prefix}.in_proj_b", f"{prefix}.in_proj_a")
        heads = [num_v_heads, num_v_heads]
        self.in_proj_ba = None
        names = [*["in_proj_qkv"] * 3, "in_proj_z"]  # checkpoint modules, for a missing one
        if main is ba:
            self.in_proj = ColumnLinear(
                hidden,
                [*self.segments, value_dim, *heads],
                quant=main,
                segment_names=[*names, "in_proj_b", "in_proj_a"],
            )
        else:
            self.in_proj = ColumnLinear(
                hidden, [*self.segments, value_dim], quant=main, segment_names=names
            )
            self.in_proj_ba = ColumnLinear(
                hidden, heads, quant=ba, segment_names=["in_proj_b", "in_proj_a"]
            )
        self.in_proj_split = [self.conv_dim, value_dim // size, self.num_v_heads, self.num_v_heads]
        self.conv1d_weight = nn.Parameter(
            torch.empty(self.conv_dim, conv_kernel), requires_grad=False
        )
        self.conv1d_weight.weight_loader = self._load_conv
        self.A_log = self._head_param()
        self.dt_bias = self._head_param()
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = RowLinear(value_dim, hidden, quant=quant_for(quant, f"{prefix}.out_proj"))
        self.conv_states: torch.Tensor | None = None  # [slots, conv_dim, K-1], bound by the runner
        self.ssm_states: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] fp32, bound by the runner
        # MTP only: one SSM state per verify row, and the wide conv working slot (pools.py)
        self.ssm_candidates: torch.Tensor | None = None  # [slots, k+1, Hv, Dk, Dv]
        self.conv_windows: torch.Tensor | None = None  # [slots, conv_dim, K-1 + k+1]

    def _head_param(self) -> nn.Parameter:
        p = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        p.weight_loader = lambda param, w, shard_id=None: copy_into(param, even_shard(w, 0))
        return p

    def _load_conv(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = loaded.reshape(loaded.shape[0], -1)  # checkpoint [C, 1, K] -> [C, K]
        parts = [even_shard(piece, 0) for piece in loaded.split(self.segments, dim=0)]
        copy_into(param, torch.cat(parts, dim=0))

    def takes_pending(self, x: torch.Tensor) -> bool:
        """Whether every projection of x finishes a PendingNorm inside its GEMV."""
        ba = self.in_proj_ba
        if not self.in_proj.takes_pending(x):
            return False
        return ba is None or ba.takes_pending(x) or self.in_proj.takes_pending_with(x, ba)

    def forward(
        self, x: torch.Tensor | PendingNorm, add_norm: AddNorm | None = None
    ) -> torch.Tensor | PendingNorm:
        """x may be a PendingNorm; with `add_norm` out_proj may return one (RowLinear)."""
        ctx = get_forward_context()
        num_tokens = rows(x)
        # At one row where the GEMV runs, one launch: in_proj, b and a (their own bf16 layer in
        # fp8 checkpoints) and the conv as the GEMV stores q, k, v (with_tail, GemvConv); else
        # views of the outputs (no concatenation kernel) and the conv kernel
        conv = self._gemv_conv(num_tokens, ctx)
        both = None
        if self.in_proj_ba is not None or conv is not None:
            both = self.in_proj.with_tail(x, self.in_proj_ba, conv)
        if self.in_proj_ba is None or both is not None:
            projected = self.in_proj(x) if both is None else both
            qkv, z, b, a = projected.split(self.in_proj_split, dim=-1)
        else:
            qkv, z = self.in_proj(x).split(self.in_proj_split[:2], dim=-1)
            b, a = self.in_proj_ba(x).split(self.in_proj_split[2:], dim=-1)
        mixed = qkv if both is not None and conv is not None else self._conv(qkv, ctx)
        q, k, v = mixed.split(self.local_segments, dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        # g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): inside the decode kernel
        gates = RawGates(a, b, self.A_log, self.dt_bias)
        gate_norm = None
        if self._split_norm(num_tokens, ctx, z):
            gate_norm = GateNorm(z.reshape(v.shape), self.norm.weight, self.norm.eps)
        out = self._delta_rule(q, k, v, gates, ctx, gate_norm)  # [T, Hv, Dv]
        if gate_norm is None:  # (else a PendingHeadNorm: the norm finishes in out_proj's GEMV)
            z = z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)  # a view: read in place
            out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(num_tokens, -1)
        return self.out_proj(out, add_norm)

    def _split_norm(self, num_tokens: int, ctx, z: torch.Tensor) -> bool:
        """Whether the gated norm splits between the recurrence and out_proj's one-row GEMV
        (SPLIT_GATED_NORM): one plain row whose out_proj takes a head norm; z [1, Hv * Dv]
        stands in for the row out_proj will read (same dtype, device, one row)."""
        if not SPLIT_GATED_NORM or num_tokens != 1 or ctx.num_plain_tokens != 1:
            return False
        return self.out_proj.takes_head_norm(z, self.head_v_dim)

    def _gemv_conv(self, num_tokens: int, ctx) -> GemvConv | None:
        """The conv for the in_proj GEMV to run as it stores, at one plain row (batch-1 decode)."""
        wins = self.in_proj.method.GEMV_CONV if FUSE_CONV is None else FUSE_CONV
        if not wins or num_tokens != 1 or ctx.num_plain_tokens != 1:
            return None
        slots, init = ctx.req_slots[:1], ctx.has_initial_state[:1]
        return GemvConv(self.conv1d_weight, self.conv_states, slots, init)

    # Plain rows (prefill chunks, decodes) come first in the batch and update the committed state;
    # MTP verify rows come last and only fill the per-row candidates (see engine/batch.py).
    def _conv(self, mixed: torch.Tensor, ctx) -> torch.Tensor:
        split, reqs = ctx.num_plain_tokens, ctx.num_plain_reqs
        if split == mixed.shape[0]:
            return causal_conv1d(
                mixed,
                self.conv1d_weight,
                self.conv_states,
                ctx.req_slots,
                ctx.cu_seqlens_q,
                ctx.has_initial_state,
                max_q_len=ctx.max_q_len,
            )
        verify = causal_conv1d_verify(
            mixed[split:],
            self.conv1d_weight,
            self.conv_states,
            self.conv_windows,
            ctx.req_slots[reqs:],
            ctx.verify_cu_seqlens,
            # the bound is the window's row capacity (k + 1), not the batch's longest chunk: a
            # prefill chunk in the same batch may be far longer than any verify request
            max_q_len=self.conv_windows.shape[2] - (self.conv_kernel - 1),
        )
        if split == 0:  # verify rows only (the fused MTP step): no plain part, no concatenation
            return verify
        plain = causal_conv1d(
            mixed[:split],
            self.conv1d_weight,
            self.conv_states,
            ctx.req_slots[:reqs],
            ctx.cu_seqlens_q[: reqs + 1],
            ctx.has_initial_state[:reqs],
            max_q_len=ctx.max_q_len,
        )
        return torch.cat([plain, verify])

    def _delta_rule(self, q, k, v, gates: RawGates, ctx, gate_norm: GateNorm | None = None):
        """[T, Hv, Dv], or with `gate_norm` (plain rows only) a PendingHeadNorm."""
        split, reqs = ctx.num_plain_tokens, ctx.num_plain_reqs
        if split == q.shape[0]:
            return gdn_gated(
                q,
                k,
                v,
                gates,
                self.ssm_states,
                ctx.req_slots,
                ctx.cu_seqlens_q,
                ctx.has_initial_state,
                max_q_len=ctx.max_q_len,
                gate_norm=gate_norm,
            )
        if gate_norm is not None:
            raise ValueError("GDN: the split gated norm takes plain rows only")
        verify = gdn_verify_gated(
            q[split:],
            k[split:],
            v[split:],
            gates.rows(split),
            self.ssm_states,
            self.ssm_candidates,
            ctx.req_slots[reqs:],
            ctx.verify_cu_seqlens,
        )
        if split == 0:
            return verify
        plain = gdn_gated(
            q[:split],
            k[:split],
            v[:split],
            gates.rows(0, split),
            self.ssm_states,
            ctx.req_slots[:reqs],
            ctx.cu_seqlens_q[: reqs + 1],
            ctx.has_initial_state[:reqs],
            max_q_len=ctx.max_q_len,
        )
        return torch.cat([plain, verify])

    def commit_verify(self, slots: torch.Tensor, accepted_rows: torch.Tensor) -> None:
        """After acceptance: the state after row accepted_rows[i] becomes slot slots[i]'s committed
        state (SSM from its candidate, conv from the working window)."""
        self.ssm_states[slots] = self.ssm_candidates[slots, accepted_rows]
        width = self.conv_kernel - 1
        cols = accepted_rows[:, None] + 1 + torch.arange(width, device=slots.device)[None, :]
        windows = self.conv_windows[slots]  # [n, C, K-1+rows]
        index = cols[:, None, :].expand(-1, windows.shape[1], -1)
        self.conv_states[slots] = windows.gather(2, index)
