"""appliance.testing.tiny_vl: Hub key layouts, transposed MoE experts, ids, preprocessor."""

from __future__ import annotations

import json

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from appliance.testing.randomize import randomize_
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from visual.preprocess import PreprocessConfig, preprocess_image


def saved_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def test_moe_experts_are_saved_transposed_and_reload_exactly(qwen3_vl_moe_dir):
    shapes = saved_shapes(qwen3_vl_moe_dir)
    # Hub layout of Qwen3-VL-MoE: gate_up [E, H, 2I], down [E, I, H] with H=64, I=48
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (8, 64, 96)
    assert shapes["model.language_model.layers.3.mlp.experts.down_proj"] == (8, 48, 64)
    loaded = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(qwen3_vl_moe_dir)
    assert loaded.model.language_model.layers[0].mlp.experts.gate_up_proj.shape == (8, 96, 64)
    # the same build in memory (same seed) equals what transformers reads back, bit for bit
    config = transformers.AutoConfig.from_pretrained(qwen3_vl_moe_dir)
    rebuilt = transformers.Qwen3VLMoeForConditionalGeneration(config)
    randomize_(rebuilt, 2)
    expected = rebuilt.state_dict()
    got = loaded.state_dict()
    assert set(expected) == set(got)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_hub_key_layout_and_config(qwen3_vl_dir, qwen3_5_vl_dir):
    for model_dir, arch, deepstack in (
        (qwen3_vl_dir, "Qwen3VLForConditionalGeneration", [0]),
        (qwen3_5_vl_dir, "Qwen3_5ForConditionalGeneration", None),
    ):
        shapes = saved_shapes(model_dir)
        assert shapes["model.visual.patch_embed.proj.weight"] == (32, 3, 2, 16, 16)
        assert shapes["model.visual.pos_embed.weight"] == (64, 32)
        assert shapes["model.language_model.embed_tokens.weight"] == (2000, 64)
        assert shapes["lm_head.weight"] == (2000, 64)
        assert all(
            name.startswith(("model.visual.", "model.language_model.", "lm_head."))
            for name in shapes
        )
        config = json.loads((model_dir / "config.json").read_text())
        assert config["architectures"] == [arch]
        assert config["vision_config"].get("deepstack_visual_indexes") == deepstack
        assert config["image_token_id"] == 1996  # <|image_pad|> of the test BPE layout
    assert "model.visual.deepstack_merger_list.0.norm.weight" in saved_shapes(qwen3_vl_dir)
    q35 = saved_shapes(qwen3_5_vl_dir)
    assert q35["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (128, 64)


def test_preprocessor_config_reloads_in_hf(qwen3_5_vl_dir, make_image):
    ours = PreprocessConfig.from_pretrained(qwen3_5_vl_dir)
    assert (ours.min_pixels, ours.max_pixels) == (32 * 32, 128 * 128)
    hf = Qwen2VLImageProcessorPil.from_pretrained(qwen3_5_vl_dir)
    image = make_image(200, 90, seed=3)
    np.testing.assert_array_equal(
        preprocess_image(image, ours).pixel_values, hf([image])["pixel_values"]
    )


def test_real_qwen3_vocabulary(tmp_path):
    model_dir = build_tiny_qwen3_vl(tmp_path, tokenizer="qwen")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == 151936
    assert (config["image_token_id"], config["vision_start_token_id"]) == (151655, 151652)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert saved_shapes(model_dir)["lm_head.weight"] == (151936, 64)
