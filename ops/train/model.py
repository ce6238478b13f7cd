"""The trainable Qwen3.5 VLM of the embedded default model: a differentiable, batched forward over
the real architecture (Gated DeltaNet + gated full attention in the config's layer pattern, the
Qwen ViT of `visual/qwen_vit.py`, one MTP layer), whose `state_dict` keys are the Hub checkpoint
names (`model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`).

The serving model (appliance/models/qwen3_5.py) is inference-only (paged KV cache, fused
projections, forward context); this one reuses the torch references of the same kernels
(appliance_kernels/*.py `*_ref`), which autograd differentiates, so the trained weights load
unchanged into the engine. Used by ops/train/train_default.py; tests/ops/test_train_default.py
checks that the engine's greedy answers equal this model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from appliance_kernels.gdn import _chunked_one, _prep
from appliance_kernels.gdn_gate import gdn_gating_ref
from appliance_kernels.norm import gated_rms_norm_ref, rms_norm_ref
from appliance_kernels.rotary import (
    apply_rotary_ref,
    inv_freq,
    mrope_channel_rows,
    rotary_cos_sin_ref,
)
from visual.qwen_vit import QwenVisionTransformer, VisionConfig, apply_vision_rotary


@dataclass
class ModelSize:
    """Text and vision sizes (the rest of config.json is fixed by `config_dict`)."""

    vocab_size: int = 2048
    hidden_size: int = 384
    num_layers: int = 8  # layer i is full attention when (i + 1) % 4 == 0 (the real pattern)
    intermediate_size: int = 1024
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 2
    linear_value_heads: int = 6
    linear_key_dim: int = 64
    linear_value_dim: int = 64
    conv_kernel: int = 4
    vit: dict = field(
        default_factory=lambda: {
            "depth": 4,
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_heads": 4,
            "num_position_embeddings": 64,
        }
    )

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(self.num_layers)
        ]

    @property
    def rotary_dim(self) -> int:
        return self.head_dim // 4  # partial_rotary_factor 0.25

    @property
    def mrope_section(self) -> list[int]:
        half = self.rotary_dim // 2
        base, rem = divmod(half, 3)
        return [base + (1 if i < rem else 0) for i in range(3)]

    def vision_config(self) -> VisionConfig:
        return VisionConfig(
            out_hidden_size=self.hidden_size,
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            hidden_act="gelu_pytorch_tanh",
            **self.vit,
        )


EPS = 1e-6


class ZeroCenteredNorm(nn.Module):
    """Qwen3.5 RMSNorm `(1 + w) * rmsnorm(x)` (weight initialised to zero)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out, _ = rms_norm_ref(x.reshape(-1, shape[-1]), self.weight, EPS, True)
        return out.view(shape)


