"""Full-attention layer for Qwen3.5 (gated output, zero-centred q/k norms, partial rotary) and
Qwen3-VL (no gate, ordinary norms, M-RoPE). Reads the step's ForwardContext; K/V live in the shared
KV pool (bound by appliance/engine/pools.py), in the model dtype or fp8 e4m3 with this layer's
k / v scales (1.0 unless the checkpoint has them; set by the loader through `set_kv_scales`)."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.context import get_forward_context
from appliance.models.layers.linear import ColumnLinear, RowLinear
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import tp_rank, tp_size
from appliance.models.layers.quant import QuantConfig, quant_for
from kernels.attention import KVScales, paged_attention, store_kv
from kernels.rotary import apply_rotary


def kv_head_shard(num_kv_heads: int, head_dim: int):
    """Shard fn for k/v projections: split heads evenly, or replicate when tp > kv heads."""
    size = tp_size()

    def shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if size <= num_kv_heads:
            per = num_kv_heads // size
            return tensor.narrow(dim, tp_rank() * per * head_dim, per * head_dim)
        head = tp_rank() * num_kv_heads // size
        return tensor.narrow(dim, head * head_dim, head_dim)

    return shard


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        gated: bool,
        zero_centered_norm: bool,
        bias: bool = False,
        quant: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        size = tp_size()
        if num_heads % size or (num_kv_heads % size and size % num_kv_heads):
            raise ValueError(f"heads {num_heads}/{num_kv_heads} cannot be split over tp={size}")
        self.num_heads = num_heads // size
        self.num_kv_heads = max(1, num_kv_heads // size)
        self.head_dim = head_dim
        self.gated = gated
        self.scale = head_dim**-0.5
        q_out = num_heads * head_dim * (2 if gated else 1)
        q = {p: quant_for(quant, f"{prefix}.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        self.q_proj = ColumnLinear(hidden, [q_out], bias=bias, quant=q["q_proj"])
        kv_shard = kv_head_shard(num_kv_heads, head_dim)
        local_kv = [self.num_kv_heads * head_dim]
        kv = [num_kv_heads * head_dim]
        self.k_proj = ColumnLinear(hidden, kv, bias, local_kv, kv_shard, q["k_proj"])
        self.v_proj = ColumnLinear(hidden, kv, bias, local_kv, kv_shard, q["v_proj"])
        self.o_proj = RowLinear(num_heads * head_dim, hidden, bias=False, quant=q["o_proj"])
        self.q_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the runner
        # fp8 KV dequantisation scales: device tensors updated in place (CUDA graphs read their
        # addresses), host copies for flashinfer; used only when the pool is fp8
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.kv_scales_host = (1.0, 1.0)
        self.kv_scales_source = "1.0 (default)"

    def set_kv_scales(self, k_scale: float, v_scale: float, source: str) -> None:
        with torch.no_grad():
            self.k_scale.fill_(k_scale)
            self.v_scale.fill_(v_scale)
        self.kv_scales_host = (float(k_scale), float(v_scale))
        self.kv_scales_source = source

    @property
    def kv_scales(self) -> KVScales:
        return KVScales(self.k_scale, self.v_scale, *self.kv_scales_host)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        q = self.q_proj(x)
        if self.gated:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_cache, v_cache = self.kv_cache
        scales = self.kv_scales
        store_kv(k, v, k_cache, v_cache, ctx.out_kv_slots, scales)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            ctx.req_to_token,
            ctx.req_slots,
            ctx.cu_seqlens_q,
            ctx.seq_lens,
            self.scale,
            max_q_len=ctx.max_q_len,
            kv_scales=scales,
        )
        if self.gated:  # gate [T, H, D] is a strided view: sigmoid reads it in place, no copy
            out = out.reshape(num_tokens, self.num_heads, self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, -1))
