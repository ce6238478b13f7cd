"""The decode-sized weight-only fp8 GEMV (kernels/fp8_gemv.py) against its reference (the product
with the dequantised weight), per channel, per tensor and with 128 x 128 block scales, both inner
loops (fma, dot), ragged N and K, bias; the dispatchers' small-M route; 27B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, rel_error

from kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from kernels.fp8_block import dequantize_block, quantize_block_ref
from kernels.fp8_gemv import GEMV_MAX_M, fp8_gemv, fp8_gemv_ref

CONFIGS = [
    {"use_dot": False, "block_n": 8, "block_k": 128, "num_warps": 2},
    {"use_dot": True, "block_n": 16, "block_k": 64, "num_warps": 4},
]


def channel_weight(n, k, per_channel, seed):
    w = randn(n, k, seed=seed, scale=0.05)
    w_q, s = per_token_quant_ref(w) if per_channel else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1)


@pytest.mark.parametrize("config", CONFIGS, ids=["fma", "dot"])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (3, 64, 256), (GEMV_MAX_M, 24, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference_per_channel(m, n, k, per_channel, config, dtype):
    w_q, s = channel_weight(n, k, per_channel, seed=m + n)
    x = randn(m, k, dtype=dtype, seed=k)
    bias = randn(n, dtype=dtype, seed=5)
    for b in (bias, None):
        expected = fp8_gemv_ref(x, w_q, s, bias=b)
        got = fp8_gemv(x, w_q, s, bias=b, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        if config["use_dot"] or dtype == torch.bfloat16:  # dot rounds x and w to bf16
            assert_close(got, expected, torch.bfloat16, name="gemv")
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", CONFIGS, ids=["fma", "dot"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (2, 160, 300), (GEMV_MAX_M, 128, 1000)])
def test_gemv_matches_reference_block(m, n, k, config):
    w = randn(n, k, seed=n, scale=0.05).cpu()
    w_q, s = quantize_block_ref(w, (128, 128))
    w_q, s = w_q.to(DEVICE), s.to(DEVICE)
    x = randn(m, k, dtype=torch.bfloat16, seed=m)
    expected = fp8_gemv_ref(x, w_q, s, block=(128, 128))
    assert_close(fp8_gemv(x, w_q, s, block=(128, 128), config=config), expected, torch.bfloat16)
    # the reference is the product with the dequantised weight
    dense = x.float() @ dequantize_block(w_q.cpu(), s.cpu(), (128, 128)).to(DEVICE).t()
    torch.testing.assert_close(expected.float(), dense, atol=2e-2, rtol=2e-2)


def test_gemv_is_closer_to_the_full_precision_layer_than_fp8_activations():
    from kernels.fp8 import fp8_linear

    w = randn(96, 512, seed=1, scale=0.05)
    x = randn(2, 512, seed=2)
    w_q, s = per_token_quant_ref(w)
    exact = x @ w.t()
    gemv = fp8_gemv(x, w_q, s.reshape(-1))
    both = fp8_linear(x.cpu(), w_q.cpu(), s.reshape(-1).cpu()).to(DEVICE)  # fp8 x fp8 reference
    assert rel_error(gemv, exact) < rel_error(both, exact)


def test_gemv_refuses_what_it_does_not_run():
    w_q, s = channel_weight(64, 128, True, seed=0)
    with pytest.raises(ValueError, match="M <="):
        fp8_gemv(randn(GEMV_MAX_M + 1, 128), w_q, s)
    with pytest.raises(ValueError, match="GEMV"):
        fp8_gemv(randn(1, 100), w_q, s)
    w_q, s = quantize_block_ref(randn(128, 128).cpu(), (64, 64))
    with pytest.raises(ValueError, match="block"):
        fp8_gemv(randn(1, 128), w_q.to(DEVICE), s.to(DEVICE), block=(4, 64))


@gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(5120, 5120), (34816, 5120), (5120, 17408), (16480, 5120)])
def test_full_size_27b_shapes(m, n, k):
    from kernels.fp8 import fp8_linear
    from kernels.fp8_block import fp8_block_linear

    w = randn(n, k, seed=m, scale=0.05)
    x = randn(m, k, dtype=torch.bfloat16, seed=m + 1)
    w_q, s = per_token_quant_ref(w)
    expected = fp8_gemv_ref(x, w_q, s.reshape(-1))
    assert rel_error(fp8_gemv(x, w_q, s.reshape(-1)), expected) < 1e-2
    assert rel_error(fp8_linear(x, w_q, s.reshape(-1)), expected) < 1e-2  # the route takes it
    b_q, b_s = quantize_block_ref(w, (128, 128))
    expected = fp8_gemv_ref(x, b_q, b_s, block=(128, 128))
    assert rel_error(fp8_gemv(x, b_q, b_s, block=(128, 128)), expected) < 1e-2
    assert rel_error(fp8_block_linear(x, b_q, b_s, (128, 128)), expected) < 1e-2
