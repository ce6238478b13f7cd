"""Full-attention layer for Qwen3.5 (gated output, zero-centred q/k norms, partial rotary) and
Qwen3-VL (no gate, ordinary norms, M-RoPE). Reads the step's ForwardContext; K/V live in the shared
KV pool (bound by appliance/engine/pools.py), in the model dtype or fp8 e4m3 with this layer's
k / v scales (1.0 unless the checkpoint has them; set by the loader through `set_kv_scales`).
q, k and v come from one GEMM (`qkv_proj`) unless their quantization differs (see `Attention`)."""

from __future__ import annotations

import re

import torch
from torch import nn

from appliance.models.context import get_forward_context
from appliance.models.layers.linear import ColumnLinear, RowLinear, blocks_fit, even_shard
from appliance.models.layers.norm import RMSNorm, rows
from appliance.models.layers.parallel import tp_rank, tp_size
from appliance.models.layers.quant import QuantConfig, quant_for
from appliance_kernels.attention import paged_attention
from appliance_kernels.gemv_norm import AddNorm, PendingNorm
from appliance_kernels.kv_cache import KVScales
from appliance_kernels.qk_norm_rope import qk_norm_rope_store


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


QKV_SEGMENTS = ("q_proj", "k_proj", "v_proj")  # checkpoint modules in qkv_proj, in segment order
_QKV_NAME = re.compile(r"^(?P<attn>.*\.self_attn)\.(?P<proj>[qkv]_proj)\.(?P<leaf>weight|bias)$")


def map_qkv_name(model: nn.Module, name: str) -> tuple[str, int] | None:
    """Checkpoint `<attn>.{q,k,v}_proj.{weight,bias}` -> (`<attn>.qkv_proj.<leaf>`, segment) when
    that attention layer of `model` fused them; None for other names and for layers that keep
    the three apart (or do not exist: the loader then reports the name as unexpected)."""
    match = _QKV_NAME.match(name)
    if match is None:
        return None
    try:
        attn = model.get_submodule(match["attn"])
    except AttributeError:
        return None
    if getattr(attn, "qkv_proj", None) is None:
        return None
    return f"{match['attn']}.qkv_proj.{match['leaf']}", QKV_SEGMENTS.index(match["proj"])


class Attention(nn.Module):
    """q, k and v are one column-parallel GEMM, `qkv_proj`, whose rows per rank are
    [q (gated: per head q then gate) | k | v] (vLLM's QKVParallelLinear). They stay three layers
    (`q_proj`, `k_proj`, `v_proj`; `qkv_proj` None) when they cannot share one weight: the
    quantization config treats them differently (ignore lists), or block scales would straddle
    two segments (a segment not starting on a block_n boundary)."""

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
        kv_out = num_kv_heads * head_dim
        quants = {p: quant_for(quant, f"{prefix}.{p}") for p in (*QKV_SEGMENTS, "o_proj")}
        kv_shard = kv_head_shard(num_kv_heads, head_dim)
        # this rank's [q | k | v] columns of the projection output: split in forward
        self.qkv_split = [q_out // size, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        qkv_quant = quants["q_proj"]
        same_quant = quants["k_proj"] == qkv_quant and quants["v_proj"] == qkv_quant
        if same_quant and blocks_fit(self.qkv_split, qkv_quant):
            self.qkv_proj = ColumnLinear(
                hidden,
                [q_out, kv_out, kv_out],
                bias,
                self.qkv_split,
                [even_shard, kv_shard, kv_shard],
                qkv_quant,
                segment_names=list(QKV_SEGMENTS),
            )
        else:
            self.qkv_proj = None
            local_kv, kv = self.qkv_split[1:2], [kv_out]
            self.q_proj = ColumnLinear(hidden, [q_out], bias=bias, quant=quants["q_proj"])
            self.k_proj = ColumnLinear(hidden, kv, bias, local_kv, kv_shard, quants["k_proj"])
            self.v_proj = ColumnLinear(hidden, kv, bias, local_kv, kv_shard, quants["v_proj"])
        self.o_proj = RowLinear(num_heads * head_dim, hidden, bias=False, quant=quants["o_proj"])
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

    def project_qkv(
        self, x: torch.Tensor | PendingNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, q_local], k, v [T, kv_local]; fused: column views of one
        [T, q_local + 2 kv_local] output (row stride wider than the view, last dim contiguous)."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_split, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def takes_pending(self, x: torch.Tensor) -> bool:
        """Whether every projection of x finishes a PendingNorm inside its GEMV."""
        if self.qkv_proj is not None:
            return self.qkv_proj.takes_pending(x)
        return all(p.takes_pending(x) for p in (self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self,
        x: torch.Tensor | PendingNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        add_norm: AddNorm | None = None,
    ) -> torch.Tensor | PendingNorm:
        """x may be a PendingNorm; with `add_norm` o_proj may return one (RowLinear)."""
        ctx = get_forward_context()
        num_tokens = rows(x)
        q, k, v = self.project_qkv(x)
        if self.gated:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            gate = None
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        scales = self.kv_scales
        # q_norm / k_norm, rotary on both, and k / v into the cache: one kernel reading the
        # projection's views in place (appliance_kernels/qk_norm_rope.py)
        q = qk_norm_rope_store(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k,
            v,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            self.q_norm.zero_centered,
            cos,
            sin,
            k_cache,
            v_cache,
            ctx.out_kv_slots,
            scales.k,
            scales.v,
        )
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
            gate=gate,  # out * sigmoid(gate), applied where the output is stored
        )
        return self.o_proj(out.reshape(num_tokens, -1), add_norm)
