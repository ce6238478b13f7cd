"""MoE routing in one kernel (appliance_kernels/moe_route.py) against the torch reference:
Qwen3.5-MoE sizes (256 experts, top 8) and odd ones, bf16 and fp32 logits, renormalised or not, ties
to the lower expert id, strided logits, the dispatch from appliance_kernels.moe.moe_route, and its
limits."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, randn

from appliance_kernels.moe import moe_route_ref
from appliance_kernels.moe_route import MAX_EXPERTS, moe_route_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 256, 8), (5, 60, 4), (3, 7, 7), (2, 128, 1)])
def test_route_matches_reference(tokens, experts, top_k, renormalize, dtype):
    logits = randn(tokens, experts, seed=experts + top_k).to(dtype)
    weights, ids = moe_route_triton(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    ids, ref_ids = ids.cpu(), ref_ids.cpu()
    # the same experts, except that equal probabilities (bf16 logits tie) may come in another
    # order than torch.topk's: each rank picks an expert of the same probability, none twice
    probs = torch.softmax(logits.float().cpu(), dim=-1)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert all(len(set(row)) == top_k for row in ids.tolist())
    if dtype == torch.float32:  # no ties: the very same ids
        assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights.cpu(), rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_id_and_strided_rows():
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 2.0  # three equal maxima
    logits[1, 5] = 1.0
    wide = torch.zeros(2, 40)
    wide[:, :16] = logits
    weights, ids = moe_route_triton(wide.to(DEVICE)[:, :16], 2, True)
    assert ids.tolist()[0] == [3, 9]
    assert ids.tolist()[1][0] == 5
    torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(2))


def test_dispatch_and_limits():
    from appliance_kernels import moe

    logits = randn(4, 32, seed=3)
    expected = moe_route_ref(logits, 4, True)
    got = moe.moe_route(logits, 4, True)  # the kernel on CUDA tensors, else the reference
    assert torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="top_k"):
        moe_route_triton(logits, 33, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_route_triton(randn(1, MAX_EXPERTS + 1, seed=1), 2, True)
    empty_w, empty_i = moe_route_triton(logits[:0], 4, True)
    assert empty_w.shape == (0, 4) and empty_i.shape == (0, 4)


def test_weights_in_the_experts_dtype():
    logits = randn(3, 64, seed=4)
    weights, ids = moe_route_triton(logits, 6, True, torch.bfloat16)
    ref_weights, ref_ids = moe_route_ref(logits, 6, True)
    assert weights.dtype == torch.bfloat16 and torch.equal(ids.cpu(), ref_ids.cpu())
    assert torch.equal(weights.cpu(), ref_weights.to(torch.bfloat16).cpu())