class GatedDeltaNet(nn.Module):
    """Checkpoint names: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias,
    norm, out_proj."""

    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.hk, self.hv = s.linear_key_heads, s.linear_value_heads
        self.dk, self.dv = s.linear_key_dim, s.linear_value_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.segments = [key_dim, key_dim, value_dim]
        conv_dim = sum(self.segments)
        self.in_proj_qkv = nn.Linear(s.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, s.conv_kernel, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.0, 16.0).log())
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm_weight = nn.Parameter(torch.ones(self.dv))
        self.out_proj = nn.Linear(value_dim, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, H]; mask [B, L] (1 = token, 0 = padding: it leaves the state untouched)."""
        batch, length, _ = x.shape
        qkv = self.in_proj_qkv(x) * mask[..., None]  # [B, L, C]
        kernel = self.conv1d.weight.shape[-1]
        mixed = F.conv1d(
            F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), self.conv1d.weight, groups=qkv.shape[-1]
        )
        mixed = F.silu(mixed).transpose(1, 2)  # [B, L, C]
        q, k, v = mixed.split(self.segments, dim=-1)
        g, beta = gdn_gating_ref(
            self.in_proj_a(x).reshape(-1, self.hv),
            self.in_proj_b(x).reshape(-1, self.hv),
            self.A_log,
            self.dt_bias,
        )
        flat_mask = mask.reshape(-1, 1).float()
        g, beta = g * flat_mask, beta.float() * flat_mask
        # batch folded into heads: every (sequence, head) pair is an independent recurrence
        q, k, v, g, beta = _prep(
            q.reshape(-1, self.hk, self.dk),
            k.reshape(-1, self.hk, self.dk),
            v.reshape(-1, self.hv, self.dv),
            g,
            beta,
            self.hv,
        )

        def fold(t: torch.Tensor) -> torch.Tensor:  # [B*L, Hv, ...] -> [L, B*Hv, ...]
            t = t.reshape(batch, length, *t.shape[1:]).transpose(0, 1)
            return t.reshape(length, batch * self.hv, *t.shape[3:])

        state = torch.zeros(batch * self.hv, self.dk, self.dv, device=x.device)
        with torch.autocast(x.device.type, enabled=False):  # the recurrence in fp32, as served
            out, _ = _chunked_one(fold(q), fold(k), fold(v), fold(g), fold(beta), state)
        out = out.reshape(length, batch, self.hv, self.dv).transpose(0, 1)  # [B, L, Hv, Dv]
        z = self.in_proj_z(x).reshape(-1, self.dv)
        out = gated_rms_norm_ref(out.reshape(-1, self.dv).to(x.dtype), z, self.norm_weight, EPS)
        return self.out_proj(out.reshape(batch, length, -1))


class GatedAttention(nn.Module):
    """Checkpoint names: q_proj (query and gate per head), k_proj, v_proj, o_proj, q_norm,
    k_norm."""

    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, 2 * s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = ZeroCenteredNorm(s.head_dim)
        self.k_norm = ZeroCenteredNorm(s.head_dim)

    def forward(self, x, cos, sin, attn_mask):
        """x [B, L, H]; cos/sin [B, L, rot]; attn_mask [B, 1, L, L] bool (True = may attend)."""
        batch, length, _ = x.shape
        q, gate = self.q_proj(x).view(batch, length, self.heads, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        c, s = cos.flatten(0, 1), sin.flatten(0, 1)
        q = apply_rotary_ref(q.flatten(0, 1), c, s).view(batch, length, self.heads, -1)
        k = apply_rotary_ref(k.flatten(0, 1), c, s).view(batch, length, self.kv_heads, -1)
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask
        )  # [B, heads, L, D]
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(batch, length, -1)))


class MLP(nn.Module):
    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelSize, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(s)
        else:
            self.self_attn = GatedAttention(s)
        self.mlp = MLP(s)
        self.input_layernorm = ZeroCenteredNorm(s.hidden_size)
        self.post_attention_layernorm = ZeroCenteredNorm(s.hidden_size)

    def forward(self, x, mask, cos, sin, attn_mask):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, mask)
        else:
            h = self.self_attn(h, cos, sin, attn_mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, t) for t in s.layer_types)
        self.norm = ZeroCenteredNorm(s.hidden_size)


class Inner(nn.Module):
    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.language_model = LanguageModel(s)
        self.visual = QwenVisionTransformer(s.vision_config())


class MtpHead(nn.Module):
    """`mtp.*`: fc over [norm(embed(t+1)) | norm(h_t)], one gated-attention decoder layer, norm."""

    def __init__(self, s: ModelSize) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredNorm(s.hidden_size)
        self.pre_fc_norm_hidden = ZeroCenteredNorm(s.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(s, "full_attention")])
        self.norm = ZeroCenteredNorm(s.hidden_size)

    def forward(self, next_embeds, hidden, mask, cos, sin, attn_mask):
        x = self.fc(
            torch.cat(
                [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1
            )
        )
        return self.norm(self.layers[0](x, mask, cos, sin, attn_mask))


@dataclass
class Batch:
    """One padded batch. ids [B, L]; mask [B, L] float (1 token, 0 pad); positions [3, B, L];
    image rows: `image_index` [N] flat indices into B*L of the <|image_pad|> tokens in order, with
    `pixel_values` [patches, 1536] and `grids` [(1, h, w)] of those images in the same order."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    pixel_values: torch.Tensor | None = None
    grids: list[tuple[int, int, int]] | None = None
    image_index: torch.Tensor | None = None


