"""Qwen3-VL dense and MoE text stacks (ordinary RMSNorm, ungated attention with q/k norms, full
interleaved M-RoPE, deepstack injection) and their checkpoint-name mapping. Used by the runner for
`Qwen3VLForConditionalGeneration` and `Qwen3VLMoeForConditionalGeneration`; the vision tower lives
in `visual/` and its embeddings reach this model through the runner (input_embeds + deepstack)."""

from __future__ import annotations

import re

import torch
from torch import nn

from appliance.models.config import TextConfig
from appliance.models.context import get_forward_context
from appliance.models.layers.attention import Attention
from appliance.models.layers.embedding import LMHead, VocabEmbedding
from appliance.models.layers.mlp import MLP
from appliance.models.layers.moe import SparseMoE
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.rotary import Rotary
from appliance.models.qwen3_5 import map_layer_name


def _text_raw(cfg: TextConfig) -> dict:
    return dict(cfg.raw.get("text_config") or cfg.raw)


def num_deepstack_layers(cfg: TextConfig) -> int:
    """How many decoder layers receive a deepstack embedding (one per ViT deepstack merger)."""
    vision = cfg.raw.get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or [])


def num_experts(cfg: TextConfig) -> int:
    """Hub configs say `num_experts`; transformers 5.x saves qwen3_vl_moe as `num_local_experts`."""
    return cfg.num_experts or int(_text_raw(cfg).get("num_local_experts") or 0)


def _is_sparse(cfg: TextConfig, layer: int) -> bool:
    text = _text_raw(cfg)
    step = text.get("decoder_sparse_step", 1) or 1
    return (
        num_experts(cfg) > 0
        and layer not in (text.get("mlp_only_layers") or [])
        and (layer + 1) % step == 0
    )


def _orienting_loader(moe: SparseMoE):
    """Fused expert loader that accepts both orientations: the Qwen3-VL-MoE Hub layout
    ([E, H, 2I] / [E, I, H], models.md §3.1) and transformers' in-memory one
    ([E, 2I, H] / [E, H, I]).
    When the shapes cannot tell them apart (2I == H or I == H) the Hub layout is assumed."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            if param is moe.w_gate_up:
                in_memory_shape = (2 * moe.intermediate, moe.hidden)
            else:
                in_memory_shape = (moe.hidden, moe.intermediate)
            in_memory = (
                tuple(loaded.shape[1:]) == in_memory_shape
                and in_memory_shape[0] != in_memory_shape[1]
            )
            shard_id = None if in_memory else "transposed"
        moe.load_experts(param, loaded, shard_id)

    return load


def make_mlp(cfg: TextConfig, layer: int) -> nn.Module:
    prefix = f"model.layers.{layer}.mlp"
    if _is_sparse(cfg, layer):
        # HF's Qwen3-VL-MoE router always renormalises the top-k weights and has no shared expert.
        moe = SparseMoE(
            cfg.hidden_size,
            num_experts(cfg),
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            0,
            norm_topk_prob=True,
            quant=cfg.quant,
            prefix=prefix,
        )
        moe.w_gate_up.weight_loader = moe.w_down.weight_loader = _orienting_loader(moe)
        return moe
    return MLP(cfg.hidden_size, cfg.intermediate_size, quant=cfg.quant, prefix=prefix)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            gated=False,
            zero_centered_norm=False,
            quant=cfg.quant,
            prefix=f"model.layers.{layer}.self_attn",
        )
        self.mlp = make_mlp(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the layer's output hidden state is their sum."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)


class Qwen3VLForCausalLM(nn.Module):
    """forward(ids, positions [T] or [3, T], embeds) -> post-final-norm hidden states [T, H].

    Deepstack embeddings come from the forward context (`ctx.deepstack`): embeds[i] is added to
    the image-token rows after decoder layer i."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        if _text_raw(cfg).get("attention_bias"):
            raise ValueError(
                "attention_bias: Qwen3-VL checkpoints with attention biases are not "
                "supported (expected false)"
            )
        if any(t != "full_attention" for t in cfg.layer_types):
            raise ValueError(
                f"layer_types: Qwen3-VL has full attention only, got {cfg.layer_types}"
            )
        self.config = cfg
        self.num_deepstack = num_deepstack_layers(cfg)
        if self.num_deepstack > cfg.num_hidden_layers:
            raise ValueError(
                f"deepstack_visual_indexes: {self.num_deepstack} entries for "
                f"{cfg.num_hidden_layers} decoder layers"
            )
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
        h = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        deepstack = get_forward_context().deepstack
        if deepstack is not None and len(deepstack.embeds) > len(self.model.layers):
            raise ValueError(
                f"{len(deepstack.embeds)} deepstack embeddings for {len(self.model.layers)} layers"
            )
        cos, sin = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, cos, sin)
            if deepstack is not None and i < len(deepstack.embeds):
                h = h.index_add(0, deepstack.rows, deepstack.embeds[i].to(h.dtype))
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, vocab] (LMHead.logits: into `out` when given)."""
        return self.lm_head.logits(hidden, out)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (parameter name, shard_id); None for the vision tower."""
        if name.startswith(("model.visual.", "visual.", "mtp.")):
            return None
        if name.endswith("rotary_emb.inv_freq"):
            return None
        name = re.sub(r"^model\.language_model\.", "model.", name)
        if name == "lm_head.weight":
            return "lm_head.weight", None
        return map_layer_name(name, self)
