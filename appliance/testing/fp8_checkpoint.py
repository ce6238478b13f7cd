"""Rewrite a tiny bf16/fp32 checkpoint (tiny.py, tiny_vl.py) into the fp8 layouts users have, plus
the same model with the dequantised weights (the comparison model of the tests).

- "fp8": Qwen's "-FP8" repos (DeepSeek-V3 style): e4m3 `weight` + fp32 `weight_scale_inv` per
  [block_n, block_k] tile; `quantization_config = {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size, modules_to_not_convert: [...]}` listing every
  linear kept in bf16 by name (GDN in_proj_a/b, routers, shared-expert gates, lm_head, vision).
- "compressed-tensors": llm-compressor FP8_DYNAMIC: e4m3 `weight` + `weight_scale` [out, 1] per
  channel, one config group (static symmetric float8 channel weights, dynamic per-token
  activations) and an `ignore` list of names and `re:` patterns.
- "modelopt": NVIDIA ModelOpt FP8: e4m3 `weight` + `weight_scale` [] per tensor + calibrated
  `input_scale` [] (`quant_algo: FP8`; `scales="channel"`: FP8_PER_CHANNEL_PER_TOKEN, dynamic),
  `exclude_modules` as shell wildcards (MODELOPT_EXCLUDE), in config.json or, with
  `modelopt_file=True`, in `hf_quant_config.json` as older exports ship it.
- `scales="tensor"`: one scale per weight tensor instead ("fp8": AutoFP8 / vLLM-exported
  checkpoints, `weight_scale` [] and no `weight_block_size`; "compressed-tensors": weight strategy
  tensor, `weight_scale` [1]). `activations="static"`: calibrated per-tensor `input_scale`s beside
  every quantised weight (`activation_scheme: static`; llm-compressor's FP8 scheme).
  "compressed-tensors" with `scales="block"`: llm-compressor's FP8_BLOCK (`weight_scale` per
  [block_n, block_k] tile, `block_structure`, dynamic activations per group of block_k).
Fused experts get `gate_up_proj_scale_inv` [E, 2I/bn, H/bk] / `gate_up_proj_scale` [E, 2I, 1]
(per tensor [E]; static `gate_up_proj_input_scale` [E]); `expert_layout="per_expert"` splits them
into `experts.{e}.{gate,up,down}_proj.weight` first.
`add_kv_cache_scales` adds per-layer KV-cache scales under the names checkpoints use.
Called by tests/models/test_fp8_checkpoints.py and tests/appliance/engine/test_kv_cache_fp8.py.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.testing.tiny import fuse_experts, split_experts
from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.fp8_block import dequantize_block, quantize_block_ref

LAYOUTS = ("fp8", "compressed-tensors", "modelopt")
# scale schemes per layout (the first is the default)
SCALES = {
    "fp8": ("block", "tensor"),
    "compressed-tensors": ("channel", "tensor", "block"),
    "modelopt": ("tensor", "channel"),
}
MODELOPT_EXCLUDE = [
    "lm_head",
    "*.mlp.gate",
    "*shared_expert_gate",
    "*linear_attn.in_proj_a",
    "*linear_attn.in_proj_b",
    "model.visual*",
]
ACTIVATIONS = ("dynamic", "static")
# what Qwen's fp8 repos keep in bf16 (matched on the module name)
QWEN_KEEP = re.compile(
    r"(^lm_head$|embed_tokens$|visual\.|\.in_proj_[ab]$|\.mlp\.gate$|\.shared_expert_gate$)"
)
COMPRESSED_IGNORE = [
    "lm_head",
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "re:.*linear_attn.*",
    "re:.*visual.*",
]
_FUSED = (".experts.gate_up_proj", ".experts.down_proj")


def _read(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    if name.endswith(_FUSED):
        return True
    embedding = "embed_tokens" in name or "pos_embed" in name
    return name.endswith(".weight") and tensor.dim() == 2 and not embedding


def _kept(name: str, layout: str, ignore: list[str], visual: bool = False) -> bool:
    """Whether the linear `name` stays unquantised (`visual`: the vision tower is quantised)."""
    module = name.removesuffix(".weight")
    if visual and "visual." in module:
        return False
    if layout == "fp8":
        return QWEN_KEEP.search(module) is not None
    if layout == "modelopt":
        return any(fnmatch.fnmatchcase(module, p) for p in MODELOPT_EXCLUDE)
    for pattern in ignore:
        hit = re.match(pattern[3:], module) if pattern.startswith("re:") else module == pattern
        if hit:
            return True
    return False


def _quantize(w: torch.Tensor, scales: str, block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] or fused [E, N, K] -> (e4m3, scale) in the scheme's scale shape."""
    if w.dim() == 3:
        parts = [_quantize(w[e], scales, block) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    if scales == "block":
        return quantize_block_ref(w.float(), block)
    if scales == "tensor":
        return per_tensor_quant_ref(w.float())  # [1]
    return per_token_quant_ref(w.float())  # one scale per output channel: [N, 1]


def _dequantize(q: torch.Tensor, scale: torch.Tensor, scales: str, block) -> torch.Tensor:
    if scales == "block":
        return dequantize_block(q, scale, block)
    if scales == "tensor" and q.dim() == 3:
        return q.float() * scale.float().reshape(-1, 1, 1)
    return q.float() * scale.float()


def _scalar(value: torch.Tensor, layout: str) -> torch.Tensor:
    """One per-tensor value as the layout stores it: [1] (compressed-tensors) or []."""
    return value.float().reshape(1 if layout == "compressed-tensors" else ())


def _stored_scale(scale: torch.Tensor, layout: str, scales: str) -> torch.Tensor:
    """A per-tensor scale as checkpoints store it: [] (AutoFP8), [1] (compressed-tensors), [E]
    for fused experts."""
    if scales != "tensor":
        return scale.float()
    if scale.dim() == 2:  # fused experts: [E, 1]
        return scale.float().reshape(-1)
    return _scalar(scale, layout)


def _input_scale(name: str, w: torch.Tensor, layout: str) -> tuple[str, torch.Tensor]:
    """A calibrated-looking static activation scale for quantised weight `name` (value unused by
    the loader, checked > 0): per expert for fused experts."""
    seed = sum(name.encode()) % 7
    value = torch.tensor(0.01 * (1 + seed), dtype=torch.float32)
    if w.dim() == 3:
        return name + "_input_scale", value.expand(w.shape[0]).clone()
    return name.removesuffix(".weight") + ".input_scale", _scalar(value, layout)


def _quant_config(
    layout: str, block, kept: list[str], ignore: list[str], scales: str, activations: str
) -> dict:
    if layout == "fp8":
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": activations,
            "modules_to_not_convert": sorted(kept),
        }
        if scales == "block":
            config["weight_block_size"] = list(block)
        return config
    if layout == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "FP8" if scales == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN",
            "kv_cache_quant_algo": None,
            "exclude_modules": list(MODELOPT_EXCLUDE),
        }
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    weights = {**scheme, "strategy": scales, "dynamic": False}
    if scales == "block":  # FP8_BLOCK: activations per 1 x block_k group
        weights["block_structure"] = list(block)
    if activations == "static":
        inputs = {**scheme, "strategy": "tensor", "dynamic": False}
    elif scales == "block":
        inputs = {**scheme, "strategy": "group", "group_size": block[1], "dynamic": True}
    else:
        inputs = {**scheme, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def _copy_side_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name != "model.safetensors.index.json"
        ):
            shutil.copy(file, out / file.name)


