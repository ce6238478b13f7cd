"""The attention layer's per-head prologue in one launch: RMSNorm of each q and k head (q_norm /
k_norm), partial rotary on both, and k / v written into the KV cache (fp8 with its scales, as
store_kv does). It replaces five launches per attention layer (two norms, two rotaries, the
store); at batch 1 each of those is a few microseconds of fixed cost for a few kilobytes of work.
Called by appliance/models/layers/attention.py; the reference composes the separate ops.
"""

from __future__ import annotations

import torch

from appliance_kernels.kv_cache import check_kv_scales, store_kv_ref
from appliance_kernels.norm import rms_norm_ref
from appliance_kernels.rotary import apply_rotary_ref
from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)


def qk_norm_rope_store_ref(
    q: torch.Tensor,  # [T, Hq, D] (strided view)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    q_weight: torch.Tensor,  # [D] q_norm's weight
    k_weight: torch.Tensor,  # [D]
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,  # [T, rotary_dim] fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,  # [T]
    k_scale: torch.Tensor | None = None,  # [1] fp32 of an fp8 cache
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns q normed and rotated, [T, Hq, D] contiguous; k (normed, rotated) and v go to the
    cache at kv_slots."""
    t, hq, d = q.shape
    qn = rms_norm_ref(q.reshape(-1, d), q_weight, eps, zero_centered)[0].view(t, hq, d)
    kn = rms_norm_ref(k.reshape(-1, d), k_weight, eps, zero_centered)[0].view(k.shape)
    store_kv_ref(apply_rotary_ref(kn, cos, sin), v, k_cache, v_cache, kv_slots, k_scale, v_scale)
    return apply_rotary_ref(qn, cos, sin).contiguous()


# -------------------------------------------------------------------------------------------------
# Triton: one program per (token, head) of q and k; a k program also stores that head's v. The row
# is normed once and its rotate-half partner columns are normed again from memory with the same
# denominator, so every rounding step is the one rms_norm_triton, then apply_rotary_triton, then
# store_kv_triton make (bit-equal in bf16 up to the order of the fp32 sum of squares).
# -------------------------------------------------------------------------------------------------


@jit
def _norm_cols(x, w, inv_rms, ZERO_CENTERED: tl.constexpr):
    """rms_norm_triton's rounding on a vector of columns: fp32 result of the dtype-rounded norm."""
    dtype = x.dtype
    h = x.to(tl.float32) * inv_rms
    w = w.to(tl.float32)
    if ZERO_CENTERED:
        y = h * (1.0 + w)
    else:
        y = w.to(dtype).to(tl.float32) * h.to(dtype).to(tl.float32)
    return y.to(dtype).to(tl.float32)


@jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    num_q_heads,
    head_dim,
    rot_dim,
    eps,
    BLOCK_D: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    FP8_KV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < num_q_heads
    kv_head = head - num_q_heads
    if is_q:
        row = q_ptr + t * stride_qt + head * stride_qh
        w_ptr = qw_ptr
    else:
        row = k_ptr + t * stride_kt + kv_head * stride_kh
        w_ptr = kw_ptr
    d = tl.arange(0, BLOCK_D)
    ok = d < head_dim
    x = tl.load(row + d, mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / head_dim + eps)
    y = _norm_cols(x, tl.load(w_ptr + d, mask=ok, other=0.0), inv_rms, ZERO_CENTERED)
    # rotary on the normed row (apply_rotary_triton's rounding); partner columns normed again
    half = rot_dim // 2
    in_rot = d < rot_dim
    partner = tl.where(d < half, d + half, d - half)
    p_ok = ok & in_rot
    xp = tl.load(row + partner, mask=p_ok, other=0.0)
    yp = _norm_cols(xp, tl.load(w_ptr + partner, mask=p_ok, other=0.0), inv_rms, ZERO_CENTERED)
    yp = tl.where(d < half, -yp, yp)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=in_rot, other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=in_rot, other=0.0).to(dtype).to(tl.float32)
    rot = (y * c).to(dtype).to(tl.float32) + (yp * s).to(dtype).to(tl.float32)
    y = tl.where(in_rot, rot, y).to(dtype)
    if is_q:
        tl.store(q_out_ptr + t * stride_ot + head * stride_oh + d, y, mask=ok)
    else:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        v = tl.load(v_ptr + t * stride_vt + kv_head * stride_vh + d, mask=ok, other=0.0)
        k_dst = k_cache_ptr + slot * stride_kcs + kv_head * stride_kch + d
        v_dst = v_cache_ptr + slot * stride_vcs + kv_head * stride_vch + d
        if FP8_KV:  # store_kv_triton's quantisation: x / scale rounded as torch divides, saturated
            k_q = tl.clamp(tl.math.div_rn(y.to(tl.float32), tl.load(k_scale_ptr)), -448.0, 448.0)
            v_q = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -448.0, 448.0)
            tl.store(k_dst, k_q.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_dst, v_q.to(v_cache_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(k_dst, y.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def qk_norm_rope_store_triton(
    q: torch.Tensor,  # [T, Hq, D] (token / head strides free, last dim contiguous)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,  # [T]
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as qk_norm_rope_store_ref."""
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, x)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos.shape[-1]
    if (
        k.shape != v.shape
        or k.shape[0] != num_tokens
        or k.shape[2] != head_dim
        or k_cache.shape[1:] != k.shape[1:]
        or v_cache.shape != k_cache.shape
    ):
        raise ValueError(f"qk_norm_rope: q {q.shape} k {k.shape} v {v.shape} cache {k_cache.shape}")
    if rot_dim % 2 or rot_dim > head_dim or sin.shape != cos.shape or cos.shape[0] != num_tokens:
        raise ValueError(f"qk_norm_rope: q {q.shape} cos {cos.shape} sin {sin.shape}")
    fp8 = check_kv_scales("qk_norm_rope", k_cache, v_cache, k_scale, v_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q,
        k,
        v,
        q_weight,
        k_weight,
        cos,
        sin,
        out,
        k_cache,
        v_cache,
        kv_slots,
        k_scale if fp8 else kv_slots,
        v_scale if fp8 else kv_slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        num_q_heads,
        head_dim,
        rot_dim,
        eps,
        BLOCK_D=next_pow2(head_dim),
        ZERO_CENTERED=zero_centered,
        FP8_KV=fp8,
        num_warps=1 if head_dim <= 256 else 2,
        **pdl(q),
    )
    return out


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher used by the attention layer: Triton on CUDA, the reference elsewhere."""
    fn = qk_norm_rope_store_triton if use_triton(q) else qk_norm_rope_store_ref
    return fn(
        q, k, v, q_weight, k_weight, eps, zero_centered, cos, sin, k_cache, v_cache, kv_slots,
        k_scale, v_scale,
    )  # fmt: skip
