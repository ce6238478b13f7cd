"""Reads the vision tower's tensors (`model.visual.*`) out of an HF safetensors checkpoint.

Called by `visual.encoder.VisionEncoder.from_pretrained`. Handles a single `model.safetensors` and a
sharded `model.safetensors.index.json`, opens only the shards that hold vision tensors, and refuses
a checkpoint whose keys or shapes do not match the module (naming the offending keys).

The tower runs in the model's 16-bit dtype. A quantised checkpoint whose ignore list did not keep
it unquantised (an fp8 e4m3 `weight` beside its `weight_scale` / `weight_scale_inv`, per tensor,
per channel or per [block_n, block_k] tile as its `quantization_config` says) is dequantised here,
once, at load; its static activation scales (`input_scale`) are dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.fp8_block import dequantize_block

# Hub layouts: transformers 5.x and the Qwen3-VL / Qwen3.5 releases nest it under `model.visual.`;
# Qwen2-VL-era exports keep it at the top level as `visual.`.
VISUAL_PREFIXES = ("model.visual.", "visual.")
_SHOWN_KEYS = 12


class VisionCheckpointError(ValueError):
    """The checkpoint has no usable vision tower (missing files, keys, or mismatched shapes)."""


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it (names from the index, or from each file's header)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise VisionCheckpointError(f"no *.safetensors files in {model_dir}")
    located = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            located.update({name: file for name in handle.keys()})
    return located


def _shorten(names: set[str]) -> str:
    shown = sorted(names)[:_SHOWN_KEYS]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" … and {more} more" if more > 0 else "")


def read_visual_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every vision-tower tensor, keyed without the prefix (`blocks.0.attn.qkv.weight`)."""
    model_dir = Path(model_dir)
    located = _weight_files(model_dir)
    for prefix in VISUAL_PREFIXES:
        names = [name for name in located if name.startswith(prefix)]
        if names:
            break
    else:
        raise VisionCheckpointError(
            f"{model_dir} has no vision tower tensors (looked for {' or '.join(VISUAL_PREFIXES)}*)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(located[name], []).append(name)
    tensors = {}
    for file, file_names in sorted(by_file.items()):
        if not file.is_file():
            raise VisionCheckpointError(f"checkpoint shard {file.name} is missing from {model_dir}")
        with safe_open(file, framework="pt") as handle:
            for name in file_names:
                tensors[name[len(prefix) :]] = handle.get_tensor(name)
    if any(t.dtype == FP8_DTYPE for t in tensors.values()):
        tensors = dequantize_fp8(tensors, _block_size(model_dir))
    return tensors


def _block_size(model_dir: Path) -> tuple[int, int] | None:
    """The checkpoint's fp8 block size: `weight_block_size` (Qwen / DeepSeek "fp8") or
    compressed-tensors' `block_structure`; None for per-tensor / per-channel scales."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    text = raw.get("text_config") or {}
    quant = raw.get("quantization_config") or text.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    for group in (quant.get("config_groups") or {}).values():
        block = block or (group.get("weights") or {}).get("block_structure")
    return (int(block[0]), int(block[1])) if block else None


def dequantize_fp8(
    tensors: dict[str, torch.Tensor], block: tuple[int, int] | None
) -> dict[str, torch.Tensor]:
    """fp8 e4m3 weights [N, K] times their scales ([] / [1] per tensor, [N] / [N, 1] per channel,
    [ceil(N / bn), ceil(K / bk)] per tile of `block`) as fp32; scales and `input_scale`s dropped."""
    out = {n: t for n, t in tensors.items() if not n.endswith(".input_scale")}
    for name in [n for n, t in out.items() if t.dtype == FP8_DTYPE]:
        scale = next((out.pop(name + s) for s in ("_scale_inv", "_scale") if name + s in out), None)
        w = out[name]
        if scale is None or w.dim() != 2:
            raise VisionCheckpointError(
                f"vision tower: fp8 tensor {name} {tuple(w.shape)} needs a 2-D weight and a scale "
                f"({name}_scale_inv or {name}_scale)"
            )
        rows, cols = w.shape
        s = scale.float()
        if s.numel() == 1:
            out[name] = w.float() * s.reshape(())
        elif s.numel() == rows and (s.dim() == 1 or s.shape[-1] == 1):
            out[name] = w.float() * s.reshape(rows, 1)
        elif block and s.shape == (-(-rows // block[0]), -(-cols // block[1])):
            out[name] = dequantize_block(w, s, block)
        else:
            raise VisionCheckpointError(
                f"vision tower: scale of {name} has shape {tuple(s.shape)} for a weight "
                f"{tuple(w.shape)} (expected one value, one per row, or one per {block} tile)"
            )
    return out


@torch.no_grad()
def load_into(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into `module`'s parameters (converting dtype); exact key and shape match."""
    params = dict(module.named_parameters())
    missing = set(params) - set(tensors)
    unexpected = set(tensors) - set(params)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_shorten(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_shorten(unexpected)}")
        raise VisionCheckpointError(
            "vision tower weights do not match the config; " + "; ".join(parts)
        )
    for name, param in params.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise VisionCheckpointError(
                f"vision tower weight {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.copy_(tensor)
