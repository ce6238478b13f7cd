"""The one-row GEMVs' shared epilogues (appliance_kernels/fp8_gemv.py, gemv_swiglu.py): bias, a GDN
conv over the first rows as they are stored, a split RMSNorm's two halves (the consumer's 1 / rms
from the producer's partial sums, the producer's residual add and partials;
appliance_kernels/gemv_norm.py holds the host side) and the store; one prologue, the split
GDN gated norm's per-head factor on the row (`head_scaled`; host side in head_norm.py); and the
SwiGLU end of a gate_up GEMV (`swiglu_store`, gemv_swiglu.py)."""

from __future__ import annotations

from appliance_kernels.triton_utils import jit, tl

# A split RMSNorm (appliance_kernels/gemv_norm.py): the consumer's 1 / rms from the producer's
# partial sums of squares, and the producer's epilogue.


@jit
def load_partials(part_ptr, parts, PARTS: tl.constexpr):
    """The producer's partial sums (issued before a GEMV's K loop, summed after it)."""
    idx = tl.arange(0, PARTS)
    return tl.load(part_ptr + idx, mask=idx < parts, other=0.0)


@jit
def rstd_of(partials, hidden, eps):
    return 1.0 / tl.sqrt(tl.sum(partials, 0) / hidden + eps)


@jit
def head_scaled(
    xs,  # [BLOCK_K] fp32: the row's columns from k0
    hp_ptr,  # [H, parts] fp32: each head's partial sums of squares (appliance_kernels/head_norm.py)
    k0,
    k_size,  # a multiple of HEAD_D
    parts,
    eps,
    HEAD_D: tl.constexpr,
    HPARTS: tl.constexpr,  # power of two >= parts
    BLOCK_K: tl.constexpr,  # a multiple of HEAD_D
):
    """The row's BLOCK_K columns from k0 (whole heads; 0 past K), each head's times its 1 / rms."""
    heads = k0 // HEAD_D + tl.arange(0, BLOCK_K // HEAD_D)
    rp = tl.arange(0, HPARTS)
    ok = (heads < k_size // HEAD_D)[:, None] & (rp < parts)[None, :]
    p = tl.load(hp_ptr + heads[:, None] * parts + rp[None, :], mask=ok, other=0.0)
    r = 1.0 / tl.sqrt(tl.sum(p, 1) / HEAD_D + eps)
    return tl.reshape(tl.reshape(xs, [BLOCK_K // HEAD_D, HEAD_D]) * r[:, None], [BLOCK_K])


@jit
def add_norm_epilogue(
    out,  # [BLOCK_N] fp32: the GEMV's outputs at rows rn
    rn,
    n_ok,
    pid,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    part_ptr,
    OUT_DTYPE: tl.constexpr,
    ZC: tl.constexpr,
):
    """New residual rows (stored), this program's partial sum of squares (stored at pid) and the
    x_pre rows it returns for the caller to store as the GEMV's output."""
    y = out.to(OUT_DTYPE).to(tl.float32)  # the projection as the unsplit path stores it
    r = tl.load(res_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    s = (y + r).to(OUT_DTYPE)
    tl.store(res_out_ptr + rn, s, mask=n_ok)
    s = tl.where(n_ok, s.to(tl.float32), 0.0)
    tl.store(part_ptr + pid, tl.sum(s * s, 0))
    w = tl.load(nw_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if ZC:
        return s * (1.0 + w)
    return s * w.to(OUT_DTYPE).to(tl.float32)


@jit
def conv_epilogue(
    out,  # [BLOCK_N] fp32: the GEMV's outputs at rows rn
    rn,
    n_ok,
    conv_w_ptr,  # [C, CONV_W] the depthwise conv's weight
    conv_s_ptr,  # [slots, C, CONV_W - 1] its state (the last inputs), updated here
    slot_ptr,  # [1] the row's state slot
    init_ptr,  # [1] whether that slot holds a state (else zeros)
    conv_c,  # C: rows rn < C are conv channels
    stride_cs,
    stride_cc,
    OUT_DTYPE: tl.constexpr,
    CONV_W: tl.constexpr,
):
    """Rows rn < C of one row's projection go through the causal depthwise conv + SiLU of a GDN
    layer (causal_conv1d_ref at one token) and the conv state shifts by that token; each channel
    belongs to one program, so no program reads a state another one writes."""
    c_ok = n_ok & (rn < conv_c)
    slot = tl.load(slot_ptr).to(tl.int64)
    init = tl.load(init_ptr) != 0
    has_init = rn < conv_c * init.to(tl.int32)  # the scalar flag as a vector (interpreter)
    x = out.to(OUT_DTYPE).to(tl.float32)  # the projection as stored, the conv's input
    s_row = conv_s_ptr + slot * stride_cs + rn.to(tl.int64) * stride_cc
    w_row = conv_w_ptr + rn * CONV_W
    y = x * tl.load(w_row + (CONV_W - 1), mask=c_ok, other=0.0).to(tl.float32)
    for j in tl.static_range(CONV_W - 1):
        sv = tl.load(s_row + j, mask=c_ok & has_init, other=0.0)
        y += sv.to(tl.float32) * tl.load(w_row + j, mask=c_ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(s_row + (j - 1), sv, mask=c_ok)
    tl.store(s_row + (CONV_W - 2), x.to(conv_s_ptr.dtype.element_ty), mask=c_ok)
    y = y / (1.0 + tl.exp(-y))
    return tl.where(rn < conv_c, y, out)


@jit
def finish(
    out,
    rn,
    n_ok,
    pid,
    out_ptr,
    bias_ptr,
    HAS_BIAS: tl.constexpr,
    conv_w_ptr,
    conv_s_ptr,
    slot_ptr,
    init_ptr,
    conv_c,
    stride_cs,
    stride_cc,
    CONV_W: tl.constexpr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    po_ptr,
    ADD_NORM: tl.constexpr,
    ZC: tl.constexpr,
):
    """The one-row GEMVs' shared end after scaling: bias, a GDN conv, a split norm, the store."""
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if CONV_W > 0:
        conv_args = (conv_w_ptr, conv_s_ptr, slot_ptr, init_ptr, conv_c, stride_cs, stride_cc)
        out = conv_epilogue(out, rn, n_ok, *conv_args, out_ptr.dtype.element_ty, CONV_W)
    if ADD_NORM:
        norm_args = (res_ptr, res_out_ptr, nw_ptr, po_ptr)
        out = add_norm_epilogue(out, rn, n_ok, pid, *norm_args, out_ptr.dtype.element_ty, ZC)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@jit
def swiglu_store(
    gate,  # [BLOCK] fp32: x Wg^T at channels rn (times a pending norm's 1 / rms if any)
    up,  # [BLOCK] fp32: x Wu^T at the same channels
    rn,
    n_ok,
    s_ptr,  # [2I] per-channel scales (gate's, then up's) or [1] per tensor
    inter,
    out_ptr,  # [I]: SiLU(gate) * up, stored in its dtype
    SCALED: tl.constexpr,
    PER_COL: tl.constexpr,
):
    """Scales, then SiLU(gate) * up rounded as the unfused path (the GEMV's stored gate and up,
    F.silu's output in the dtype), stored."""
    if SCALED:
        if PER_COL:
            gate = gate * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
            up = up * tl.load(s_ptr + inter + rn, mask=n_ok, other=0.0)
        else:
            s = tl.load(s_ptr)
            gate, up = gate * s, up * s
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)  # as the unfused GEMV stores them
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + rn, (act * up).to(dtype), mask=n_ok)
