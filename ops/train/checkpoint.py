"""Writes the trained default model as a Hub-layout checkpoint folder: config.json (Qwen3.5 VLM
with MTP), generation_config.json, preprocessor_config.json (128x128 pixel cap: 16 image tokens),
tokenizer files and bf16 safetensors shards of at most `shard_bytes` each with their index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from appliance.testing import tiny
from appliance.testing.tiny_vl import write_preprocessor_config
from ops.train import images
from ops.train.model import ModelSize

SHARD_BYTES = 15 * 1024 * 1024


def config_dict(size: ModelSize, special: dict[str, int]) -> dict:
    overrides = {
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": size.head_dim,
        "linear_num_key_heads": size.linear_key_heads,
        "linear_num_value_heads": size.linear_value_heads,
        "linear_key_head_dim": size.linear_key_dim,
        "linear_value_head_dim": size.linear_value_dim,
        "linear_conv_kernel_dim": size.conv_kernel,
    }
    text = tiny.text_config_dict(
        moe=False,
        layer_types=size.layer_types,
        vocab_size=size.vocab_size,
        special=special,
        mtp=True,
        overrides=overrides,
    )
    text["dtype"] = "bfloat16"
    config = tiny._top_config(text, moe=False, layout="vlm", special=special)
    vision = config["vision_config"]
    vision.update(size.vit, out_hidden_size=size.hidden_size)
    return config


def write_shards(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> list[str]:
    """Greedy packing in key order; one file when everything fits in one shard."""
    shards: list[list[str]] = [[]]
    used = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if nbytes > shard_bytes:
            raise ValueError(f"{key}: {nbytes} bytes, more than one shard ({shard_bytes})")
        if used + nbytes > shard_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out / name), {"format": "pt"})
        weight_map.update({k: name for k in keys})
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def save_checkpoint(
    tensors: dict[str, torch.Tensor],
    size: ModelSize,
    special: dict[str, int],
    out: Path,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    names = write_shards(tensors, out, shard_bytes)
    tiny._write_json(out / "config.json", config_dict(size, special))
    generation = tiny._generation_config(special)
    tiny._write_json(out / "generation_config.json", generation)
    side = images.SIDE
    write_preprocessor_config(out, min_pixels=32 * 32, max_pixels=side * side)
    return names


def load_into(model: torch.nn.Module, folder: Path) -> None:
    """Load a checkpoint folder written by `save_checkpoint` into a `Qwen3_5Trainable` (fp32)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    renamed = {
        (k.replace("linear_attn.norm.weight", "linear_attn.norm_weight")): v.float()
        for k, v in state.items()
    }
    model.load_state_dict(renamed, strict=True)
