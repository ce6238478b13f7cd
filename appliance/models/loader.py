"""Weight loading: safetensors (single file or sharded index) in the real Hub layouts, or `dummy`
random weights for any config. Each parameter's own `weight_loader` cuts its TP shard.

A checkpoint that does not match the model raises `CheckpointMismatch` naming missing/unexpected
keys."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from appliance.logging import get_logger
from appliance.models.layers.linear import unloaded_segments
from appliance.models.layers.quant import QuantConfig
from appliance.models.quant_weights import (
    InputScales,
    KVScaleLoader,
    ScaleCheck,
    finish_loading,
    map_with_scales,
)
from appliance.progress import Progress
from appliance_kernels.fp8 import FP8_DTYPE

log = get_logger(__name__)
_SAFETENSORS_FP8 = "F8_E4M3"  # the header's dtype of torch.float8_e4m3fn


class CheckpointMismatch(ValueError):
    pass


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    return files


def iter_tensors(model_dir: str | Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor whose name starts with `prefix`, with progress on rank 0 (a bar on
    a TTY, a line every few seconds otherwise; nothing when loading takes under a second)."""
    wanted = []  # (file, names in it): safetensors headers are cheap to read twice
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            wanted.append((path, [n for n in f.keys() if n.startswith(prefix)]))
    total = sum(len(names) for _, names in wanted)
    desc = f"loading {prefix}* weights" if prefix else "loading weights"
    with Progress(desc, total, "tensors", enabled=_first_rank()) as bar:
        for path, names in wanted:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)
                    bar.update()


def unscaled_fp8_problem(model_dir: str | Path) -> str | None:
    """The first fp8 tensor (in name order) that has no scale beside it, as load_weights would
    name it, read from the safetensors headers alone (no tensor data): a preflight before any
    process loads anything. None when every fp8 tensor has one, or there is no checkpoint file."""
    try:
        files = checkpoint_files(model_dir)
    except (FileNotFoundError, OSError, ValueError, KeyError):
        return None  # the worker's load says what is wrong with the folder
    check = ScaleCheck()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                fp8 = f.get_slice(name).get_dtype() == _SAFETENSORS_FP8
                check.see(name, FP8_DTYPE if fp8 else None)
    name = check.first_missing()
    return None if name is None else ScaleCheck.message(name)


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _short_list(names: list[str], limit: int = 12) -> str:
    extra = f" … (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + extra


def load_weights(
    model: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    tied: dict[str, str] | None = None,
    quant: QuantConfig | None = None,
) -> None:
    """Feed checkpoint tensors through `model.map_weight_name` and each parameter's weight_loader.

    `tied` maps a parameter that may be absent from the checkpoint to the one it copies
    (e.g. lm_head.weight -> model.embed_tokens.weight with tie_word_embeddings). fp8 scale
    tensors load beside their weights (quant_weights.py); an fp8 tensor without one is refused.
    KV-cache scales (`self_attn.k_scale` ...) go to their attention layer (1.0 where absent);
    static activation scales are checked and read past where `quant` says the checkpoint has them
    (quant_weights.InputScales)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    scales = ScaleCheck()
    kv_scales = KVScaleLoader(model)
    input_scales = InputScales(model, params, quant is not None and quant.static_inputs)
    for name, tensor in tensors:
        try:
            if kv_scales.take(name, tensor) or input_scales.take(name, tensor):
                continue
        except ValueError as err:
            raise CheckpointMismatch(str(err)) from err
        mapped = map_with_scales(model, name)
        if mapped is None:
            continue
        scales.see(name, tensor.dtype)
        pname, shard_id = mapped
        param = params.get(pname)
        if param is None:
            unexpected.append(name)
            continue
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as err:
            raise CheckpointMismatch(f"{name}: {err}") from err
        loaded.add(pname)
    if (name := scales.first_missing()) is not None:
        raise CheckpointMismatch(ScaleCheck.message(name))
    for dst, src in (tied or {}).items():
        if dst not in loaded and src in loaded:
            with torch.no_grad():
                params[dst].copy_(params[src])
            loaded.add(dst)
    unexpected += kv_scales.stray
    missing = [p for p in params if p not in loaded]
    missing += [s for p in sorted(loaded) for s in unloaded_segments(p, params[p])]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_short_list(unexpected)}")
        raise CheckpointMismatch("checkpoint does not match the model; " + "; ".join(parts))
    kv_scales.apply()
    input_scales.report(log)
    finish_loading(model)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights with sane magnitudes for performance work (`--load-format dummy`), drawn on
    the parameters' own device (a 27B model would take minutes through the host)."""
    for i, (name, param) in enumerate(sorted(model.named_parameters())):
        gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + i)
        with torch.no_grad():
            shape = param.shape
            values = torch.empty(shape, dtype=torch.float32, device=param.device)
            if name.endswith("A_log"):
                values.uniform_(1.0, 16.0, generator=gen).log_()
            elif name.endswith("norm.weight") and "linear_attn" in name:
                values.fill_(1.0)  # gated norm multiplies by w directly
            elif name.endswith("_scale"):
                values.fill_(1.0)  # fp8 dequantisation scales: weights drawn at their magnitude
            elif param.dim() == 1:
                values.normal_(0.0, 0.1, generator=gen)
            else:
                values.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)
            param.copy_(values.to(param.dtype))
    finish_loading(model)
