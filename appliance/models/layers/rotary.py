"""Rotary embedding module: holds inv_freq and the M-RoPE channel map; shared by the model's layers
and the MTP draft (one instance per model)."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.rope_scaling import RopeScaling, scaled_inv_freq
from appliance_kernels.rotary import mrope_channel_rows, rotary_cos_sin


class Rotary(nn.Module):
    def __init__(
        self,
        head_dim: int,
        partial_factor: float,
        theta: float,
        mrope_section: list[int] | None,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_factor)
        inv_freq, self.attention_factor = scaled_inv_freq(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        rows = mrope_channel_rows(self.rotary_dim // 2, mrope_section)
        self.register_buffer("channel_rows", rows, persistent=False)
        self.is_mrope = mrope_section is not None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] or [3, T] -> cos, sin [T, rotary_dim] fp32 (YaRN: scaled by its
        attention factor, as transformers does)."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.channel_rows)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin
