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
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h)
        else:
            h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin)
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