def write_fp8_checkpoint(
    src: str | Path,
    out: str | Path,
    dequantized_out: str | Path,
    *,
    layout: str = "fp8",
    block: tuple[int, int] = (128, 128),
    expert_layout: str = "same",
    transposed_experts: bool = False,
    ignore: list[str] | None = None,
    scales: str | None = None,
    activations: str = "dynamic",
    quantize_visual: bool = False,
    modelopt_file: bool = False,
) -> Path:
    """Quantise `src` into `out` (layout "fp8" or "compressed-tensors"); write the dequantised
    weights, in the source layout and dtype fp32, to `dequantized_out`.

    scales: "block" (fp8's default), "channel" (compressed-tensors' default) or "tensor";
    activations: "dynamic" or "static" (with `input_scale`s; see the module docstring).
    quantize_visual: the vision tower's linears quantised too (the loader dequantises them).
    modelopt_file: "modelopt" only: the config in hf_quant_config.json, none in config.json.

    expert_layout: "same" (as in src), "per_expert" or "fused". transposed_experts: src holds
    Qwen3-VL-MoE's transposed fused experts ([E, H, 2I]); they are turned back first.
    ignore: the compressed-tensors `ignore` list (default COMPRESSED_IGNORE)."""
    ignore = list(COMPRESSED_IGNORE if ignore is None else ignore)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
    scales = scales or SCALES[layout][0]
    if layout == "modelopt":  # FP8: static per-tensor activations; per channel: dynamic
        activations = "static" if scales == "tensor" else "dynamic"
    if scales not in SCALES[layout] or activations not in ACTIVATIONS:
        raise ValueError(
            f"{layout}: scales={scales!r} / activations={activations!r}; expected one of "
            f"{SCALES[layout]} / {ACTIVATIONS}"
        )
    if modelopt_file and layout != "modelopt":
        raise ValueError(f"modelopt_file=True with layout {layout!r} (a ModelOpt file only)")
    src, out, deq_out = Path(src), Path(out), Path(dequantized_out)
    tensors = _read(src)
    if transposed_experts:
        tensors = {
            k: v.transpose(1, 2).contiguous() if k.endswith(_FUSED) else v
            for k, v in tensors.items()
        }
    if expert_layout == "per_expert":
        tensors = split_experts(tensors)
    elif expert_layout == "fused":
        tensors = fuse_experts(tensors)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, w in sorted(tensors.items()):
        if not _is_linear(name, w) or _kept(name, layout, ignore, quantize_visual):
            if _is_linear(name, w):
                kept.append(name.removesuffix(".weight"))
            quantized[name] = dequantized[name] = w.float()
            continue
        q, scale = _quantize(w, scales, block)
        quantized[name] = q
        suffix = "_scale_inv" if layout == "fp8" and scales == "block" else "_scale"
        quantized[name + suffix] = _stored_scale(scale, layout, scales)
        dequantized[name] = _dequantize(q, scale, scales, block)
        if activations == "static":
            key, value = _input_scale(name, w, layout)
            quantized[key] = value
    for folder, state in ((out, quantized), (deq_out, dequantized)):
        _copy_side_files(src, folder)
        save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    quant = _quant_config(layout, block, kept, ignore, scales, activations)
    if modelopt_file:
        producer = {"name": "modelopt", "version": "0.29.0"}
        hf_quant = {
            "producer": producer,
            "quantization": {k: v for k, v in quant.items() if k != "quant_method"},
        }
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    else:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


