"""The loader's side of fp8 checkpoints: scale tensors (`<weight>_scale_inv` in Qwen / DeepSeek
block checkpoints, `<weight>_scale` in compressed-tensors ones) follow their weight's name mapping
onto the layer's `<param>_scale`; every fp8 tensor must come with a scale; KV-cache scales go to
their attention layer (`KVScaleLoader`); static activation scales (`input_scale`) are checked and
read past (`InputScales`); layers finish (online quantization) once all tensors are in. Called by
appliance/models/loader.py."""

from __future__ import annotations

import re

import torch
from torch import nn

from appliance_kernels.fp8 import FP8_DTYPE

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

    @staticmethod
    def message(name: str) -> str:
        return (
            f"quantized checkpoint: fp8 tensor {name} has no scale "
            f"(expected {name}_scale_inv or {name}_scale)"
        )


class InputScales:
    """Static per-tensor activation scales (`<module>.input_scale`, fused experts'
    `<experts>.gate_up_proj_input_scale`) of checkpoints calibrated for static activations
    (AutoFP8 / `activation_scheme: static`, llm-compressor's FP8 scheme). Each must belong to a
    quantised layer of the model and be finite and >= 0 (0: never calibrated, logged); its value
    is not used: the fp8 x fp8 GEMMs quantise every token's activations with that token's own
    max (per 128-column group for block weights) and the one-row GEMV reads them unquantised,
    both at least as precise as one scale calibrated over a dataset (which exists so that a kernel
    can skip the max; here it is fused into the quantisation kernel). Only taken when the
    quantization config says static."""

    SUFFIXES = (".input_scale", "_input_scale")

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], static: bool) -> None:
        self.model, self.params, self.static = model, params, static
        self.count = 0
        self.zeros: list[str] = []  # scales of 0 (uncalibrated)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is a static activation scale of a quantised layer (consumed here)."""
        suffix = next((s for s in self.SUFFIXES if name.endswith(s)), None)
        if not self.static or suffix is None:
            return False
        base = name[: -len(suffix)]
        mapped = self.model.map_weight_name(base + (".weight" if suffix[0] == "." else ""))
        if mapped is None:  # another component's layer (the MTP head of the main model)
            return True
        if f"{mapped[0]}_scale" not in self.params:
            return False  # an unquantised layer: left to the loader's unexpected keys
        values = tensor.float().reshape(-1)
        if values.numel() == 0 or not bool(torch.isfinite(values).all() and (values >= 0).all()):
            raise ValueError(
                f"{name}: activation scale {values.tolist()} (expected finite and >= 0; > 0 "
                "once calibrated)"
            )
        if not bool((values > 0).all()):  # an expert calibration never routed to: unused anyway
            self.zeros.append(name)
        self.count += 1
        return True

    def report(self, log) -> None:
        if self.count:
            log.info(
                "fp8 checkpoint: %d static activation scales (input_scale) checked and not used: "
                "activations are quantised per token as they arrive",
                self.count,
            )
        if self.zeros:
            log.warning(
                "fp8 checkpoint: %d input_scales are 0 (layers calibration never reached, e.g. "
                "an expert no calibration token was routed to; first: %s); not used either",
                len(self.zeros),
                self.zeros[0],
            )


def finish_loading(model: nn.Module) -> None:
    """Let each layer post-process its loaded weights (online fp8: quantise them)."""
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()


# KV-cache scales as checkpoints name them: llm-compressor / compressed-tensors kv_cache_scheme
# (`self_attn.k_scale`, `v_scale`), AutoFP8 / older vLLM (`self_attn.kv_scale`, both), Quark and
# older compressed-tensors (`k_proj.output_scale`), vLLM's module names (`self_attn.attn.k_scale`),
# NVIDIA ModelOpt (`k_proj.k_scale`, `v_proj.v_scale`)
_KV_SCALE = re.compile(
    r"^(?P<attn>.*\.self_attn)\.(?:attn\.)?"
    r"(?:(?P<kv>[kv])_scale|kv_scale|(?P<proj>[kv])_proj\.(?:output_scale|(?P=proj)_scale))$"
)
# scales of fp8 attention arithmetic (vLLM's q_scale / prob_scale): attention here computes in
# the model dtype, so they are read past
_UNUSED_ATTN_SCALE = re.compile(r"^.*\.self_attn\.(?:attn\.)?(?:q_scale|prob_scale)$")


class KVScaleLoader:
    """Collects the KV-cache scales of a checkpoint and hands them to the attention layers
    (`Attention.set_kv_scales`); layers without one keep 1.0. A scale per head is reduced to its
    maximum: the cache is written here from full-precision k / v, so any scale is a valid choice
    and the largest never saturates a head the checkpoint calibrated."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.found: dict[str, dict[str, tuple[float, str]]] = {}  # module -> k/v -> (value, name)
        self.attention = {n for n, m in model.named_modules() if hasattr(m, "set_kv_scales")}
        self.stray: list[str] = []  # scales of no attention layer of the model (unexpected keys)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `name` is a KV-cache scale (consumed here, never a parameter)."""
        if _UNUSED_ATTN_SCALE.match(name):
            return True
        match = _KV_SCALE.match(name)
        if match is None:
            return False
        mapped = self.model.map_weight_name(f"{match['attn']}.k_proj.weight")
        if mapped is None:  # another component's layer (the MTP head of the main model)
            return True
        module = mapped[0].rsplit(".", 2)[0]  # `<attn>.qkv_proj.weight` or `<attn>.k_proj.weight`
        if module not in self.attention:  # a layer past the model's, or a linear-attention one
            self.stray.append(name)
            return True
        value = float(tensor.float().max()) if tensor.numel() else float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: KV-cache scale {value} (expected a finite number > 0)")
        which = match["kv"] or match["proj"]
        for kind in (which,) if which else ("k", "v"):
            self.found.setdefault(module, {})[kind] = (value, name)
        return True

    def apply(self) -> None:
        for module_name, module in self.model.named_modules():
            if not hasattr(module, "set_kv_scales"):
                continue
            got = self.found.get(module_name)
            if not got:
                continue
            values, parts = [], []
            for kind in ("k", "v"):
                value, name = got.get(kind, (1.0, f"{kind}_scale (absent, default)"))
                values.append(value)
                parts.append(f"{name}={value:g}")
            module.set_kv_scales(*values, f"checkpoint: {', '.join(parts)}")
