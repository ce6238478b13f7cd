"""Tiny deterministic Qwen3.5 and Qwen3.5-MoE checkpoints in the real Hub layout (models.md §3, §5).

Called by tests (session fixtures in tests/conftest.py), `appliance.testing.oracle` and the embedded
default model (`appliance.assets.default_model`). Same arguments -> bit-identical files.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from appliance.testing import tokenizers as tok_lib
from appliance.testing.randomize import randomize_

# §7.3 tiny text config; every field may be overridden through **overrides.
TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
VISION_CONFIG: dict[str, Any] = {
    "deepstack_visual_indexes": [],
    "depth": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_position_embeddings": 64,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
LAYOUTS = ("vlm", "causal_lm")
MOE_LAYOUTS = ("fused", "per_expert")
TOKENIZERS = ("bpe", "qwen3.5")
_SHORT_LAYER_TYPES = {"linear": "linear_attention", "full": "full_attention"}
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _modeling(moe: bool):
    if moe:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mod

        return mod, mod.Qwen3_5MoeConfig, mod.Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    return mod, mod.Qwen3_5Config, mod.Qwen3_5ForConditionalGeneration


def mrope_section(rotary_dim: int) -> list[int]:
    """Split rotary_dim/2 frequencies over (T, H, W), like the real [11, 11, 10] for dim 64."""
    half = rotary_dim // 2
    base, rem = divmod(half, 3)
    return [base + (1 if i < rem else 0) for i in range(3)]


def _full_attention_interval(layer_types: list[str]) -> int | None:
    for k in range(1, len(layer_types) + 1):
        if all((lt == "full_attention") == ((i + 1) % k == 0) for i, lt in enumerate(layer_types)):
            return k
    return None


def text_config_dict(
    *,
    moe: bool,
    layer_types: list[str],
    vocab_size: int,
    special: dict[str, int],
    mtp: bool,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """The `text_config` of a real Qwen3.5 config.json, filled with the tiny sizes."""
    fields = {**TEXT_DEFAULTS, **(MOE_DEFAULTS if moe else {}), **overrides}
    if moe and "intermediate_size" not in overrides:
        fields.pop("intermediate_size")  # not a Qwen3.5-MoE text config field
    rotary_dim = int(fields["head_dim"] * fields["partial_rotary_factor"])
    rope = {
        "mrope_interleaved": True,
        "mrope_section": fields.pop("mrope_section", mrope_section(rotary_dim)),
        "partial_rotary_factor": fields.pop("partial_rotary_factor"),
        "rope_theta": fields.pop("rope_theta"),
        "rope_type": "default",
    }
    eos = special["<|endoftext|>"]
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": eos,
        "dtype": "float32",
        "eos_token_id": eos,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "num_hidden_layers": len(layer_types),
        "output_gate_type": "swish",
        "rope_parameters": rope,
        "use_cache": True,
        "vocab_size": vocab_size,
        **fields,
    }
    interval = _full_attention_interval(layer_types)
    if interval is not None:
        text["full_attention_interval"] = interval
    if moe:
        text.update(router_aux_loss_coef=0.001, output_router_logits=False)
    return text


def _normalise_layer_types(layer_types: list[str] | None, num_layers: int | None) -> list[str]:
    if layer_types is None:
        n = 4 if num_layers is None else num_layers
        return ["full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(n)]
    out = [_SHORT_LAYER_TYPES.get(lt, lt) for lt in layer_types]
    bad = [lt for lt in out if lt not in ("linear_attention", "full_attention")]
    if bad or (num_layers is not None and num_layers != len(out)):
        raise ValueError(f"layer_types={layer_types!r} num_hidden_layers={num_layers!r}: invalid")
    return out


class MtpHead(nn.Module):
    """The Qwen3.5 MTP head with the real `mtp.*` parameter names (§5.3), from HF layer classes."""

    def __init__(self, text_config, moe: bool) -> None:
        super().__init__()
        mod, _, _ = _modeling(moe)
        norm_cls = mod.Qwen3_5MoeRMSNorm if moe else mod.Qwen3_5RMSNorm
        layer_cls = mod.Qwen3_5MoeDecoderLayer if moe else mod.Qwen3_5DecoderLayer
        cfg = copy.deepcopy(text_config)
        cfg.layer_types = ["full_attention"]
        cfg.num_hidden_layers = 1
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.norm = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList([layer_cls(cfg, 0)])
        rotary_cls = mod.Qwen3_5MoeTextRotaryEmbedding if moe else mod.Qwen3_5TextRotaryEmbedding
        self.rotary_emb = rotary_cls(config=cfg)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, H] embeddings of tokens t+1 and main post-norm hidden states at t -> [B, L, H]."""
        u = torch.cat(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1
        )
        x = self.fc(u)  # [B, L, H]
        batch, length, _ = x.shape
        positions = torch.arange(length).view(1, 1, -1).expand(3, batch, -1)  # [3, B, L]
        cos_sin = self.rotary_emb(x, positions)
        blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
        causal = torch.zeros(length, length).masked_fill(blocked, float("-inf"))  # [L, L]
        causal = causal[None, None]  # [1, 1, L, L]
        x = self.layers[0](
            x, position_embeddings=cos_sin, attention_mask=causal, position_ids=positions[0]
        )
        return self.norm(x)


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused `experts.gate_up_proj [E,2I,H]`, `down_proj [E,H,I]` -> per-expert `[I,H]`, `[H,I]`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = value[e, inter:].clone()
        elif key.endswith(".experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[key] = value
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `split_experts`: per-expert keys -> the fused Hub / in-memory layout."""
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
        else:
            groups.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = value
    for prefix, parts in groups.items():
        num = 1 + max(e for e, _ in parts)
        gate_up = [
            torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(num)
        ]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num)])
    return out


def _write_safetensors(
    tensors: dict[str, torch.Tensor], out: pathlib.Path, num_shards: int
) -> None:
    keys = sorted(tensors)
    if num_shards <= 1:
        save_file({k: tensors[k] for k in keys}, str(out / "model.safetensors"), {"format": "pt"})
        return
    per_shard = -(-len(keys) // num_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = keys[i * per_shard : (i + 1) * per_shard]
        save_file({k: tensors[k] for k in chunk}, str(out / name), {"format": "pt"})
        for k in chunk:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _top_config(
    text: dict[str, Any], *, moe: bool, layout: str, special: dict[str, int]
) -> dict[str, Any]:
    if layout == "causal_lm":
        arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text}
    vision = {"model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision", **VISION_CONFIG}
    vision["out_hidden_size"] = text["hidden_size"]
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "dtype": text["dtype"],
        "image_token_id": special["<|image_pad|>"],
        "video_token_id": special["<|video_pad|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
        "language_model_only": False,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": vision,
    }


def _generation_config(special: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": special["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _build_model(text: dict[str, Any], *, moe: bool, special: dict[str, int], seed: int):
    _, config_cls, model_cls = _modeling(moe)
    vision = {k: v for k, v in VISION_CONFIG.items() if k != "deepstack_visual_indexes"}
    vision["out_hidden_size"] = text["hidden_size"]
    config = config_cls(
        text_config={k: v for k, v in text.items() if k != "model_type"},
        vision_config=vision,
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    # HF init draws from the global RNG: keep the caller's state untouched
    with torch.random.fork_rng(devices=[]):
        model = model_cls(config).eval()
        randomize_(model, seed)
        if text["tie_word_embeddings"]:  # the N(0,1) embedding doubles as lm_head: keep logits ~ 1
            with torch.no_grad():
                model.get_input_embeddings().weight.mul_(text["hidden_size"] ** -0.5)
        head = MtpHead(config.text_config, moe)
        randomize_(head, seed + 1_000_003)
    return model, head


def build_qwen3_5(
    out_dir: str | os.PathLike,
    *,
    moe: bool = False,
    layer_types: list[str] | None = None,
    seed: int = 0,
    tokenizer: str = "bpe",
    mtp: bool = True,
    num_hidden_layers: int | None = None,
    layout: str = "vlm",
    moe_layout: str = "fused",
    mtp_moe_layout: str = "per_expert",
    dtype: str = "float32",
    num_shards: int = 1,
    train: Any = None,
    **overrides: Any,
) -> pathlib.Path:
    """Write a tiny random Qwen3.5 (MoE if `moe`) checkpoint with tokenizer files into `out_dir`.

    layout "vlm": `Qwen3_5[Moe]ForConditionalGeneration` keys (`model.language_model.*`,
    `model.visual.*`, `lm_head`) as on the Hub; "causal_lm": `model.layers.*` keys
    (`Qwen3_5[Moe]ForCausalLM`).
    moe_layout "fused" (Hub: `experts.gate_up_proj [E,2I,H]`, `down_proj [E,H,I]`) or "per_expert".
    The text weights depend only on the config and seed, not on layout choices.
    `train(model, head)`, if given, may update the randomised HF model and MTP head in place before
    they are written (see `appliance.testing.synthetic`).
    """
    for name, value, allowed in (
        ("layout", layout, LAYOUTS),
        ("moe_layout", moe_layout, MOE_LAYOUTS),
        ("mtp_moe_layout", mtp_moe_layout, MOE_LAYOUTS),
        ("tokenizer", tokenizer, TOKENIZERS),
        ("dtype", dtype, ("float32", "bfloat16", "float16")),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        tok_lib.build_bpe_tokenizer(out)
        vocab_size = tok_lib.BPE_VOCAB_SIZE
    else:
        tok_lib.build_qwen_tokenizer(out, family=tokenizer)
        vocab_size = tok_lib.QWEN_FAMILIES[tokenizer][3]
    special = tok_lib.special_token_ids(out)
    vocab_size = overrides.pop("vocab_size", vocab_size)
    types = _normalise_layer_types(layer_types, num_hidden_layers)
    text = text_config_dict(
        moe=moe,
        layer_types=types,
        vocab_size=vocab_size,
        special=special,
        mtp=mtp,
        overrides=overrides,
    )
    model, head = _build_model(text, moe=moe, special=special, seed=seed)
    if train is not None:
        train(model, head)

    state = {k: v.detach() for k, v in model.state_dict().items()}
    if text["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    if layout == "causal_lm":
        state = {
            k.replace("model.language_model.", "model.", 1): v
            for k, v in state.items()
            if not k.startswith("model.visual.")
        }
    if moe and moe_layout == "per_expert":
        state = split_experts(state)
    if mtp:
        mtp_state = {f"mtp.{k}": v.detach() for k, v in head.state_dict().items()}
        if moe and mtp_moe_layout == "per_expert":
            mtp_state = split_experts(mtp_state)
        state.update(mtp_state)
    torch_dtype = getattr(torch, dtype)
    tensors = {k: v.to(torch_dtype).contiguous().clone() for k, v in state.items()}
    text["dtype"] = dtype
    _write_safetensors(tensors, out, num_shards)
    _write_json(out / "config.json", _top_config(text, moe=moe, layout=layout, special=special))
    _write_json(out / "generation_config.json", _generation_config(special))
    return out
