"""The loader's side of fp8 checkpoints: scale tensors (`<weight>_scale_inv` in Qwen / DeepSeek
block checkpoints, `<weight>_scale` in compressed-tensors ones) follow their weight's name mapping
onto the layer's `<param>_scale`; every fp8 tensor must come with a scale; layers finish (online
quantization) once all tensors are in. Called by appliance/models/loader.py."""

from __future__ import annotations

from torch import nn

from kernels.fp8 import FP8_DTYPE

SCALE_SUFFIXES = ("_scale_inv", "_scale")


def map_with_scales(model: nn.Module, name: str) -> tuple[str, object] | None:
    """model.map_weight_name, extended to scale tensors: `x.weight_scale_inv` maps like `x.weight`
    onto `<its parameter>_scale` with the same shard id."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix) and not name.endswith("input_scale"):
            mapped = model.map_weight_name(name[: -len(suffix)])
            if mapped is None:
                return None
            return f"{mapped[0]}_scale", mapped[1]
    return model.map_weight_name(name)


class ScaleCheck:
    """Records the fp8 tensors and the scales a checkpoint holds; `first_missing` names the first
    fp8 tensor (in name order) that has no scale."""

    def __init__(self) -> None:
        self.fp8: set[str] = set()
        self.scales: set[str] = set()

    def see(self, name: str, dtype) -> None:
        if dtype == FP8_DTYPE:
            self.fp8.add(name)
        elif name.endswith(SCALE_SUFFIXES):
            self.scales.add(name)

    def first_missing(self) -> str | None:
        for name in sorted(self.fp8):
            if not any(name + suffix in self.scales for suffix in SCALE_SUFFIXES):
                return name
        return None


def finish_loading(model: nn.Module) -> None:
    """Let each layer post-process its loaded weights (online fp8: quantise them)."""
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()
