"""Qwen3.5 dense and MoE text stacks (hybrid Gated DeltaNet + gated full attention, zero-centred
norms) and their checkpoint-name mapping. Used by the runner for
`Qwen3_5(Moe)ForConditionalGeneration` and `Qwen3_5(Moe)ForCausalLM`; the MTP draft
(appliance/models/qwen3_5_mtp.py) reuses the decoder layer."""

from __future__ import annotations

import re

import torch
from torch import nn

from appliance.models.config import TextConfig
from appliance.models.layers.attention import Attention, map_qkv_name
from appliance.models.layers.embedding import LMHead, VocabEmbedding
from appliance.models.layers.gdn import BA_SHARDS, IN_PROJ_SHARDS, GatedDeltaNet
from appliance.models.layers.mlp import MLP
from appliance.models.layers.moe import SparseMoE
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.rotary import Rotary
from appliance_kernels.gemv_norm import AddNorm, PendingNorm

# At one row where the GEMVs run, each RMSNorm between two projections is split across them
# instead of running its own kernel (appliance_kernels/gemv_norm.py). False: the norm kernels
# (tests, ops/bench/bench_static.py --split-norms).
SPLIT_NORMS = True


def make_mlp(cfg: TextConfig, prefix: str) -> nn.Module:
    if cfg.is_moe:
        return SparseMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
            cfg.norm_topk_prob,
            quant=cfg.quant,
            prefix=prefix,
        )
    return MLP(cfg.hidden_size, cfg.intermediate_size, quant=cfg.quant, prefix=prefix)


class DecoderLayer(nn.Module):
    """`prefix` is the layer's checkpoint name (e.g. model.layers.3, mtp.layers.0): the
    quantization config's ignore lists are matched against it."""

    def __init__(self, cfg: TextConfig, layer_type: str, prefix: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
                quant=cfg.quant,
                prefix=f"{prefix}.linear_attn",
            )
        else:
            self.self_attn = Attention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
                gated=True,
                zero_centered_norm=True,
                quant=cfg.quant,
                prefix=f"{prefix}.self_attn",
            )
        self.mlp = make_mlp(cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, True)

    def forward(
        self,
        h: torch.Tensor | PendingNorm,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        next_layer: DecoderLayer | None = None,
    ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        """(MLP output, residual). At one row on the GEMVs each RMSNorm between two projections
        is split across them (appliance_kernels/gemv_norm.py, SPLIT_NORMS): h may arrive as the
        previous layer's PendingNorm (its input norm done) and the MLP output may leave as one
        for `next_layer`'s input norm."""
        if isinstance(h, PendingNorm):
            residual = h.residual
        elif residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        post = split_norm(self.post_attention_layernorm, residual, self.mlp)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, post)
        else:
            h = self.self_attn(h, cos, sin, post)
        h, residual = self.post_attention_layernorm.add(h, residual)
        if next_layer is None or not isinstance(self.mlp, MLP):  # the MoE sum is no GEMV
            return self.mlp(h), residual
        return self.mlp(h, split_norm(next_layer.input_layernorm, residual, next_layer)), residual

    def takes_pending(self, x: torch.Tensor) -> bool:
        """Whether this layer's attention / GDN projections finish a PendingNorm."""
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        return mixer.takes_pending(x)


def split_norm(norm: RMSNorm, residual: torch.Tensor, consumer: nn.Module) -> AddNorm | None:
    """The AddNorm a one-row producing GEMV is handed (appliance_kernels/gemv_norm.py) where
    the norm's consumer finishes it inside its own GEMV; None: the norm kernel runs."""
    if not SPLIT_NORMS or residual.shape[0] != 1 or not residual.is_contiguous():
        return None
    takes = getattr(consumer, "takes_pending", None)
    return norm.split(residual) if takes is not None and takes(residual) else None


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, f"model.layers.{i}") for i, t in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)


class Qwen3_5ForCausalLM(nn.Module):
    """forward(ids, positions, embeds) -> post-final-norm hidden states [T, H]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.rotary = Rotary(
            cfg.head_dim,
            cfg.partial_rotary_factor,
            cfg.rope_theta,
            list(cfg.mrope_section) if cfg.mrope_section else None,
            cfg.rope_scaling,
        )
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary(positions)
        residual = None
        layers = self.model.layers
        for i, layer in enumerate(layers):
            h, residual = layer(
                h, residual, cos, sin, layers[i + 1] if i + 1 < len(layers) else None
            )
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, vocab] (LMHead.logits: into `out` when given)."""
        return self.lm_head.logits(hidden, out)

    def draft_ids(self, hidden: torch.Tensor, vocab_limit: int = 0) -> torch.Tensor:
        """MTP drafts: the greedy token of each row [N, H] among the first `vocab_limit` ids."""
        return self.lm_head.argmax(hidden, vocab_limit)

    # ------------------------------------------------------------------ checkpoint names
    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (parameter name, shard_id), or None for tensors that belong to
        another component (vision tower, MTP head). Raises KeyError for unknown names."""
        if name.startswith(("model.visual.", "visual.", "mtp.")) or name.endswith(
            "rotary_emb.inv_freq"
        ):
            return None
        name = re.sub(r"^model\.language_model\.", "model.", name)
        if name == "lm_head.weight":
            return "lm_head.weight", None
        pname, shard = map_layer_name(name, self)
        if pname.endswith(".linear_attn.in_proj.weight") and shard in BA_SHARDS:
            gdn = self.get_submodule(pname[: -len(".in_proj.weight")])
            if gdn.in_proj_ba is not None:  # b and a kept unquantised: their own GEMM
                return pname.replace(".in_proj.", ".in_proj_ba."), BA_SHARDS[shard]
        return pname, shard


_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def map_layer_name(name: str, model: nn.Module) -> tuple[str, object]:
    """Shared by the main model and the MTP layer: HF decoder-layer names -> ours. `model` holds
    the layers under those names (q/k/v go to `qkv_proj` only where the layer fused them)."""
    if qkv := map_qkv_name(model, name):
        return qkv
    if m := _EXPERT.match(name):
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        param = "w_down" if proj == "down" else "w_gate_up"
        return f"{prefix}.{param}", (proj, expert)
    if name.endswith(".experts.gate_up_proj"):
        return name.replace(".experts.gate_up_proj", ".w_gate_up"), None
    if name.endswith(".experts.down_proj"):
        return name.replace(".experts.down_proj", ".w_down"), None
    for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
        suffix = f".{proj}.weight"
        if name.endswith(suffix) and ".mlp." in name:
            return name[: -len(suffix)] + ".gate_up_proj.weight", shard
    for proj, shard in IN_PROJ_SHARDS.items():
        suffix = f".linear_attn.{proj}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".linear_attn.in_proj.weight", shard
    if name.endswith(".linear_attn.conv1d.weight"):
        return name.replace(".conv1d.weight", ".conv1d_weight"), None
    return name, None
