"""Tiny Qwen3.5 checkpoints: Hub key layout, determinism, bit-exact HF reload, layout variants."""

from __future__ import annotations

import json
import re

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from appliance.testing.oracle import hf_logits, hf_model
from appliance.testing.tiny import build_qwen3_5

MTP_DENSE_KEYS = {
    "mtp.fc.weight": [64, 128],
    "mtp.pre_fc_norm_embedding.weight": [64],
    "mtp.pre_fc_norm_hidden.weight": [64],
    "mtp.norm.weight": [64],
    "mtp.layers.0.input_layernorm.weight": [64],
    "mtp.layers.0.post_attention_layernorm.weight": [64],
    "mtp.layers.0.self_attn.q_proj.weight": [2 * 4 * 32, 64],
    "mtp.layers.0.self_attn.k_proj.weight": [2 * 32, 64],
    "mtp.layers.0.self_attn.v_proj.weight": [2 * 32, 64],
    "mtp.layers.0.self_attn.o_proj.weight": [64, 4 * 32],
    "mtp.layers.0.self_attn.q_norm.weight": [32],
    "mtp.layers.0.self_attn.k_norm.weight": [32],
    "mtp.layers.0.mlp.gate_proj.weight": [128, 64],
    "mtp.layers.0.mlp.up_proj.weight": [128, 64],
    "mtp.layers.0.mlp.down_proj.weight": [64, 128],
}
IDS = [(i * 37 + 11) % 1990 for i in range(90)]


def shapes(ckpt) -> dict[str, list[int]]:
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out.update({k: list(handle.get_slice(k).get_shape()) for k in handle.keys()})
    return out


def tensors(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


def test_dense_keys_are_the_hub_layout(tiny_dense):
    keys = shapes(tiny_dense)
    assert keys["lm_head.weight"] == [2000, 64]
    assert keys["model.language_model.embed_tokens.weight"] == [2000, 64]
    assert keys["model.language_model.norm.weight"] == [64]
    assert keys["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == [128, 64]
    assert keys["model.language_model.layers.1.self_attn.q_proj.weight"] == [256, 64]
    assert keys["model.visual.patch_embed.proj.weight"] == [32, 3, 2, 16, 16]
    assert any(k.startswith("model.visual.blocks.1.") for k in keys)
    assert {k: v for k, v in keys.items() if k.startswith("mtp.")} == MTP_DENSE_KEYS
    prefixes = {
        re.match(r"^(lm_head|mtp|model\.visual|model\.language_model)\.", k) is not None
        for k in keys
    }
    assert prefixes == {True}
    config = json.loads((tiny_dense / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert text["full_attention_interval"] == 2 and text["mtp_num_hidden_layers"] == 1
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]
    assert config["image_token_id"] == 1996 and text["eos_token_id"] == 1990
    generation = json.loads((tiny_dense / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1992, 1990]


def test_moe_keys_are_fused_hub_layout_with_per_expert_mtp(tiny_moe):
    keys = shapes(tiny_moe)
    layer = "model.language_model.layers.2.mlp."
    assert keys[layer + "experts.gate_up_proj"] == [8, 64, 64]  # [E, 2I, H]
    assert keys[layer + "experts.down_proj"] == [8, 64, 32]  # [E, H, I]
    assert keys[layer + "gate.weight"] == [8, 64]
    assert keys[layer + "shared_expert.gate_proj.weight"] == [48, 64]
    assert keys[layer + "shared_expert_gate.weight"] == [1, 64]
    assert not any(re.search(r"language_model.*experts\.\d+\.", k) for k in keys)
    for e in range(8):
        assert keys[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] == [32, 64]
        assert keys[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] == [64, 32]
    config = json.loads((tiny_moe / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["text_config"]["layer_types"][2] == "full_attention"


def test_build_is_bit_identical(tiny_moe, tmp_path):
    again = build_qwen3_5(
        tmp_path, moe=True, layer_types=["linear", "linear", "full", "linear"], seed=1
    )
    names = sorted(p.name for p in tiny_moe.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_moe / name).read_bytes() == (again / name).read_bytes(), name


def test_hf_reload_is_bit_identical(tiny_moe):
    from transformers import Qwen3_5MoeForConditionalGeneration

    saved = tensors(tiny_moe)
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(tiny_moe), dtype=torch.float32)
    params = model.state_dict()
    main_keys = {k for k in saved if not k.startswith("mtp.")}
    assert main_keys == set(params)
    for key in main_keys:
        assert torch.equal(saved[key], params[key]), key
    causal = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.float32)
    for key, value in causal.state_dict().items():
        assert torch.equal(saved[key.replace("model.", "model.language_model.", 1)], value), key


def test_layout_variants_give_identical_hf_logits(tiny_moe, tmp_path):
    per_expert = build_qwen3_5(
        tmp_path / "pe",
        moe=True,
        seed=1,
        moe_layout="per_expert",
        layer_types=["linear", "linear", "full", "linear"],
        num_shards=3,
    )
    causal = build_qwen3_5(
        tmp_path / "lm",
        moe=True,
        seed=1,
        layout="causal_lm",
        mtp=False,
        layer_types=["linear", "linear", "full", "linear"],
    )
    keys = shapes(per_expert)
    assert keys["model.language_model.layers.0.mlp.experts.7.up_proj.weight"] == [32, 64]
    index = json.loads((per_expert / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert set(index["weight_map"]) == set(keys)
    causal_keys = shapes(causal)
    assert "model.layers.0.linear_attn.A_log" in causal_keys
    assert not any(
        k.startswith(("model.visual", "model.language_model", "mtp.")) for k in causal_keys
    )
    config = json.loads((causal / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config["model_type"] == "qwen3_5_moe_text"
    reference = hf_model(tiny_moe).state_dict()
    for variant in (per_expert, causal):
        params = hf_model(variant).state_dict()
        assert set(params) == set(reference)
        assert all(torch.equal(params[k], reference[k]) for k in reference)
    logits = hf_logits(tiny_moe, IDS)
    assert 0.7 < logits.std().item() < 1.4
    # same parameters; only kernel/alignment noise (seen: 7e-7) may differ
    assert torch.allclose(hf_logits(per_expert, IDS), logits, atol=1e-5, rtol=0)
    assert torch.allclose(hf_logits(causal, IDS), logits, atol=1e-5, rtol=0)


def test_seed_and_overrides_change_weights(tmp_path):
    a = build_qwen3_5(
        tmp_path / "a", seed=5, num_hidden_layers=2, mtp=False, hidden_size=32, dtype="bfloat16"
    )
    keys = shapes(a)
    assert keys["model.language_model.embed_tokens.weight"] == [2000, 32]
    assert not any(k.startswith("mtp.") for k in keys)
    config = json.loads((a / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 0
    assert config["text_config"]["dtype"] == "bfloat16"
    assert tensors(a)["lm_head.weight"].dtype == torch.bfloat16
    logits = hf_logits(a, IDS[:20])
    assert logits.shape == (20, 2000) and torch.isfinite(logits).all()
