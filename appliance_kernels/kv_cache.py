"""The KV pool's write side and its fp8 form: what a layer's k / v rows become in the
token-granular cache (appliance_kernels/attention.py reads it).

An fp8 (e4m3) cache holds k / k_scale and v / v_scale, saturated to +-448 (`--kv-cache-dtype
fp8_e4m3`); the scales are per layer (KVScales), [1] fp32 tensors on the cache's device that the
kernels read through pointers (CUDA-graph safe), with host copies for APIs that take floats.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from appliance_kernels.fp8 import FP8_DTYPE, FP8_MAX
from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)

KV_CACHE_DTYPES = {"fp8_e4m3": FP8_DTYPE}  # --kv-cache-dtype values other than auto


class KVScales(NamedTuple):
    """Dequantisation scales of one layer's fp8 KV cache (real value = cache value * scale)."""

    k: torch.Tensor  # [1] fp32 on the cache's device; the kernels read it (CUDA-graph safe)
    v: torch.Tensor  # [1] fp32
    k_host: float  # the same values for APIs that take floats (flashinfer); set with k / v
    v_host: float


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale saturated to the e4m3 range, in e4m3 (scale None = 1)."""
    x = x.float() if scale is None else x.float() / scale.float()
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv_ref(cache_rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows in fp32: fp8 ones multiplied by their scale, others as stored."""
    rows = cache_rows.float()
    return rows * scale.float() if is_fp8_cache(cache_rows) and scale is not None else rows


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    kv_slots: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,  # [1] fp32; used by an fp8 cache only
    v_scale: torch.Tensor | None = None,
) -> None:
    if is_fp8_cache(k_cache):
        k_cache[kv_slots] = quantize_kv_ref(k, k_scale)
        v_cache[kv_slots] = quantize_kv_ref(v, v_scale)
        return
    k_cache[kv_slots] = k.to(k_cache.dtype)
    v_cache[kv_slots] = v.to(v_cache.dtype)


@jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8_KV:  # x / scale rounded as torch divides (`/` is approximate on the GPU), saturated
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -448.0, 448.0)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -448.0, 448.0)
    tl.store(
        k_cache_ptr + slot * stride_kcs + h * stride_kch + d,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + slot * stride_vcs + h * stride_vch + d,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D] (token/head strides free, last dim contiguous)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    kv_slots: torch.Tensor,  # [T] int
    k_scale: torch.Tensor | None = None,  # [1] fp32; required by an fp8 cache
    v_scale: torch.Tensor | None = None,
) -> None:
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"store_kv: shapes k {k.shape} v {v.shape} cache {k_cache.shape}")
    fp8 = check_kv_scales("store_kv", k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        kv_slots,
        k_scale if fp8 else kv_slots,
        v_scale if fp8 else kv_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        num_heads,
        head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        FP8_KV=fp8,
        **pdl(k),
    )


def check_kv_scales(op: str, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are fp8; those need [1] fp32 scales on their device."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k cache {k_cache.dtype} and v cache {v_cache.dtype} differ")
    if not is_fp8_cache(k_cache):
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype != torch.float32 or t.numel() != 1 or t.device != k_cache.device:
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
            raise ValueError(
                f"{op}: an fp8 cache needs {name} as [1] fp32 on its device, got {got}"
            )
    return True


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    kv_slots: torch.Tensor,  # [T]
    kv_scales: KVScales | None = None,  # an fp8 cache's scales (ignored by other caches)
) -> None:
    """Dispatcher used by the model layers: Triton on CUDA, the reference elsewhere."""
    scales = (kv_scales.k, kv_scales.v) if kv_scales is not None else (None, None)
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, kv_slots, *scales)
    else:
        store_kv_ref(k, v, k_cache, v_cache, kv_slots, *scales)
