"""randomize_ (models.md §7.2): deterministic, per-class norm rules, logits of std ~ 1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

from appliance.testing.randomize import UnknownParameterError, randomize_


def _text_model(**overrides) -> nn.Module:
    config = q35.Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **overrides,
    )
    return q35.Qwen3_5ForCausalLM(config).eval()


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = _text_model(), _text_model(), _text_model()
    randomize_(a, 7)
    randomize_(b, 7)
    randomize_(c, 8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_norm_rules_follow_module_class():
    model = _text_model()
    randomize_(model, 0)
    params = dict(model.named_parameters())
    zero_centred = params["model.layers.1.input_layernorm.weight"]  # Qwen3_5RMSNorm: (1 + w)
    gated = params["model.layers.0.linear_attn.norm.weight"]  # Qwen3_5RMSNormGated: w
    q_norm = params["model.layers.1.self_attn.q_norm.weight"]
    assert abs(zero_centred.mean().item()) < 0.1 and 0.1 < zero_centred.std().item() < 0.35
    assert abs(q_norm.mean().item()) < 0.15
    assert abs(gated.mean().item() - 1.0) < 0.2 and gated.std().item() > 0.05
    a_log = params["model.layers.0.linear_attn.A_log"]
    assert (a_log >= 0).all() and (a_log <= math.log(16.0)).all()
    embed = params["model.embed_tokens.weight"]
    assert 0.9 < embed.std().item() < 1.1
    q_proj = params["model.layers.1.self_attn.q_proj.weight"]  # fan_in 64 -> std 1/8
    assert abs(q_proj.std().item() - 1 / 8) < 0.01
    conv = params["model.layers.0.linear_attn.conv1d.weight"]  # depthwise [C, 1, 4]: fan_in 4
    assert abs(conv.std().item() - 0.5) < 0.05


def test_logits_have_unit_scale():
    model = _text_model()
    randomize_(model, 0)
    ids = torch.arange(0, 300, 3).view(1, -1)  # [1, 100]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert 0.6 < logits.std().item() < 1.6


def test_unknown_parameter_is_an_error():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with pytest.raises(UnknownParameterError, match="scale"):
        randomize_(Odd(), 0)
