"""The decode-size MoE (appliance_kernels/moe_gemv.py: one program per (token, slot) pair) against
the references: bf16 / fp32 and fp8 experts, the shared expert, sizes not multiples of its blocks,
the dispatch from fused_moe_triton, and its limit."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import randn
from test_moe import moe_inputs, quant_experts
from tolerances import FP8_REL_ERROR, assert_close, rel_error

import appliance_kernels.moe_triton as moe_triton
from appliance_kernels.moe import fused_moe_fp8_ref, fused_moe_ref
from appliance_kernels.moe_gemv import GEMV_MAX_ROWS, fused_moe_gemv
from appliance_kernels.moe_triton import fused_moe_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden,inter", [(1, 2, 32, 16), (2, 8, 200, 48)])
def test_gemv_matches_reference(tokens, top_k, hidden, inter, dtype):
    args = moe_inputs(tokens, 16, top_k, hidden, inter, dtype, seed=tokens + top_k)
    expected = fused_moe_ref(*args)
    assert_close(fused_moe_gemv(*args), expected, dtype, factor=2.0, name="gemv")
    assert_close(fused_moe_triton(*args), expected, dtype, factor=2.0, name="dispatched")


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_experts_dequantised_as_read(per_channel):
    x, w1, w2, weights, ids = moe_inputs(2, 4, 3, 160, 40, torch.bfloat16, seed=5)
    w1_q, w1_s = quant_experts(w1.float(), per_channel)
    w2_q, w2_s = quant_experts(w2.float(), per_channel)
    expected = fused_moe_fp8_ref(x, w1_q, w1_s, w2_q, w2_s, weights, ids)
    got = fused_moe_gemv(x, w1_q, w2_q, weights, ids, w_gate_up_scale=w1_s, w_down_scale=w2_s)
    assert rel_error(got, expected) < FP8_REL_ERROR / 4  # no activation quantisation here


def test_shared_expert_and_limits():
    x, w1, w2, weights, ids = moe_inputs(2, 4, 2, 32, 16, torch.float32, seed=8)
    shared = randn(2, 32, seed=9)
    gate = randn(2, 1, seed=10)
    expected = fused_moe_ref(x, w1, w2, weights, ids) + torch.sigmoid(gate) * shared
    got = fused_moe_gemv(x, w1, w2, weights, ids, shared_output=shared, shared_gate=gate)
    assert_close(got, expected, torch.float32, name="gemv + shared")
    many = moe_inputs(GEMV_MAX_ROWS // 2 + 1, 4, 2, 32, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="rows"):
        fused_moe_gemv(*many)
    with pytest.raises(ValueError, match="both weight scales"):
        fused_moe_gemv(x, w1, w2, weights, ids, w_gate_up_scale=torch.ones(4))


def test_dispatch_follows_the_pair_limit(monkeypatch):
    """fused_moe_triton runs the per-pair kernels up to GEMV_MAX_ROWS (token, slot) pairs and the
    grouped GEMMs above, wherever the limit is set (bench_static.py --moe-pairs moves it)."""
    calls = []
    for name in ("fused_moe_gemv", "fused_moe_grouped"):
        monkeypatch.setattr(moe_triton, name, lambda *a, _n=name, **k: calls.append(_n))
    for limit in (GEMV_MAX_ROWS, 6):
        monkeypatch.setattr(moe_triton.moe_gemv, "GEMV_MAX_ROWS", limit)
        for tokens in (1, limit // 2, limit // 2 + 1):  # top 2: 2, limit (or limit - 1), > limit
            calls.clear()
            fused_moe_triton(*moe_inputs(tokens, 4, 2, 32, 16, torch.float32, seed=tokens))
            per_pair = tokens * 2 <= limit
            assert calls == ["fused_moe_gemv" if per_pair else "fused_moe_grouped"], (limit, tokens)
