"""Rotary embedding (partial rotary, interleaved M-RoPE tables) against the torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close

from appliance_kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    apply_rotary_triton,
    inv_freq,
    mrope_channel_rows,
    rotary_cos_sin,
    rotary_cos_sin_ref,
    rotary_cos_sin_triton,
)


def tables(num_tokens, rot_dim, mrope_section, seed):
    freqs = inv_freq(rot_dim, 1e7).to(DEVICE)
    if mrope_section is None:
        gen = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, 70000, (num_tokens,), generator=gen)
        rows = None
    else:
        gen = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, 5000, (3, num_tokens), generator=gen)
        rows = mrope_channel_rows(rot_dim // 2, mrope_section)
    return positions.to(DEVICE), freqs, rows


@pytest.mark.parametrize("mrope_section", [None, [2, 3, 3], [11, 11, 10]])
def test_cos_sin_tables_match_reference(mrope_section):
    rot = 64 if mrope_section == [11, 11, 10] else 16
    positions, freqs, rows = tables(9, rot, mrope_section, seed=1)
    expected = rotary_cos_sin_ref(positions, freqs, rows)
    got = rotary_cos_sin_triton(positions, freqs, rows)
    for g, e in zip(got, expected, strict=True):
        # positions up to 7e4 rad: fp32 argument reduction differs by a few ulp between libraries
        torch.testing.assert_close(g, e, atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot_dim", [(32, 8), (24, 24), (40, 16)])
def test_apply_rotary_matches_reference(head_dim, rot_dim, dtype):
    heads = 3
    wide = randn(6, heads * head_dim * 2, dtype=dtype, seed=head_dim)
    x = wide[:, heads * head_dim :].view(6, heads, head_dim)  # the k half of a fused projection
    positions, freqs, rows = tables(6, rot_dim, None, seed=2)
    cos, sin = rotary_cos_sin_ref(positions, freqs, rows)
    expected = apply_rotary_ref(x, cos, sin)
    got = apply_rotary_triton(x, cos, sin)
    assert_close(got, expected, dtype, name="rotary")
    assert torch.equal(got[..., rot_dim:], x[..., rot_dim:])  # pass-through dims untouched


def test_dispatchers_match_references():
    positions, freqs, rows = tables(5, 16, [2, 3, 3], seed=3)
    cos, sin = rotary_cos_sin(positions, freqs, rows)
    ref_cos, ref_sin = rotary_cos_sin_ref(positions, freqs, rows)
    torch.testing.assert_close(cos, ref_cos, atol=2e-4, rtol=0)
    x = randn(5, 2, 32, seed=4)
    assert_close(
        apply_rotary(x, ref_cos, ref_sin), apply_rotary_ref(x, ref_cos, ref_sin), torch.float32
    )


@gpu
@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_full_size_qwen35_27b(tokens):
    positions, freqs, rows = tables(tokens, 64, [11, 11, 10], seed=5)
    cos, sin = rotary_cos_sin(positions, freqs, rows)
    ref_cos, ref_sin = rotary_cos_sin_ref(positions, freqs, rows)
    torch.testing.assert_close(cos, ref_cos, atol=2e-4, rtol=0)
    q = randn(tokens, 24, 512, dtype=torch.bfloat16, seed=6)[:, :, :256]  # q half of q+gate
    assert_close(
        apply_rotary(q, ref_cos, ref_sin), apply_rotary_ref(q, ref_cos, ref_sin), torch.bfloat16
    )
