"""Rotary position embedding: partial rotary (first `rotary_dim` dims, rotate-half layout) and
interleaved M-RoPE (3 position rows T/H/W). Called by appliance/models/layers/rotary.py."""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)


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
        rows = (
            channel_rows
            if channel_rows is not None
            else torch.zeros_like(inv_freq, dtype=torch.long)
        )
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


# -------------------------------------------------------------------------------------------------
# Triton: `apply_rotary` reads a [heads, head_dim] tile per token once and its rotate-half partner,
# rounding each product like the reference; `rotary_cos_sin` builds the (M-RoPE) tables per token.
# -------------------------------------------------------------------------------------------------


@jit
def _apply_rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    head_dim,
    rot_dim,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = rot_dim // 2
    mask = (h < num_heads)[:, None] & (d < head_dim)[None, :]
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(x_row + d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    in_rot = d < rot_dim
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(x_row + partner[None, :], mask=mask & in_rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where((d < half)[None, :], -xp, xp)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=in_rot, other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=in_rot, other=0.0).to(dtype).to(tl.float32)
    xf = x.to(tl.float32)
    y = (xf * c[None, :]).to(dtype).to(tl.float32) + (xp * s[None, :]).to(dtype).to(tl.float32)
    y = tl.where(in_rot[None, :], y, xf)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], y.to(dtype), mask=mask)


def apply_rotary_triton(
    x: torch.Tensor,  # [T, H, D] (token/head strides free)
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> torch.Tensor:
    """Same result as apply_rotary_ref; returns a new contiguous [T, H, D]."""
    check_last_dim_contiguous("x", x)
    num_tokens, num_heads, head_dim = x.shape
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim or sin.shape != cos.shape or cos.shape[0] != num_tokens:
        raise ValueError(f"rotary: x {x.shape} cos {cos.shape} sin {sin.shape}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    _apply_rotary_kernel[(num_tokens, -(-num_heads // block_h))](
        x,
        cos,
        sin,
        out,
        num_heads,
        head_dim,
        rot_dim,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
        **pdl(x),
    )
    return out


@jit
def _rotary_cos_sin_kernel(
    pos_ptr,
    inv_freq_ptr,
    rows_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    half,
    stride_pr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
    MROPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_F)
    mask = (t < num_tokens)[:, None] & (j < half)[None, :]
    inv = tl.load(inv_freq_ptr + j, mask=j < half, other=0.0)
    if MROPE:
        row = tl.load(rows_ptr + j, mask=j < half, other=0)
        pos = tl.load(
            pos_ptr + row[None, :].to(tl.int64) * stride_pr + t[:, None], mask=mask, other=0
        )
    else:
        pos = tl.load(pos_ptr + t, mask=t < num_tokens, other=0)[:, None]
    freqs = pos.to(tl.float32) * inv[None, :]
    base = t.to(tl.int64)[:, None] * (2 * half) + j[None, :]
    c = tl.cos(freqs)
    s = tl.sin(freqs)
    tl.store(cos_ptr + base, c, mask=mask)
    tl.store(cos_ptr + base + half, c, mask=mask)
    tl.store(sin_ptr + base, s, mask=mask)
    tl.store(sin_ptr + base + half, s, mask=mask)


def rotary_cos_sin_triton(
    positions: torch.Tensor,  # [T] or [3, T]
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    channel_rows: torch.Tensor | None = None,  # [rotary_dim / 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as rotary_cos_sin_ref: fp32 cos, sin [T, rotary_dim]."""
    half = inv_freq.shape[0]
    mrope = positions.dim() == 2
    num_tokens = positions.shape[-1]
    if mrope and positions.stride(1) != 1:
        raise ValueError("rotary_cos_sin: position rows must be contiguous")
    cos = torch.empty(num_tokens, 2 * half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens == 0:
        return cos, sin
    if mrope and channel_rows is None:
        channel_rows = torch.zeros(half, dtype=torch.long)
    rows = channel_rows.to(positions.device) if mrope else inv_freq
    block_f = next_pow2(half)
    block_t = max(1, min(64, 2048 // block_f))
    _rotary_cos_sin_kernel[(-(-num_tokens // block_t),)](
        positions,
        inv_freq,
        rows,
        cos,
        sin,
        num_tokens,
        half,
        positions.stride(0) if mrope else 0,
        BLOCK_T=block_t,
        BLOCK_F=block_f,
        MROPE=mrope,
        **pdl(positions),
    )
    return cos, sin


def apply_rotary(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> torch.Tensor:
    """Dispatcher used by the model layers: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        return apply_rotary_triton(x, cos, sin)
    return apply_rotary_ref(x, cos, sin)


def rotary_cos_sin(
    positions: torch.Tensor,  # [T] or [3, T]
    inv_freq: torch.Tensor,  # [rotary_dim / 2]
    channel_rows: torch.Tensor | None = None,  # [rotary_dim / 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher used by the rotary layer: Triton on CUDA, the reference elsewhere."""
    if use_triton(positions):
        return rotary_cos_sin_triton(positions, inv_freq.to(positions.device), channel_rows)
    return rotary_cos_sin_ref(positions, inv_freq, channel_rows)
