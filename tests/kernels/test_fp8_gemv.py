"""The batch-1 weight-only fp8 GEMV (kernels/fp8_gemv.py) against its reference (the product with
the dequantised weight), per channel and per tensor, ragged N and K, bias, pipelined or not;
where fp8_linear routes to it; 27B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, rel_error

from kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref, gemv_wins

CONFIGS = [
    {"block_n": 8, "block_k": 128, "num_warps": 2, "stages": 1},
    {"block_n": 4, "block_k": 64, "num_warps": 1, "stages": 3},
]


def channel_weight(n, k, per_channel, seed):
    w = randn(n, k, seed=seed, scale=0.05)
    w_q, s = per_token_quant_ref(w) if per_channel else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1)


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("n,k", [(40, 300), (64, 256), (24, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference_per_channel(n, k, per_channel, config, dtype):
    w_q, s = channel_weight(n, k, per_channel, seed=n + k)
    x = randn(1, k, dtype=dtype, seed=k)
    bias = randn(n, dtype=dtype, seed=5)
    for b in (bias, None):
        expected = fp8_gemv_ref(x, w_q, s, bias=b)
        got = fp8_gemv(x, w_q, s, bias=b, config=config)
        assert got.dtype == dtype and got.shape == (1, n)
        if dtype == torch.bfloat16:
            assert_close(got, expected, torch.bfloat16, name="gemv")
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert fp8_gemv(x[0], w_q, s, config=config).shape == (n,)  # a [K] row gives [N]


def test_gemv_is_closer_to_the_full_precision_layer_than_fp8_activations():
    from kernels.fp8 import fp8_linear

    w = randn(96, 512, seed=1, scale=0.05)
    x = randn(1, 512, seed=2)
    w_q, s = per_token_quant_ref(w)
    exact = x @ w.t()
    gemv = fp8_gemv(x, w_q, s.reshape(-1))
    both = fp8_linear(x.cpu(), w_q.cpu(), s.reshape(-1).cpu()).to(DEVICE)  # fp8 x fp8 reference
    assert rel_error(gemv, exact) < rel_error(both, exact)


def test_gemv_refuses_what_it_does_not_run():
    w_q, s = channel_weight(64, 128, True, seed=0)
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(randn(2, 128), w_q, s)
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(randn(1, 100), w_q, s)


def test_route_takes_the_gemv_at_one_row():
    assert gemv_wins(1, 5120, 6144) and gemv_wins(1, 34816, 5120) and gemv_wins(1, 5120, 17408)
    assert not gemv_wins(2, 5120, 6144)  # more rows: the fp8 x fp8 kernels


@gpu
@pytest.mark.parametrize("n,k", [(5120, 5120), (34816, 5120), (5120, 17408), (5120, 6144)])
def test_full_size_27b_shapes(n, k):
    from kernels.fp8 import fp8_linear

    w_q, s = per_token_quant_ref(randn(n, k, seed=n, scale=0.05))
    x = randn(1, k, dtype=torch.bfloat16, seed=k)
    expected = fp8_gemv_ref(x, w_q, s.reshape(-1))
    assert rel_error(fp8_gemv(x, w_q, s.reshape(-1)), expected) < 1e-2
    assert rel_error(fp8_linear(x, w_q, s.reshape(-1)), expected) < 1e-2  # the route takes it
