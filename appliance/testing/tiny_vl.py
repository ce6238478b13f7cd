"""Tiny randomised Qwen3-VL (dense, MoE) and Qwen3.5 VLM checkpoints in the real Hub key layout.

Called by vision and multimodal tests (ViT HF parity, image prompts end to end). Built with the
transformers ConditionalGeneration classes (models.md §7.3 sizes), re-drawn by `randomize_`, saved
as safetensors plus a `preprocessor_config.json` with a small pixel range and a tokenizer:
`tokenizer="qwen"` real vocabulary (151936 / 248320, ~100-150 MB checkpoints), `"bpe"` the
2000-token test BPE (~2 MB), `"none"` no tokenizer files but the ids of `"bpe"` (ViT-only tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.testing.randomize import randomize_
from appliance.testing.tokenizers import (
    BPE_SPECIALS,
    BPE_VOCAB_SIZE,
    QWEN_FAMILIES,
    build_bpe_tokenizer,
    build_qwen_tokenizer,
    special_token_ids,
)

TOKENIZER_KINDS = ("qwen", "bpe", "none")
TINY_MIN_PIXELS = 32 * 32  # preprocessor shortest_edge: a 64x64 image stays 64x64 (4 tokens)
TINY_MAX_PIXELS = 128 * 128  # preprocessor longest_edge: at most 64 image tokens per image

# models.md §7.3 tiny vision tower (shared by all three families; Qwen3-VL adds deepstack)
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
)
_TEXT_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
)
# Qwen3-VL-MoE experts: 2*I and I must both differ from hidden (64) so that the transposed Hub
# layout can be told apart from transformers' in-memory layout by shape (Transpose(check_dims)).
QWEN3_VL_MOE_TEXT = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def _tokenizer_ids(out_dir: Path, tokenizer: str, family: str) -> tuple[int, dict[str, int]]:
    """(vocab_size, special ids) after writing the requested tokenizer files into out_dir."""
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {', '.join(TOKENIZER_KINDS)}")
    if tokenizer == "qwen":
        build_qwen_tokenizer(out_dir, family=family)
        return QWEN_FAMILIES[family][3], special_token_ids(out_dir)
    if tokenizer == "bpe":
        build_bpe_tokenizer(out_dir)
        return BPE_VOCAB_SIZE, special_token_ids(out_dir)
    first = BPE_VOCAB_SIZE - len(BPE_SPECIALS)
    return BPE_VOCAB_SIZE, {name: first + i for i, name in enumerate(BPE_SPECIALS)}


def _token_fields(ids: dict[str, int]) -> dict[str, int]:
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def write_preprocessor_config(
    out_dir: str | Path, min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS
) -> Path:
    """The real checkpoints' preprocessor_config.json fields, with a small pixel range."""
    config = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    path = Path(out_dir) / "preprocessor_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def _save(
    model: torch.nn.Module, out_dir: Path, seed: int, min_pixels: int, max_pixels: int
) -> None:
    randomize_(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_preprocessor_config(out_dir, min_pixels, max_pixels)


def transpose_fused_experts(out_dir: str | Path) -> int:
    """Rewrite saved `mlp.experts.{gate_up,down}_proj` to the Qwen3-VL-MoE Hub orientation
    ([E, H, 2I] / [E, I, H], models.md §3.1). Returns the number of tensors rewritten."""
    out_dir = Path(out_dir)
    files = sorted(out_dir.glob("*.safetensors"))
    rewritten = 0
    for file in files:
        with safe_open(file, framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name, tensor in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = tensor.transpose(1, 2).contiguous()
                rewritten += 1
        save_file(tensors, file, metadata=metadata)
    return rewritten


def build_tiny_qwen3_vl(
    out_dir: str | Path,
    *,
    moe: bool = False,
    tokenizer: str = "qwen",
    seed: int = 0,
    deepstack_visual_indexes: tuple[int, ...] = (0,),
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
) -> Path:
    """Tiny `Qwen3VLForConditionalGeneration` (or `...Moe...` with transposed fused experts)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, ids = _tokenizer_ids(out_dir, tokenizer, "qwen3")
    text = dict(
        _TEXT_COMMON,
        vocab_size=vocab_size,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters=dict(
            rope_type="default", rope_theta=5e6, mrope_section=[8, 4, 4], mrope_interleaved=True
        ),
    )
    vision = dict(TINY_VISION, deepstack_visual_indexes=list(deepstack_visual_indexes))
    config_cls, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    if moe:
        text.update(QWEN3_VL_MOE_TEXT)
    config = config_cls(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **_token_fields(ids)
    )
    model = model_cls(config).eval()
    _save(model, out_dir, seed, min_pixels, max_pixels)
    if moe:
        rewritten = transpose_fused_experts(out_dir)
        assert rewritten == 2 * text["num_hidden_layers"], rewritten
    return out_dir


def build_tiny_qwen3_5_vl(
    out_dir: str | Path,
    *,
    tokenizer: str = "qwen",
    seed: int = 0,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
) -> Path:
    """Tiny `Qwen3_5ForConditionalGeneration`: hybrid GDN/gated-attention text model + ViT."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, ids = _tokenizer_ids(out_dir, tokenizer, "qwen3.5")
    text = dict(
        _TEXT_COMMON,
        vocab_size=vocab_size,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=1e7,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
    )
    config = Qwen3_5Config(
        text_config=text,
        vision_config=dict(TINY_VISION),
        tie_word_embeddings=False,
        **_token_fields(ids),
    )
    model = Qwen3_5ForConditionalGeneration(config).eval()
    _save(model, out_dir, seed, min_pixels, max_pixels)
    return out_dir