class Qwen3_5Trainable(nn.Module):
    def __init__(self, s: ModelSize, seed: int = 0) -> None:
        super().__init__()
        self.size = s
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = Inner(s)
            self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
            self.mtp = MtpHead(s)
            self._init_weights()
        self.register_buffer("inv_freq", inv_freq(s.rotary_dim, 1e7), persistent=False)
        rows = mrope_channel_rows(s.rotary_dim // 2, s.mrope_section)
        self.register_buffer("channel_rows", rows, persistent=False)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / (2 * self.size.num_layers) ** 0.5)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, B, L] -> cos, sin [B, L, rotary_dim]."""
        _, batch, length = positions.shape
        cos, sin = rotary_cos_sin_ref(positions.reshape(3, -1), self.inv_freq, self.channel_rows)
        return cos.view(batch, length, -1), sin.view(batch, length, -1)

    @staticmethod
    def attention_mask(mask: torch.Tensor) -> torch.Tensor:
        length = mask.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
        allowed = causal[None] & (mask[:, None, :] > 0)  # [B, L, L]
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=mask.device)[None]
        return allowed[:, None]

    def embed(self, batch: Batch) -> torch.Tensor:
        lm = self.model.language_model
        x = lm.embed_tokens(batch.ids)  # [B, L, H]
        if batch.pixel_values is not None and batch.image_index is not None:
            vision = self.vision(batch.pixel_values, batch.grids)  # [N, H]
            self.last_vision = vision  # read by the training-only vision probe
            flat = x.reshape(-1, x.shape[-1])
            flat = flat.index_copy(0, batch.image_index, vision.to(flat.dtype))
            x = flat.view_as(x)
        return x

    def vision(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """`QwenVisionTransformer.forward` with its per-image attention batched when all images
        share one grid (every generated picture does): same modules, same math, far fewer
        kernel launches. Other grids take the module's own forward."""
        vis = self.model.visual
        if any(g != grids[0] for g in grids) or vis.config.deepstack_visual_indexes:
            return vis(pixel_values, grids)[0]
        n, per = len(grids), grids[0][0] * grids[0][1] * grids[0][2]
        x = vis.patch_embed(pixel_values) + vis.position_embeddings(grids[:1]).repeat(n, 1)
        cos, sin = vis.rotary(grids[:1])
        cos, sin = cos.repeat(n, 1), sin.repeat(n, 1)
        for block in vis.blocks:
            attn = block.attn
            qkv = attn.qkv(block.norm1(x)).view(n * per, 3, attn.num_heads, attn.head_dim)
            q, k, v = qkv.unbind(1)
            q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
            q, k, v = (
                t.view(n, per, attn.num_heads, attn.head_dim).transpose(1, 2) for t in (q, k, v)
            )
            out = F.scaled_dot_product_attention(q, k, v)  # [n, heads, per, D]
            x = x + attn.proj(out.transpose(1, 2).reshape(n * per, -1))
            x = x + block.mlp(block.norm2(x))
        return vis.merger(x)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """-> (post-norm hidden [B, L, H], input embeddings [B, L, H], rope/mask context)."""
        x = self.embed(batch)
        cos, sin = self.rope(batch.positions)
        attn_mask = self.attention_mask(batch.mask)
        lm = self.model.language_model
        h = x
        for layer in lm.layers:
            h = layer(h, batch.mask, cos, sin, attn_mask)
        return lm.norm(h), x, (batch.mask, cos, sin, attn_mask)

    def mtp_hidden(self, next_embeds, hidden, ctx) -> torch.Tensor:
        mask, cos, sin, attn_mask = ctx
        return self.mtp(next_embeds, hidden, mask, cos, sin, attn_mask)

    def hub_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The checkpoint tensors under their Hub names, on the CPU (for safetensors)."""
        out = {}
        for name, value in self.state_dict().items():
            if name.endswith("linear_attn.norm_weight"):
                name = name.replace("norm_weight", "norm.weight")
            out[name] = value.detach().to("cpu", dtype).contiguous().clone()
        return out
