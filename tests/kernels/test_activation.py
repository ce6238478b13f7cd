"""SiLU-and-mul against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu, randn
from tolerances import assert_close

from appliance_kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [16, 40])
def test_silu_and_mul_matches_reference(inter, dtype):
    x = randn(7, 2 * inter + 6, dtype=dtype, seed=inter)[:, : 2 * inter]  # strided rows
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), dtype)


def test_dispatcher_matches_reference():
    x = randn(3, 64, seed=1)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), torch.float32)


@gpu
@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_full_size_qwen35_27b(tokens):
    x = randn(tokens, 2 * 17408, dtype=torch.bfloat16, seed=2)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), torch.bfloat16)
