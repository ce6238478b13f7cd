"""Block-scaled fp8: the per-token-group quantiser and the block GEMM in Triton against their torch
references (interpreter on CPU), and the references against plain fp32 math."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, randn
from tolerances import FP8_GEMM_TOLERANCE, FP8_REL_ERROR, assert_close, rel_error

from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.fp8_block import (
    dequantize_block,
    fp8_block_linear,
    fp8_block_mm_ref,
    fp8_block_mm_triton,
    per_token_group_quant_ref,
    per_token_group_quant_triton,
    quantize_block_ref,
)


@pytest.mark.parametrize("cols,group", [(64, 32), (100, 32), (128, 128)])
def test_group_quant_matches_reference(cols, group):
    x = randn(5, cols, dtype=torch.bfloat16, seed=cols, scale=2.0)
    x[1, :group] = 0  # an all-zero group keeps a finite scale
    x[3, :7] *= 50  # an outlier changes only its own group's scale
    q, s = per_token_group_quant_triton(x, group)
    q_ref, s_ref = per_token_group_quant_ref(x, group)
    assert q.dtype == FP8_DTYPE and s.shape == (5, -(-cols // group))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() == q_ref.float()).float().mean() > 0.97
    full = s_ref.repeat_interleave(group, dim=1)[:, :cols]
    assert rel_error(q_ref.float() * full, x) < FP8_REL_ERROR
    if cols > group:
        assert s_ref[3, 0] > 10 * s_ref[3, -1]


def test_block_quant_roundtrip_and_scale_shape():
    w = randn(80, 200, seed=3, scale=0.05)
    w[:16, :32] *= 40  # one tile with large values
    q, s = quantize_block_ref(w, (16, 32))
    assert s.shape == (5, 7) and q.dtype == FP8_DTYPE
    assert rel_error(dequantize_block(q, s, (16, 32)), w) < FP8_REL_ERROR
    assert s[0, 0] > 10 * s[1, 0]


def operands(m, n, k, block, seed):
    a_q, sa = per_token_group_quant_ref(randn(m, k, seed=seed), block[1])
    b_q, sb = quantize_block_ref(randn(n, k, seed=seed + 1, scale=0.05), block)
    return a_q.to(DEVICE), sa.to(DEVICE), b_q.to(DEVICE), sb.to(DEVICE)


@pytest.mark.parametrize(
    "m,n,k,block",
    [
        (3, 48, 64, (16, 32)),
        (20, 40, 300, (32, 64)),
        (17, 130, 256, (128, 128)),
        (150, 200, 64, (32, 32)),  # several M tiles: the grouped tile order of the shared kernel
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_mm_matches_reference(m, n, k, block, out_dtype):
    a_q, sa, b_q, sb = operands(m, n, k, block, seed=m)
    bias = randn(n, dtype=out_dtype, seed=9)
    expected = fp8_block_mm_ref(a_q, sa, b_q, sb, block, out_dtype, bias)
    got = fp8_block_mm_triton(a_q, sa, b_q, sb, block, out_dtype, bias)
    if out_dtype == torch.float32:
        atol, rtol = FP8_GEMM_TOLERANCE
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        assert_close(got, expected, out_dtype, name="block_mm")


def test_block_mm_reference_is_the_dequantised_product():
    a_q, sa, b_q, sb = operands(4, 40, 96, (16, 32), seed=2)
    a = a_q.float() * sa.repeat_interleave(32, dim=1)
    want = a @ dequantize_block(b_q, sb, (16, 32)).t()
    got = fp8_block_mm_ref(a_q, sa, b_q, sb, (16, 32), torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_block_mm_refuses_mismatched_scales():
    a_q, sa, b_q, sb = operands(4, 40, 96, (16, 32), seed=2)
    with pytest.raises(ValueError, match="block"):
        fp8_block_mm_triton(a_q, sa, b_q, sb[:, :2], (16, 32), torch.float32)


def test_block_linear_close_to_full_precision_linear():
    x = randn(5, 256, dtype=torch.bfloat16, seed=1)
    w = randn(96, 256, seed=2, scale=0.05)
    w_q, w_s = quantize_block_ref(w, (32, 128))
    y = fp8_block_linear(x, w_q.to(DEVICE), w_s.to(DEVICE), (32, 128))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 96)
    assert rel_error(y, x.float() @ w.t()) < FP8_REL_ERROR


@pytest.mark.parametrize("m,n,k,block", [(5, 40, 300, (32, 64)), (17, 130, 384, (128, 128))])
def test_two_scale_groups_per_step_give_the_same_product(m, n, k, block):
    """SUB = 2 (two K groups' dots issued before either is scaled), odd group counts included."""
    from appliance_kernels.fp8 import launch_fp8_mm

    a_q, sa, b_q, sb = operands(m, n, k, block, seed=3)
    expected = fp8_block_mm_ref(a_q, sa, b_q, sb, block, torch.float32)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block[1], GROUP_M=1, num_warps=4, num_stages=2)
    args = (a_q, b_q, sa.float(), sb.float(), torch.float32, None)
    for sub in (1, 2):
        got = launch_fp8_mm(*args, dict(cfg, SUB=sub), scale_block_n=block[0])
        atol, rtol = FP8_GEMM_TOLERANCE
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="SUB 2 needs block scales"):
        launch_fp8_mm(*args, dict(cfg, SUB=2))


SHAPES_27B_35B = [(16384, 5120), (5120, 6144), (14336, 5120), (34816, 5120), (5120, 17408)]
SHAPES_27B_35B += [(8192, 2048), (2048, 4096), (9216, 2048), (248320, 5120)]


@pytest.mark.parametrize("m", [1, 4, 16, 17, 32, 64, 65, 256, 2048])
def test_decode_tiles_fit_the_h200_shared_memory(m):
    """The per-shape tiles (fp8._mm_config, fp8_block._block_mm_config) stage A and B tiles of
    every group a step in shared memory: within the H200's 227 KiB per block at every 27B /
    35B-A3B projection (the sweep's out-of-resource tiles were 240 KiB)."""
    from appliance_kernels.fp8 import _mm_config
    from appliance_kernels.fp8_block import _block_mm_config

    for n, k in SHAPES_27B_35B:
        for cfg in (_mm_config(m, n, k), dict(_block_mm_config(m, n, k), BLOCK_K=128)):
            stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * cfg.get("SUB", 1)
            assert stage * cfg["num_stages"] <= 227 * 1024, (m, n, k, cfg)
