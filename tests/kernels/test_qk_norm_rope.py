"""The fused attention prologue (q/k RMSNorm, partial rotary, KV store) against the separate ops."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import TOLERANCES, assert_close, poison, rel_error

from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.kv_cache import quantize_kv_ref
from appliance_kernels.qk_norm_rope import (
    qk_norm_rope_store,
    qk_norm_rope_store_ref,
    qk_norm_rope_store_triton,
)
from appliance_kernels.rotary import inv_freq, rotary_cos_sin_ref


def make_inputs(tokens, hq, hkv, d, rot, dtype, seed, cache_dtype=None):
    """q interleaved per head with its gate and k / v beside it in one projection row (the
    layer's views), norm weights, the rotary tables, poisoned caches and scattered slots."""
    wide = randn(tokens, hq * 2 * d + 2 * hkv * d, dtype=dtype, seed=seed) * 2
    q = wide[:, : hq * 2 * d].view(tokens, hq, 2 * d)[:, :, :d]
    k = wide[:, hq * 2 * d : hq * 2 * d + hkv * d].view(tokens, hkv, d)
    v = wide[:, hq * 2 * d + hkv * d :].view(tokens, hkv, d)
    weights = [randn(d, seed=seed + i, scale=0.3).to(dtype) for i in (1, 2)]
    positions = torch.randint(0, 4000, (tokens,), device=DEVICE)
    cos, sin = rotary_cos_sin_ref(positions, inv_freq(rot, 1e7).to(DEVICE))
    slots = torch.randperm(tokens + 9, device=DEVICE)[:tokens]
    cache_dtype = cache_dtype or dtype
    caches = [
        poison(torch.empty(tokens + 9, hkv, d, device=DEVICE)).to(cache_dtype) for _ in range(4)
    ]
    return q, k, v, weights, cos, sin, slots, caches


def check_caches(caches, slots, dtype, scales=(None, None)):
    ours_k, ours_v, ref_k, ref_v = caches
    for got, want, scale, name in (
        (ours_k, ref_k, scales[0], "k cache"),
        (ours_v, ref_v, scales[1], "v cache"),
    ):
        if got.dtype == FP8_DTYPE:  # in real units: k is a sum of two rounded products (rotary),
            # so where they cancel, a bf16 ulp from the norm's fp32 sum order (GPU) is a large part
            # of a small value and its e4m3 code moves by more than a step; bounded like bf16 q
            a, b = got[slots].float() * scale, want[slots].float() * scale
            assert ((a - b).abs() <= b.abs() / 8 + TOLERANCES[dtype][0]).all(), name
            assert rel_error(a, b) < 1e-2, f"{name}: {rel_error(a, b)}"
        else:
            assert_close(got[slots].float(), want[slots].float(), dtype, name=name)
        untouched = torch.ones(got.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert torch.isnan(got[untouched].float()).all(), f"{name}: other slots written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("shape", [(3, 4, 2, 32, 16), (2, 6, 1, 24, 24)], ids=["partial", "full"])
def test_fused_prologue_matches_separate_ops(shape, zero_centered, dtype):
    tokens, hq, hkv, d, rot = shape
    q, k, v, (qw, kw), cos, sin, slots, caches = make_inputs(tokens, hq, hkv, d, rot, dtype, 5)
    args = (qw, kw, 1e-6, zero_centered, cos, sin)
    expected = qk_norm_rope_store_ref(q, k, v, *args, caches[2], caches[3], slots)
    got = qk_norm_rope_store_triton(q, k, v, *args, caches[0], caches[1], slots)
    assert got.shape == q.shape and got.is_contiguous()
    assert_close(got, expected, dtype, name="q")
    check_caches(caches, slots, dtype)
    assert torch.equal(qk_norm_rope_store(q, k, v, *args, *caches[2:], slots), expected) or (
        DEVICE.type == "cuda"
    )


def test_fused_prologue_quantises_an_fp8_cache():
    q, k, v, (qw, kw), cos, sin, slots, caches = make_inputs(
        3, 4, 2, 32, 16, torch.bfloat16, 7, cache_dtype=FP8_DTYPE
    )
    scales = (torch.tensor([0.02], device=DEVICE), torch.tensor([0.5], device=DEVICE))
    args = (qw, kw, 1e-6, True, cos, sin)
    expected = qk_norm_rope_store_ref(q, k, v, *args, caches[2], caches[3], slots, *scales)
    got = qk_norm_rope_store_triton(q, k, v, *args, caches[0], caches[1], slots, *scales)
    assert_close(got, expected, torch.bfloat16, name="q")
    check_caches(caches, slots, torch.bfloat16, scales)
    assert caches[1][slots].float().abs().max() <= 448  # v / 0.5 saturated into e4m3's range
    assert torch.equal(caches[1][slots].float(), quantize_kv_ref(v, scales[1]).float())


def test_bad_shapes_are_refused():
    q, k, v, (qw, kw), cos, sin, slots, caches = make_inputs(2, 4, 2, 32, 16, torch.float32, 9)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope_store_triton(q, k, v[:1], qw, kw, 1e-6, True, cos, sin, *caches[:2], slots)


@gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_full_size_qwen35_27b(cache_dtype):
    """27B heads (24 q / 4 kv, head_dim 256, rotary 64), a decode batch and a prefill chunk, over
    a bf16 and an fp8 cache (compiled, not interpreted: both store branches)."""
    for tokens in (64, 4096):
        q, k, v, (qw, kw), cos, sin, slots, caches = make_inputs(
            tokens, 24, 4, 256, 64, torch.bfloat16, 11, cache_dtype=cache_dtype
        )
        scales = (None, None)
        if cache_dtype == FP8_DTYPE:
            scales = (torch.tensor([0.02], device=DEVICE), torch.tensor([0.5], device=DEVICE))
        args = (qw, kw, 1e-6, True, cos, sin)
        expected = qk_norm_rope_store_ref(q, k, v, *args, caches[2], caches[3], slots, *scales)
        got = qk_norm_rope_store_triton(q, k, v, *args, caches[0], caches[1], slots, *scales)
        assert_close(got, expected, torch.bfloat16, name=f"q {tokens}")
        check_caches(caches, slots, torch.bfloat16, scales)
