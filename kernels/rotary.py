"""Rotary position embedding: partial rotary (first `rotary_dim` dims, rotate-half layout) and
interleaved M-RoPE (3 position rows T/H/W). Called by appliance/models/layers/rotary.py."""

from __future__ import annotations

import torch


def inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def mrope_channel_rows(half_dim: int, mrope_section: list[int] | None) -> torch.Tensor:
    """For each of the rotary_dim/2 frequency channels, which position row (0=T, 1=H, 2=W) drives it
    under the interleaved layout: channel j is H if j%3==1 and j<3*s_h, W if j%3==2 and j<3*s_w."""
    rows = torch.zeros(half_dim, dtype=torch.long)
    if mrope_section is None:
        return rows
    for row, offset in ((1, 1), (2, 2)):
        limit = 3 * mrope_section[row]
        rows[offset:limit:3] = row
    return rows


def rotary_cos_sin_ref(
    positions: torch.Tensor,  # [T] or [3, T] (M-RoPE rows T, H, W)
    inv_freq: torch.Tensor,  # [rotary_dim / 2]
    channel_rows: torch.Tensor | None = None,  # [rotary_dim / 2] from mrope_channel_rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns cos, sin of shape [T, rotary_dim] (fp32), halves duplicated (rotate-half layout)."""
    if positions.dim() == 1:
        freqs = positions.float()[:, None] * inv_freq[None, :]
    else:
        all_rows = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, half]
        rows = channel_rows if channel_rows is not None else torch.zeros_like(inv_freq, dtype=torch.long)
        index = rows.to(positions.device)[None, None, :].expand(1, positions.shape[1], -1)
        freqs = all_rows.gather(0, index)[0]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary_ref(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> torch.Tensor:
    """Rotates the first rotary_dim dims of every head; the rest pass through."""
    rot = cos.shape[-1]
    c = cos[:, None, :].to(x.dtype)
    s = sin[:, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * c + _rotate_half(x_rot) * s
    return torch.cat([out, x_pass], dim=-1)