KV_SCALE_NAMINGS = {  # how checkpoints name a full-attention layer's KV-cache scales
    "k_scale": (".self_attn.k_scale", ".self_attn.v_scale"),  # llm-compressor kv_cache_scheme
    "attn.k_scale": (".self_attn.attn.k_scale", ".self_attn.attn.v_scale"),  # vLLM module names
    "kv_scale": (".self_attn.kv_scale",),  # AutoFP8 / older vLLM: one scale for both
    "output_scale": (".self_attn.k_proj.output_scale", ".self_attn.v_proj.output_scale"),  # Quark
    "proj.k_scale": (".self_attn.k_proj.k_scale", ".self_attn.v_proj.v_scale"),  # ModelOpt
}
KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}


def add_kv_cache_scales(
    ckpt: str | Path, scales: dict[str, tuple[float, float]], naming: str = "k_scale"
) -> dict[str, tuple[float, float]]:
    """Adds per-layer KV-cache scales to the checkpoint in `ckpt` (in place), as quantised
    checkpoints carry them. `scales` maps a full-attention layer's checkpoint prefix (the name
    before `.self_attn`, e.g. `model.language_model.layers.3` or `mtp.layers.0`) to (k, v); the
    "kv_scale" naming writes one value (k) for both. A compressed-tensors config gets its
    `kv_cache_scheme`. Returns what the loader should find per prefix: (k, v)."""
    if naming not in KV_SCALE_NAMINGS:
        raise ValueError(f"naming={naming!r}: expected one of {', '.join(KV_SCALE_NAMINGS)}")
    ckpt = Path(ckpt)
    tensors = _read(ckpt)
    expected = {}
    for prefix, (k, v) in scales.items():
        if f"{prefix}.self_attn.k_proj.weight" not in tensors:
            raise ValueError(f"{prefix} is not a full-attention layer of {ckpt}")
        values = (k,) if naming == "kv_scale" else (k, v)
        for suffix, value in zip(KV_SCALE_NAMINGS[naming], values):
            tensors[prefix + suffix] = torch.tensor(value, dtype=torch.float32)
        if naming == "attn.k_scale":  # vLLM-exported fp8-attention checkpoints also carry these
            tensors[prefix + ".self_attn.attn.q_scale"] = torch.tensor(1.0)
            tensors[prefix + ".self_attn.attn.prob_scale"] = torch.tensor(1.0)
        expected[prefix] = (k, k) if naming == "kv_scale" else (k, v)
    for file in ckpt.glob("*.safetensors"):
        file.unlink()
    (ckpt / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(ckpt / "model.safetensors"), {"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "compressed-tensors":
        quant["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    if quant.get("quant_method") == "modelopt":
        quant["kv_cache_quant_algo"] = "FP8"
    (ckpt / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return expected


def attention_prefixes(ckpt: str | Path) -> list[str]:
    """Checkpoint prefixes of the full-attention layers (main model and MTP head)."""
    suffix = ".self_attn.k_proj.weight"
    return sorted(n.removesuffix(suffix) for n in _read(Path(ckpt)) if n.endswith(suffix))
