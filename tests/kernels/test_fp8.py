"""fp8 e4m3 quantisation and scaled GEMM: Triton kernels against the references, the dispatchers,
and each external backend's scale handling where that backend can run."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, ON_GPU, gpu, randn
from tolerances import FP8_GEMM_TOLERANCE, FP8_REL_ERROR, assert_close, rel_error

from appliance_kernels import backends
from appliance_kernels.adapters import FP8_ADAPTERS, fp8_scaled_mm_external
from appliance_kernels.fp8 import (
    FP8_DTYPE,
    fp8_gemm_route,
    fp8_linear,
    fp8_quant,
    fp8_scaled_mm_ref,
    fp8_scaled_mm_triton,
    per_tensor_quant_ref,
    per_tensor_quant_triton,
    per_token_quant_ref,
    per_token_quant_triton,
)


def assert_same_codes(got_q, want_q, scale):
    """Quantised values may differ by one e4m3 step where fp32 rounding ties differ."""
    got, want = got_q.float() * scale, want_q.float() * scale
    step = want.abs() / 8 + scale * 2**-9  # one mantissa step (3 bits) plus the subnormal step
    assert ((got - want).abs() <= step).all()
    assert (got_q.float() == want_q.float()).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200])
def test_per_token_quant_matches_reference(hidden, dtype):
    x = randn(6, hidden + 4, dtype=dtype, seed=hidden)[:, :hidden]
    x[2] = 0  # an all-zero row keeps a finite scale
    q, s = per_token_quant_triton(x)
    q_ref, s_ref = per_token_quant_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert_same_codes(q, q_ref, s_ref)
    assert rel_error(q.float() * s, x) < FP8_REL_ERROR


@pytest.mark.parametrize("static", [False, True])
def test_per_tensor_quant_matches_reference(static):
    x = randn(9, 80, dtype=torch.bfloat16, seed=3, scale=3.0)
    given = torch.tensor([0.02], device=DEVICE) if static else None
    q, s = per_tensor_quant_triton(x, given)
    q_ref, s_ref = per_tensor_quant_ref(x, given)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert_same_codes(q, q_ref, s_ref)


def quantised_operands(m, n, k, per_channel, seed):
    a_q, sa = per_token_quant_ref(randn(m, k, seed=seed))
    w = randn(n, k, seed=seed + 1, scale=0.05)
    if per_channel:
        b_q, sb = per_token_quant_ref(w)
        sb = sb.reshape(n)
    else:
        b_q, sb = per_tensor_quant_ref(w)
    return a_q, b_q, sa, sb


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("m,n,k", [(3, 48, 64), (20, 40, 300)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_reference(m, n, k, per_channel, out_dtype):
    a_q, b_q, sa, sb = quantised_operands(m, n, k, per_channel, seed=m)
    bias = randn(n, dtype=out_dtype, seed=9)
    expected = fp8_scaled_mm_ref(a_q, b_q, sa, sb, out_dtype, bias)
    got = fp8_scaled_mm_triton(a_q, b_q, sa, sb, out_dtype, bias)
    if out_dtype == torch.float32:
        atol, rtol = FP8_GEMM_TOLERANCE
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        assert_close(got, expected, out_dtype, name="scaled_mm")


def test_fp8_linear_close_to_bf16_linear():
    x = randn(5, 128, dtype=torch.bfloat16, seed=1)
    w = randn(64, 128, seed=2, scale=0.05)
    w_q, w_s = per_token_quant_ref(w)
    y = fp8_linear(x, w_q, w_s.reshape(64))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 64)
    assert rel_error(y, x.float() @ w.t()) < FP8_REL_ERROR


def test_quant_dispatcher_matches_reference():
    x = randn(4, 32, seed=4)
    q, s = fp8_quant(x)
    torch.testing.assert_close(s, per_token_quant_ref(x)[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "configured,m,capability,expected",
    [
        (backends.MIXED_FP8, 1, (9, 0), "triton"),
        (backends.MIXED_FP8, backends.FP8_TRITON_MAX_M, (9, 0), "triton"),
        (backends.MIXED_FP8, backends.FP8_TRITON_MAX_M + 1, (9, 0), "torch"),
        ("torch", 4096, (9, 0), "torch"),
        ("torch", 4096, (8, 9), "reference"),  # cuBLASLt row-wise scales need SM90+
        ("torch", 1, (8, 0), "reference"),
        ("triton", 4096, (8, 9), "triton"),
        ("sgl", 1, (9, 0), "sgl"),
        ("cutlass", 4096, (10, 0), "cutlass"),
    ],
)
def test_gemm_route_of_each_configured_backend(configured, m, capability, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fp8_gemm_route(configured, m, torch.device("cuda", 0)) == expected


@pytest.mark.parametrize("backend", ["triton", "reference", backends.MIXED_FP8, "auto"])
def test_external_adapter_rejects_what_it_does_not_run(backend):
    """Our own kernels and the reference are the dispatcher's; the adapter names its choices."""
    a_q, b_q, sa, sb = quantised_operands(2, 8, 16, True, seed=1)
    with pytest.raises(ValueError, match=", ".join(FP8_ADAPTERS)):
        fp8_scaled_mm_external(backend, a_q, b_q, sa, sb, torch.float32)


@gpu
@pytest.mark.parametrize("backend", ["triton", "torch", "sgl", "cutlass"])
@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize("per_channel", [True, False])
def test_full_size_backends(backend, m, per_channel):
    platform = backends.detect_platform()
    module = {"sgl": "sgl_kernel", "cutlass": "vllm"}.get(backend)
    if module and module not in platform.importable:
        pytest.skip(f"{module} not installed here")
    if backend == "torch" and platform.capability < (9, 0):
        pytest.skip("cuBLASLt row-wise scales need SM90+ (fp8_scaled_mm uses the reference here)")
    a_q, b_q, sa, sb = quantised_operands(m, 5120, 5120, per_channel, seed=m)
    expected = fp8_scaled_mm_ref(a_q, b_q, sa, sb, torch.bfloat16)
    if backend == "triton":
        got = fp8_scaled_mm_triton(a_q, b_q, sa, sb, torch.bfloat16)
    else:
        got = fp8_scaled_mm_external(backend, a_q, b_q, sa, sb, torch.bfloat16)
    assert rel_error(got, expected) < 1e-2
    assert ON_GPU
