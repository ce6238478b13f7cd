"""The tensor-core rows GEMV (appliance_kernels/gemv_rows.py) against the product with the
dequantised weight: 16-bit, per-channel and per-tensor fp8 weights, 1-16 rows, ragged N and K, bias,
leading shapes; where `linear` and fp8_linear route to it; 27B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close

import appliance_kernels.fp8_gemv
import appliance_kernels.gemv_rows
from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.fp8_gemv import fp8_gemv_ref, linear
from appliance_kernels.gemv_rows import ROUTED_ROWS, ROWS_MAX, gemv_rows

CONFIGS = [
    {"block_n": 16, "block_k": 64, "num_warps": 4, "stages": 1},
    {"block_n": 32, "block_k": 32, "num_warps": 2, "stages": 3},
]


def weight(kind, n, k, seed):
    w = randn(n, k, seed=seed, scale=0.05)
    if kind == "bf16":
        w = w.to(torch.bfloat16)
        return w, None, w
    w_q, s = per_token_quant_ref(w) if kind == "channel" else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1), w_q.float() * s.reshape(-1, 1).float()


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
@pytest.mark.parametrize("m", [1, 2, 4, 5, ROWS_MAX])
@pytest.mark.parametrize("kind", ["bf16", "channel", "tensor"])
@pytest.mark.parametrize("n,k", [(48, 256), (40, 300)])
def test_rows_match_the_dequantised_product(n, k, m, kind, config):
    x = randn(m, k, dtype=torch.bfloat16, seed=m + k)
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    w, s, dense = weight(kind, n, k, seed=m)
    got = gemv_rows(x, w, s, bias, config)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert_close(got, fp8_gemv_ref(x, dense, dense.new_ones(1), bias), torch.bfloat16, name="rows")
    # rows past M are masked: each row alone gives what it gives among the others
    assert_close(got[-1], gemv_rows(x[-1:], w, s, bias, config)[0], torch.bfloat16, name="alone")


def test_leading_shape_and_strided_rows():
    w, s, dense = weight("channel", 32, 128, seed=1)
    wide = randn(3, 256, dtype=torch.bfloat16, seed=2)
    x = wide[:, :128]  # rows with a stride of 256 (last dim contiguous)
    expected = fp8_gemv_ref(x, dense, dense.new_ones(1))
    assert_close(gemv_rows(x, w, s, config=CONFIGS[0]), expected, torch.bfloat16)
    got = gemv_rows(x.reshape(1, 3, 128).contiguous(), w, s, config=CONFIGS[0])
    assert got.shape == (1, 3, 32)


def test_refuses_what_it_does_not_run():
    w = randn(32, 128, dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="rows of K"):
        gemv_rows(randn(ROWS_MAX + 1, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="rows of K"):
        gemv_rows(randn(2, 100, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="16-bit rows"):
        gemv_rows(randn(2, 128), w.float())  # fp32 rows


def test_linear_takes_it_for_a_few_16bit_rows(monkeypatch):
    monkeypatch.setattr(appliance_kernels.fp8_gemv, "use_triton", lambda t: True)  # as on CUDA
    calls = []
    real = appliance_kernels.fp8_gemv.gemv_rows
    monkeypatch.setattr(
        appliance_kernels.fp8_gemv, "gemv_rows", lambda *a: calls.append(a) or real(*a)
    )
    w = randn(160, 300, dtype=torch.bfloat16, seed=1, scale=0.05)  # K < 2N
    bias = randn(160, dtype=torch.bfloat16, seed=2)
    lo, hi = ROUTED_ROWS
    for m in (lo, hi):
        x = randn(m, 300, dtype=torch.bfloat16, seed=m)
        got = linear(x, w, bias)
        assert_close(got, torch.nn.functional.linear(x, w, bias), torch.bfloat16, name="linear")
    grid = randn(2, 4, 300, dtype=torch.bfloat16, seed=7)[:, 1:3]  # 4 rows, not one stride
    assert_close(linear(grid, w), torch.nn.functional.linear(grid, w), torch.bfloat16)
    assert len(calls) == 3
    linear(randn(1, 300, dtype=torch.bfloat16), w)  # one row: the one-row GEMV
    linear(randn(hi + 1, 300, dtype=torch.bfloat16), w)  # more rows: cuBLAS
    linear(randn(lo, 300), w.float())  # fp32: cuBLAS
    long_k = w[:48].contiguous()  # K >= 2N: 2-4 rows take the FMA rows GEMV, more come here
    linear(randn(4, 300, dtype=torch.bfloat16), long_k)
    assert len(calls) == 3
    assert_close(linear(x, long_k), torch.nn.functional.linear(x, long_k), torch.bfloat16)
    assert len(calls) == 4
    monkeypatch.setattr(appliance_kernels.gemv_rows, "USE_ROWS", False)
    linear(randn(lo, 300, dtype=torch.bfloat16), w)
    assert len(calls) == 4


@gpu
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("kind", ["bf16", "channel"])
@pytest.mark.parametrize("n,k", [(34816, 5120), (5120, 17408), (5120, 6144)])
def test_27b_shapes_on_the_gpu(n, k, m, kind):
    x = randn(m, k, dtype=torch.bfloat16, seed=m)
    w, s, dense = weight(kind, n, k, seed=7)
    assert DEVICE.type == "cuda"
    assert_close(gemv_rows(x, w, s), fp8_gemv_ref(x, dense, dense.new_ones(1)), torch.bfloat16)
