"""Weight loading across the real checkpoint layouts (VLM prefix, plain causal-LM, fused and
per-expert MoE, sharded index) gives identical logits; a mismatching checkpoint is refused with an
error naming the missing and unexpected keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen3_5_parity import engine_logits

from appliance.engine.runner import ModelRunner
from appliance.models.loader import CheckpointMismatch
from appliance.offline.llm import build_engine_config
from appliance.testing.tiny import build_qwen3_5

IDS = list(range(3, 90, 2))


def logits(ckpt) -> torch.Tensor:
    config = build_engine_config(
        str(ckpt), 1, dict(max_num_seqs=2, num_kv_slots=256, max_model_len=128)
    )
    return engine_logits(ModelRunner(config), [IDS], chunk=64)[0]


@pytest.fixture(scope="module")
def moe_variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    kinds = {
        "fused": {},
        "per_expert": {"moe_layout": "per_expert"},
        "causal_lm": {"layout": "causal_lm"},
        "sharded": {"num_shards": 3},
    }
    return {name: build_qwen3_5(root / name, moe=True, seed=3, **kw) for name, kw in kinds.items()}


def test_every_layout_loads_to_the_same_logits(moe_variants):
    ref = logits(moe_variants["fused"])
    assert ref.std() > 0.5
    for name in ("per_expert", "causal_lm", "sharded"):
        torch.testing.assert_close(logits(moe_variants[name]), ref, atol=1e-5, rtol=0, msg=name)


def edited_copy(model_dir, dest, drop: str, add: dict | None = None):
    """The checkpoint in model_dir without `model.language_model.<drop>` and with `add`."""
    dest.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors.pop(f"model.language_model.{drop}")
    save_file({**tensors, **(add or {})}, str(dest / "model.safetensors"))
    return dest


def test_mismatch_names_missing_and_unexpected_keys(tiny_dense, tmp_path):
    bogus = {"model.language_model.layers.0.bogus.weight": torch.zeros(2)}
    bad = edited_copy(tiny_dense, tmp_path / "bad", "layers.1.self_attn.k_proj.weight", bogus)
    with pytest.raises(CheckpointMismatch) as err:
        logits(bad)
    assert "layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "layers.0.bogus.weight" in str(err.value)


@pytest.mark.parametrize(
    "dropped",
    ["layers.1.mlp.up_proj.weight", "layers.0.linear_attn.in_proj_z.weight"],
    ids=["mlp_up", "gdn_z"],
)
def test_a_missing_part_of_a_fused_weight_is_named(tiny_dense, tmp_path, dropped):
    """gate_up_proj and the GDN in_proj hold several checkpoint tensors: one absent must not load
    as uninitialised rows but be named like any missing key."""
    bad = edited_copy(tiny_dense, tmp_path / "bad", dropped)
    with pytest.raises(CheckpointMismatch, match=rf"missing keys: .*{dropped.replace('.', '[.]')}"):
        logits(bad)


def test_unknown_architecture_is_refused(tiny_dense, tmp_path):
    cfg = json.loads((tiny_dense / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        logits(tmp_path)
