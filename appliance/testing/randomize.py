"""Deterministic re-initialisation of HF models so they make useful test oracles (models.md §7.2).

Called by `appliance.testing.tiny` (text checkpoints) and the vision tests (Qwen3-VL / Qwen3.5 ViT).
HF's default init gives near-uniform logits and zero norm weights; this redraws every parameter
from one seeded generator in sorted-name order: logits of std ~ 1, `(1 + w)` vs `w` norms exercised.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# RMSNorm classes whose weight is used as (1 + w) and initialised to 0 by HF.
ZERO_CENTRED_NORMS = frozenset(
    {
        "Qwen3_5RMSNorm",
        "Qwen3_5MoeRMSNorm",
        "Qwen3NextRMSNorm",
    }
)


class UnknownParameterError(ValueError):
    """A parameter that the §7.2 recipe does not cover (so a silent default would hide it)."""


def _is_zero_centred(module: nn.Module) -> bool:
    name = type(module).__name__
    return name in ZERO_CENTRED_NORMS and not name.endswith("Gated")


def _is_rmsnorm(module: nn.Module) -> bool:
    name = type(module).__name__
    return "RMSNorm" in name or isinstance(module, getattr(nn, "RMSNorm", ()))


def _fan_in(module: nn.Module, shape: torch.Size) -> int:
    if isinstance(module, nn.modules.conv._ConvNd):
        return math.prod(shape[1:])  # [out, in/groups, *kernel]
    return int(shape[-1])  # linear [out, in]; fused experts [E, out, in]


def _draw(
    module: nn.Module, local: str, full_name: str, param: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    shape = param.shape

    def normal() -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    if local == "A_log":
        uniform = torch.rand(shape, generator=gen, dtype=torch.float32)
        return torch.log(1.0 + 15.0 * uniform)  # log U(1, 16)
    if local == "dt_bias":
        return 0.5 * normal()
    if isinstance(module, nn.LayerNorm):
        if local == "weight":
            return 1.0 + 0.1 * normal()
        if local == "bias":
            return 0.1 * normal()
    if _is_rmsnorm(module) and local == "weight":
        if _is_zero_centred(module):
            return 0.2 * normal()
        return 1.0 + 0.2 * normal()
    if local == "bias" or local.endswith("_bias"):
        return 0.1 * normal()
    if isinstance(module, nn.Embedding):
        return normal()
    if param.dim() >= 2:
        return normal() / math.sqrt(_fan_in(module, shape))
    raise UnknownParameterError(
        f"randomize_: no rule for parameter {full_name!r} of {type(module).__name__} {tuple(shape)}"
    )


@torch.no_grad()
def randomize_(model: nn.Module, seed: int) -> None:
    """Redraw every parameter of `model` in place, deterministically for a given `seed`.

    Parameters are visited in sorted-name order with one `torch.Generator`, so the result depends
    only on the parameter names, shapes and owning module classes, not on construction order. Tied
    parameters are drawn once (under their first name).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # de-duplicates tied parameters
    for full_name in sorted(params):
        param = params[full_name]
        owner_name, _, local = full_name.rpartition(".")
        module = modules[owner_name]
        value = _draw(module, local, full_name, param, gen)  # fp32, same shape
        param.copy_(value.to(dtype=param.dtype, device=param.device))
