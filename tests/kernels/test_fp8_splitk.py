"""The decode-sized split-K fp8 GEMM (appliance_kernels/fp8_splitk.py) against the per-channel and
block references, with K not a multiple of the split, rows up to its M limit, and full 27B shapes on
the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import FP8_GEMM_TOLERANCE, assert_close, rel_error

from appliance_kernels.fp8 import fp8_scaled_mm_ref, per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.fp8_block import (
    fp8_block_mm_ref,
    per_token_group_quant_ref,
    quantize_block_ref,
)
from appliance_kernels.fp8_splitk import (
    SPLITK_MAX_M,
    fp8_splitk_block_mm,
    fp8_splitk_mm,
    num_splits,
)


def channel_operands(m, n, k, per_channel, seed):
    a_q, sa = per_token_quant_ref(randn(m, k, seed=seed))
    w = randn(n, k, seed=seed + 1, scale=0.05)
    b_q, sb = per_token_quant_ref(w) if per_channel else per_tensor_quant_ref(w)
    return a_q, b_q, sa, sb.reshape(-1)


def block_operands(m, n, k, seed):
    a_q, sa = per_token_group_quant_ref(randn(m, k, seed=seed), 128)
    b_q, sb = quantize_block_ref(randn(n, k, seed=seed + 1, scale=0.05), (128, 128))
    return a_q.to(DEVICE), sa.to(DEVICE), b_q.to(DEVICE), sb.to(DEVICE)


def check(got, expected, out_dtype):
    if out_dtype == torch.float32:
        atol, rtol = FP8_GEMM_TOLERANCE
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        assert_close(got, expected, out_dtype, name="splitk")


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 72, 1000), (5, 130, 640), (SPLITK_MAX_M, 64, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_splitk_matches_per_channel_reference(m, n, k, per_channel, out_dtype):
    a_q, b_q, sa, sb = channel_operands(m, n, k, per_channel, seed=m + n)
    bias = randn(n, dtype=out_dtype, seed=9)
    expected = fp8_scaled_mm_ref(a_q, b_q, sa, sb, out_dtype, bias)
    check(fp8_splitk_mm(a_q, b_q, sa, sb, out_dtype, bias), expected, out_dtype)
    check(
        fp8_splitk_mm(a_q, b_q, sa, sb, out_dtype),
        fp8_scaled_mm_ref(a_q, b_q, sa, sb, out_dtype),
        out_dtype,
    )


@pytest.mark.parametrize("m,n,k", [(1, 256, 1024), (3, 200, 700), (SPLITK_MAX_M, 128, 256)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_splitk_matches_block_reference(m, n, k, out_dtype):
    a_q, sa, b_q, sb = block_operands(m, n, k, seed=m)
    bias = randn(n, dtype=out_dtype, seed=3)
    expected = fp8_block_mm_ref(a_q, sa, b_q, sb, (128, 128), out_dtype, bias)
    check(fp8_splitk_block_mm(a_q, sa, b_q, sb, (128, 128), out_dtype, bias), expected, out_dtype)


def test_splits_cover_k_in_whole_blocks_and_fill_the_machine():
    cpu = torch.device("cpu")  # counted as 8 SMs: two waves are 16 programs
    assert num_splits(64, 128, cpu) == 1  # one K block cannot be split
    assert num_splits(128, 4096, cpu) == 8  # 2 column blocks x 8 splits
    assert num_splits(64, 640, cpu) == 5  # no more splits than K blocks
    assert num_splits(64 * 16, 4096, cpu) == 1  # enough column blocks already


def test_splitk_refuses_what_it_does_not_run():
    a_q, b_q, sa, sb = channel_operands(SPLITK_MAX_M + 1, 64, 128, True, seed=0)
    with pytest.raises(ValueError, match="split-K"):
        fp8_splitk_mm(a_q, b_q, sa, sb, torch.float32)
    a_q, sa, b_q, sb = block_operands(2, 64, 128, seed=0)
    with pytest.raises(ValueError, match="block"):
        fp8_splitk_block_mm(a_q, sa, b_q, sb, (64, 64), torch.float32)


@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(5120, 5120), (34816, 5120), (5120, 17408)])
def test_full_size_27b_shapes(m, n, k):
    a_q, b_q, sa, sb = channel_operands(m, n, k, True, seed=m)
    expected = fp8_scaled_mm_ref(a_q, b_q, sa, sb, torch.bfloat16)
    assert rel_error(fp8_splitk_mm(a_q, b_q, sa, sb, torch.bfloat16), expected) < 1e-2
    a_q, sa, b_q, sb = block_operands(m, n, k, seed=m)
    expected = fp8_block_mm_ref(a_q, sa, b_q, sb, (128, 128), torch.bfloat16)
    got = fp8_splitk_block_mm(a_q, sa, b_q, sb, (128, 128), torch.bfloat16)
    assert rel_error(got, expected) < 1e-2
