"""Fused residual-add + RMSNorm (ordinary and zero-centred) and the gated RMSNorm against the torch
references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu, randn
from tolerances import assert_close

from appliance_kernels.norm import (
    gated_rms_norm,
    gated_rms_norm_ref,
    gated_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_reference(hidden, with_residual, zero_centered, dtype):
    x = randn(5, hidden + 8, dtype=dtype, seed=hidden)[:, :hidden]  # strided rows
    residual = randn(5, hidden, dtype=dtype, seed=hidden + 1) if with_residual else None
    weight = randn(hidden, seed=hidden + 2, scale=0.1)  # fp32 weight, as checkpoints load
    expected, expected_res = rms_norm_ref(x, weight, 1e-6, zero_centered, residual)
    got, got_res = rms_norm_triton(x, weight, 1e-6, zero_centered, residual)
    assert_close(got, expected, dtype, name="normed")
    assert torch.equal(got_res, expected_res)  # the residual sum is exact in the activation dtype
    if not with_residual:
        assert got_res.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_reference(dtype, weight_dtype):
    x = randn(3, 4, 32, dtype=dtype, seed=1).view(12, 32)
    gate = randn(12, 48, dtype=dtype, seed=2)[:, 16:]  # strided view
    weight = (1 + randn(32, seed=3, scale=0.1)).to(weight_dtype)
    expected = gated_rms_norm_ref(x, gate, weight, 1e-6)
    got = gated_rms_norm_triton(x, gate, weight, 1e-6)
    assert got.dtype == expected.dtype
    assert_close(got, expected, dtype, name="gated")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_reads_a_per_head_gate_in_place(dtype):
    """The GDN layer's z: [tokens, heads, dim] as a strided view of a wider projection row (a
    reshape to [tokens * heads, dim] would copy it)."""
    tokens, heads, dim = 3, 4, 32
    x = randn(tokens * heads, dim, dtype=dtype, seed=11)
    projected = randn(tokens, heads * dim + 40, dtype=dtype, seed=12)  # [.. | z | ..] per row
    z = projected[:, 24 : 24 + heads * dim].reshape(tokens, heads, dim)
    assert z.data_ptr() == projected[:, 24:].data_ptr()  # a view, not a copy
    weight = 1 + randn(dim, seed=13, scale=0.1)
    expected = gated_rms_norm_ref(x, z.reshape(tokens * heads, dim), weight, 1e-6)
    assert_close(gated_rms_norm_triton(x, z, weight, 1e-6), expected, dtype, name="gated 3-D")
    assert_close(gated_rms_norm(x, z, weight, 1e-6), expected, dtype, name="dispatcher")
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_triton(x, z[:2], weight, 1e-6)


def test_dispatchers_match_references():
    x, w = randn(4, 32, seed=5), randn(32, seed=6)
    assert_close(rms_norm(x, w, 1e-6, True)[0], rms_norm_ref(x, w, 1e-6, True)[0], torch.float32)
    g = randn(4, 32, seed=7)
    assert_close(gated_rms_norm(x, g, w, 1e-6), gated_rms_norm_ref(x, g, w, 1e-6), torch.float32)


@gpu
@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_full_size_qwen35_27b(tokens):
    x = randn(tokens, 5120, dtype=torch.bfloat16, seed=1)
    res = randn(tokens, 5120, dtype=torch.bfloat16, seed=2)
    w = randn(5120, dtype=torch.bfloat16, seed=3, scale=0.1)
    for zero_centered in (True, False):
        got, got_res = rms_norm(x, w, 1e-6, zero_centered, res)
        expected, expected_res = rms_norm_ref(x, w, 1e-6, zero_centered, res)
        assert_close(got, expected, torch.bfloat16)
        assert torch.equal(got_res, expected_res)
    xg = randn(tokens * 48, 128, dtype=torch.bfloat16, seed=4)
    gate = randn(tokens * 48, 128, dtype=torch.bfloat16, seed=5)
    wg = randn(128, dtype=torch.bfloat16, seed=6)
    assert_close(
        gated_rms_norm(xg, gate, wg, 1e-6), gated_rms_norm_ref(xg, gate, wg, 1e-6), torch.bfloat16
    )
