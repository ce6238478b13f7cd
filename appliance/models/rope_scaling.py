"""RoPE scaling from a config's `rope_parameters` / `rope_scaling`: "default", "linear" and "yarn"
(what Qwen documents for contexts past the pretrained length), as transformers computes them.

Read by `load_text_config` (config.py) and the rotary layer (layers/rotary.py). Any other
`rope_type` ("dynamic", "longrope", "llama3" ...) is refused with a ValueError naming it, rather
than served as plain RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" | "yarn"
    factor: float
    original_max_position_embeddings: int  # yarn: the pretrained context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def max_context(self, max_position_embeddings: int) -> int:
        """The context the scaling serves, as vLLM derives it: yarn stretches the pretrained
        length by `factor`, linear stretches max_position_embeddings."""
        base = (
            self.original_max_position_embeddings
            if self.rope_type == "yarn"
            else max_position_embeddings
        )
        return int(base * self.factor)


def parse_rope_scaling(rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
    """None for plain RoPE; ValueError for a type or a factor this server does not apply."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type in ("default", "mrope"):  # Qwen2-VL's configs spell M-RoPE as a type
        return None
    if rope_type not in SUPPORTED:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":  # transformers: the ratio of the two lengths
        factor = max_position_embeddings / original
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"rope {rope_type}: factor must be a number >= 1, got {factor!r}")

    def number(key: str, default: float | None) -> float | None:
        value = rope.get(key)
        return default if not value else float(value)  # 0 or null: the default (transformers)

    return RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast", 32.0),
        beta_slow=number("beta_slow", 1.0),
        attention_factor=number("attention_factor", None),
        mscale=number("mscale", None),
        mscale_all_dim=number("mscale_all_dim", None),
        truncate=bool(rope.get("truncate", True)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The rotary channel whose wavelength fits `rotations` turns into `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def scaled_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """Per-channel inverse frequencies [rotary_dim / 2] fp32 and the factor cos and sin are
    multiplied by (YaRN's attention temperature; 1.0 otherwise)."""
    wavelengths = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    base = 1.0 / wavelengths
    if scaling is None:
        return base, 1.0
    if scaling.rope_type == "linear":
        return base / scaling.factor, 1.0
    # yarn: high-frequency channels keep their frequency (extrapolate), low-frequency ones are
    # divided by the factor (interpolate), with a linear ramp between the correction bounds
    ctx = scaling.original_max_position_embeddings
    low = _correction_dim(scaling.beta_fast, rotary_dim, theta, ctx)
    high = _correction_dim(scaling.beta_slow, rotary_dim, theta, ctx)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = 1.0 / (scaling.factor * wavelengths) * (1 - keep) + base * keep
    factor = scaling.attention_factor
    if factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            factor = _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
                scaling.factor, scaling.mscale_all_dim
            )
        else:
            factor = _yarn_mscale(scaling.factor)
    return inv_freq, float(factor)
