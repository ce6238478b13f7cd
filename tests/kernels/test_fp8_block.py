"""Block-scaled fp8: the per-token-group quantiser and the block GEMM in Triton against their torch
references (interpreter on CPU), and the references against plain fp32 math."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
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
        (100, 160, 384, (128, 128)),  # 65-128 rows: the 64-row tiles, two M tiles paired
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


# ------------------------------- the cuBLASLt route (prefill sizes) -------------------------------


def test_group_quant_pads_rows_and_writes_column_major_scales():
    """The layout cuBLASLt's 1 x 128 recipe reads: rows allocated up to a multiple of 4, scales
    [rows', groups] with strides (1, rows'); the written rows equal the plain quantiser's."""
    x = randn(6, 384, dtype=torch.bfloat16, seed=4, scale=2.0)
    q, s = per_token_group_quant_triton(x, 128, pad_rows_to=4, scale_column_major=True)
    q_ref, s_ref = per_token_group_quant_ref(x, 128)
    assert q.shape == (8, 384) and s.shape == (8, 3) and s.stride() == (1, 8)
    torch.testing.assert_close(s[:6], s_ref, rtol=1e-6, atol=0)
    assert (q[:6].float() == q_ref.float()).float().mean() > 0.97


@pytest.mark.parametrize("groups,padded", [(3, 4), (4, 4), (40, 40), (137, 140)])
def test_torch_block_scales_pad_groups_to_four_and_transpose(groups, padded):
    from appliance_kernels.fp8_block import torch_block_scales

    w_s = randn(5, groups, seed=groups).abs()
    got = torch_block_scales(w_s)
    assert got.shape == (padded, 5) and got.stride() == (1, padded)
    torch.testing.assert_close(got[:groups], w_s.t())
    assert (got[groups:] == 0).all()
    if groups == padded:  # a view: nothing copied per GEMM
        assert got.data_ptr() == w_s.data_ptr()


def test_block_route_takes_cublaslt_where_it_was_measured_faster(monkeypatch):
    """With the default (mixed) or torch backend, 128 x 128 blocks and N, K multiples of 128,
    cuBLASLt takes 512+ rows, a long K from 65 rows and the widest N from 256 where its recipe
    runs; everything else (decode sizes, other backends and blocks) stays Triton."""
    from appliance_kernels import backends, fp8_block

    works = {"value": True}
    monkeypatch.setattr(fp8_block, "cublaslt_block_ready", lambda device: works["value"])
    choice = {"fp8_gemm": backends.MIXED_FP8}
    monkeypatch.setattr(backends, "selected", lambda kind: choice[kind])
    cuda = torch.device("cuda", 0)
    top = backends.FP8_TRITON_MAX_M
    route = fp8_block.block_mm_route
    assert route(512, 5120, 6144, (128, 128), cuda) == "torch"
    assert route(511, 5120, 6144, (128, 128), cuda) == "triton"
    assert route(top + 1, 5120, 17408, (128, 128), cuda) == "torch"  # the long-K down projection
    assert route(top, 5120, 17408, (128, 128), cuda) == "triton"
    assert route(256, 34816, 5120, (128, 128), cuda) == "torch"  # gate_up
    assert route(256, 16384, 5120, (128, 128), cuda) == "triton"  # in_proj
    assert route(4096, 5120, 6144, (128, 64), cuda) == "triton"
    assert route(4096, 5120 + 64, 6144, (128, 128), cuda) == "triton"
    choice["fp8_gemm"] = "torch"
    assert route(4096, 5120, 6144, (128, 128), cuda) == "torch"
    for backend in ("triton", "sgl", "cutlass"):
        choice["fp8_gemm"] = backend
        assert route(4096, 5120, 6144, (128, 128), cuda) == "triton"
    choice["fp8_gemm"] = backends.MIXED_FP8
    works["value"] = False
    assert route(4096, 5120, 6144, (128, 128), cuda) == "triton"


@gpu
@pytest.mark.parametrize("m,n,k", [(5, 256, 384), (520, 384, 512), (1024, 5120, 6144)])
def test_cublaslt_block_gemm_matches_reference(m, n, k):
    """On the H200 (SM90, CUDA 12.9+) cuBLASLt's block recipe runs and gives the reference's
    product: rows padded to 4 (m = 5), groups padded to 4 (K = 384), a 27B projection."""
    from appliance_kernels.fp8_block import cublaslt_block_ready, fp8_block_mm_torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLASLt's block recipe is SM90 only")
    assert cublaslt_block_ready(DEVICE)
    x = randn(m, k, dtype=torch.bfloat16, seed=m)
    w_q, w_s = quantize_block_ref(randn(n, k, seed=n, scale=0.05), (128, 128))
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    got = fp8_block_mm_torch(x, w_q, w_s, bias)
    x_q, x_s = per_token_group_quant_ref(x, 128)
    want = fp8_block_mm_ref(x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16, bias)
    assert got.shape == (m, n) and got.is_contiguous()
    assert_close(got, want, torch.bfloat16, name="cublaslt block_mm")
    if m >= 512:  # the layers' dispatcher routes these rows there (the default fp8 backend)
        from appliance_kernels.fp8_block import block_mm_route

        assert block_mm_route(m, n, k, (128, 128), DEVICE) == "torch"
        torch.testing.assert_close(fp8_block_linear(x, w_q, w_s, (128, 128), bias), got)


def test_backends_command_names_the_block_route(monkeypatch):
    """`appliance backends` prints what block-scaled weights run on: the reference without CUDA,
    cuBLASLt at prefill sizes only under the default / torch fp8 backend where its recipe runs."""
    from appliance_kernels import backends, fp8_block

    works = {"value": True}
    monkeypatch.setattr(fp8_block, "cublaslt_block_ready", lambda device: works["value"])
    summary = fp8_block.block_route_summary
    assert summary(backends.MIXED_FP8, cuda=False) == "torch"
    assert "cublaslt-block" in summary(backends.MIXED_FP8, cuda=True)
    assert "cublaslt-block" in summary("torch", cuda=True)
    assert summary("sgl", cuda=True) == "triton"
    works["value"] = False
    assert summary(backends.MIXED_FP8, cuda=True) == "triton"
