"""Fused MoE (Triton grouped GEMMs, bf16 / fp8 weights, shared-expert gate) vs the references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import FP8_REL_ERROR, assert_close, rel_error

from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.moe import fused_moe, fused_moe_fp8_ref, fused_moe_ref, moe_route_ref
from appliance_kernels.moe_triton import fused_moe_grouped, fused_moe_triton, moe_align


def moe_inputs(tokens, experts, top_k, hidden, inter, dtype, seed):
    x = randn(tokens, hidden, dtype=dtype, seed=seed)
    w_gate_up = randn(experts, 2 * inter, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    w_down = randn(experts, hidden, inter, dtype=dtype, seed=seed + 2, scale=inter**-0.5)
    logits = randn(tokens, experts, seed=seed + 3)
    weights, ids = moe_route_ref(logits, top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


def test_align_groups_rows_by_expert_with_padding():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    sorted_rows, block_expert = moe_align(ids, num_experts=4, block_m=4)
    blocks = sorted_rows.view(-1, 4).tolist()
    experts = block_expert.tolist()
    seen = []
    for rows, expert in zip(blocks, experts, strict=True):
        real = [r for r in rows if r < 6]
        if expert < 0:
            assert not real
            continue
        assert all(ids.flatten()[r].item() == expert for r in real)
        seen += real
    assert sorted(seen) == list(range(6))
    assert experts[:3] == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [9, 13])
def test_bf16_experts_match_reference(tokens, dtype):
    args = moe_inputs(tokens, 4, 2, 32, 16, dtype, seed=tokens)
    expected = fused_moe_ref(*args)
    assert_close(fused_moe_grouped(*args), expected, dtype, factor=2.0, name="grouped")
    assert_close(fused_moe_triton(*args), expected, dtype, factor=2.0, name="dispatched")


def quant_experts(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> e4m3 with [E, N] (per channel) or [E] (per tensor) scales."""
    if per_channel:
        q, s = per_token_quant_ref(w.flatten(0, 1))
        return q.view(w.shape), s.view(w.shape[:2])
    pairs = [per_tensor_quant_ref(e) for e in w]
    return torch.stack([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_experts_match_dequantised_reference(per_channel):
    x, w1, w2, weights, ids = moe_inputs(10, 4, 2, 64, 32, torch.bfloat16, seed=3)
    w1_q, w1_s = quant_experts(w1.float(), per_channel)
    w2_q, w2_s = quant_experts(w2.float(), per_channel)
    expected = fused_moe_fp8_ref(x, w1_q, w1_s, w2_q, w2_s, weights, ids)
    got = fused_moe_grouped(x, w1_q, w2_q, weights, ids, w_gate_up_scale=w1_s, w_down_scale=w2_s)
    assert rel_error(got, expected) < FP8_REL_ERROR


def test_shared_expert_gate_and_dispatcher():
    x, w1, w2, weights, ids = moe_inputs(9, 4, 2, 32, 16, torch.float32, seed=8)
    shared = randn(9, 32, seed=9)
    gate = randn(9, 1, seed=10)
    expected = fused_moe_ref(x, w1, w2, weights, ids) + torch.sigmoid(gate) * shared
    got = fused_moe_grouped(x, w1, w2, weights, ids, shared_output=shared, shared_gate=gate)
    assert_close(got, expected, torch.float32, name="grouped")
    assert_close(
        fused_moe(x, w1, w2, weights, ids, shared_output=shared, shared_gate=gate),
        expected,
        torch.float32,
        name="dispatcher",
    )


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 16, 256, 2048])
def test_full_size_qwen35_35b_a3b(tokens):
    args = moe_inputs(tokens, 256, 8, 2048, 512, torch.bfloat16, seed=1)
    expected = fused_moe_ref(*args)
    assert_close(fused_moe(*args), expected, torch.bfloat16, factor=2.0)
