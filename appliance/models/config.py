"""Text-model configuration parsed from a checkpoint's config.json (VLM `text_config` or flat
causal-LM form), shared by every model family. Called by the registry and the runner."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.models.layers.quant import QuantConfig, checkpoint_quant_config, parse_quant_config
from appliance.models.rope_scaling import RopeScaling, parse_rope_scaling


@dataclass(frozen=True)
class TextConfig:
    architecture: str
    model_type: str  # text model type, e.g. qwen3_5_text, qwen3_5_moe_text, qwen3_vl_text
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    intermediate_size: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # MTP head
    mtp_num_hidden_layers: int = 0
    # fp8 weights: from the checkpoint's quantization_config or --quantization (None: unquantised)
    quant: QuantConfig | None = None
    # rope_parameters' "linear" / "yarn" scaling (None: plain RoPE)
    rope_scaling: RopeScaling | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def tp_problem(self, tp: int) -> str | None:
        """Why this model's layers cannot be split over `tp` ranks (heads, KV heads, linear heads
        and MLP widths must divide; KV heads fewer than the ranks are replicated), or None. The
        layers check the same when they are built; this says it before any process starts."""
        widths = {
            "num_attention_heads": self.num_attention_heads,
            # a MoE model's dense MLP layers (Qwen3-VL's mlp_only_layers) use intermediate_size
            "intermediate_size": (
                self.intermediate_size
                if not self.is_moe
                or (self.raw.get("text_config") or self.raw).get("mlp_only_layers")
                else 0
            ),
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
        }
        if self.linear_attention_layers:
            widths["linear_num_key_heads"] = self.linear_num_key_heads
            widths["linear_num_value_heads"] = self.linear_num_value_heads
        bad = [f"{name} {value}" for name, value in widths.items() if value % tp]
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            bad.append(f"num_key_value_heads {kv} (nor a divisor of {tp})")
        if not bad:
            return None
        return f"tp {tp} does not divide {', '.join(bad)}"

    @property
    def max_context(self) -> int:
        """The longest context the positions serve: max_position_embeddings, or what a rope
        scaling stretches it to (vLLM's derived length)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return self.rope_scaling.max_context(self.max_position_embeddings)

    def context_problem(self, max_model_len: int) -> str | None:
        """Why a context of `max_model_len` tokens is more than the positions serve, or None."""
        if max_model_len <= self.max_context:
            return None
        scaled = f", stretched by rope {self.rope_scaling.rope_type}" if self.rope_scaling else ""
        return (
            f"{max_model_len} is more than the model's context ({self.max_context}: "
            f"max_position_embeddings {self.max_position_embeddings}{scaled})"
        )

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def _layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    n = text["num_hidden_layers"]
    if text.get("layer_types"):
        return tuple(text["layer_types"][:n])
    interval = text.get("full_attention_interval")
    if interval:
        return tuple(
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        )
    return ("full_attention",) * n


def _eos_ids(raw: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_text_config(model_dir: str | Path, quantization: str = "") -> TextConfig:
    """`quantization` is the --quantization value ("" = whatever the checkpoint says)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = dict(raw.get("text_config") or raw)
    # A yarn `rope_scaling` added beside `rope_parameters` (Qwen's long-context recipe) scales the
    # model's own rope: its keys over rope_parameters'. (transformers 5 takes rope_scaling alone,
    # which drops the model's rope_theta and M-RoPE sections.)
    scaling = dict(text.get("rope_scaling") or {})
    if "type" in scaling:  # the legacy spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    rope = {**(text.get("rope_parameters") or {}), **scaling}
    if text.get("original_max_position_embeddings"):  # top level wins, as in transformers
        rope["original_max_position_embeddings"] = text["original_max_position_embeddings"]
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    mrope = rope.get("mrope_section")
    max_positions = text.get("max_position_embeddings", 32768)
    return TextConfig(
        architecture=(raw.get("architectures") or [""])[0],
        model_type=text.get("model_type", raw.get("model_type", "")),
        hidden_size=text["hidden_size"],
        num_hidden_layers=text["num_hidden_layers"],
        layer_types=_layer_types(text),
        vocab_size=text["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        intermediate_size=text.get("intermediate_size", 0),
        rope_theta=float(theta),
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        ),
        mrope_section=tuple(mrope) if mrope else None,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(
            raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        eos_token_ids=_eos_ids(raw, text),
        linear_num_key_heads=text.get("linear_num_key_heads", 0),
        linear_num_value_heads=text.get("linear_num_value_heads", 0),
        linear_key_head_dim=text.get("linear_key_head_dim", 0),
        linear_value_head_dim=text.get("linear_value_head_dim", 0),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        num_experts=text.get("num_experts", 0),
        num_experts_per_tok=text.get("num_experts_per_tok", 0),
        moe_intermediate_size=text.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
        norm_topk_prob=text.get("norm_topk_prob", True),
        mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
        quant=parse_quant_config(checkpoint_quant_config(model_dir, raw), quantization),
        rope_scaling=parse_rope_scaling(rope, max_positions),
        raw=raw,
    )
