"""The fused GDN gates (decay g, write strength beta) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu, randn
from tolerances import assert_close

from appliance_kernels.gdn_gate import gdn_gating, gdn_gating_ref, gdn_gating_triton


def _inputs(rows: int, heads: int, dtype: torch.dtype, seed: int):
    # a and b are columns of one wider projection output: strided rows, as in the layer
    proj = randn(rows, 3 * heads + 5, dtype=dtype, seed=seed) * 8
    proj[:, heads] = 30.0  # softplus's linear branch (x > 20) too
    a, b = proj[:, heads : 2 * heads], proj[:, 2 * heads + 5 :]
    A_log = randn(heads, seed=seed + 1).abs().log().to(dtype)
    dt_bias = randn(heads, seed=seed + 2).to(dtype)
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads", [(1, 6), (9, 48), (4, 20)])
def test_gdn_gating_matches_reference(rows, heads, dtype):
    args = _inputs(rows, heads, dtype, seed=rows + heads)
    g, beta = gdn_gating_triton(*args)
    g_ref, beta_ref = gdn_gating_ref(*args)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert (args[0].float() + args[3].float() > 20).any()  # the linear branch of softplus ran
    assert_close(g, g_ref, torch.float32)
    assert_close(beta, beta_ref, dtype)


def test_dispatcher_matches_reference():
    args = _inputs(3, 8, torch.float32, seed=1)
    for got, ref in zip(gdn_gating(*args), gdn_gating_ref(*args)):
        assert_close(got, ref, torch.float32)


@gpu
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_full_size_qwen35_27b(tokens):
    args = [t.cuda() for t in _inputs(tokens, 48, torch.bfloat16, seed=3)]
    for got, ref in zip(gdn_gating(*args), gdn_gating_ref(*args)):
        assert_close(got, ref, got.dtype)
