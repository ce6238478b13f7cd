"""Gated DeltaNet chunked prefill in Triton (three kernels: prep, scan, out) and its launcher, plus
the helpers the recurrent kernels in appliance_kernels/gdn.py share. Reference:
`appliance_kernels.gdn.gdn_chunked_ref`; dispatch: `appliance_kernels.gdn.gdn`. Split out of gdn.py
to keep each file readable.
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl

CHUNK = 64
# Launch parameters of the chunk kernels; ops/gpu/gdn_probe.py times alternatives on the GPU
# (H200, 27B heads, docs/benchmarks.md: 8 warps for prep or out spill less but run 2x slower;
# 128 columns per out program beat 64 by 45 us at 8k tokens).
TUNING = {
    "prep_warps": 4,
    "scan_warps": 0,  # 0: 8 warps for a [128, 64] state block, 4 below
    "scan_bv": 64,
    "out_warps": 4,
    "out_bv": 128,
}
# Smallest register tile of a 16-bit path: Triton 3.6 faulted (illegal address) on Hopper with
# [16, 64] x [64, 16] bf16 dots (head dims 16); padding the tiles to 32 (masked) avoids them.
MIN_TILE_16BIT = 32


@jit
def _l2norm(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + eps))


@jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 ('ieee') or in a 16-bit type ('bf16' / 'fp16')."""
    if DOT == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@jit
def _unit_lower_inverse(a, r, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [64, 64] a: the 16x16 diagonal blocks D by repeated squaring,
    (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8), then the off-diagonal part L folded in:
    (I + A)^-1 = (I + M)^-1 (I + D)^-1 with M = (I + D)^-1 L nilpotent of order 4. Ten dots."""
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    diag_block = (r[:, None] // 16) == (r[None, :] // 16)
    p = tl.where(diag_block, -a, 0.0)
    off = tl.where(diag_block, 0.0, a)
    inv_d = eye + p
    for _ in tl.static_range(3):
        p = tl.dot(p, p, input_precision=PREC)
        inv_d = tl.dot(inv_d, eye + p, input_precision=PREC)
    m = tl.dot(inv_d, off, input_precision=PREC)
    m2 = tl.dot(m, m, input_precision=PREC)
    left = tl.dot(eye - m, eye + m2, input_precision=PREC)
    return tl.dot(left, inv_d, input_precision=PREC)


@jit
def _gdn_chunk_prep_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    w_ptr,
    u_ptr,
    gcum_ptr,
    chunks_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    num_v_heads,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BDV: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT: tl.constexpr,
    INV_DOT: tl.constexpr,
):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    start = tl.load(chunks_ptr + 2 * c)
    end = tl.load(chunks_ptr + 2 * c + 1)
    if end <= start:  # the table is sized by a bound; unused entries are empty
        return
    r = tl.arange(0, CHUNK)
    t = (start + r).to(tl.int64)
    row_ok = start + r < end
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BDV)
    k_mask = row_ok[:, None] & (kk < DK)[None, :]
    v_mask = row_ok[:, None] & (vv < DV)[None, :]
    k = tl.load(
        k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=k_mask, other=0.0
    ).to(tl.float32)  # normalised already
    g = tl.load(g_ptr + t * stride_gt + hv * stride_gh, mask=row_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_bt + hv * stride_bh, mask=row_ok, other=0.0).to(tl.float32)
    big_g = tl.cumsum(g, 0)  # [C] log decay since the chunk start (masked rows add 0)

    below = r[:, None] > r[None, :]
    a = _mm(k * beta[:, None], tl.trans(k), DOT)
    a = tl.where(below, a * tl.exp(tl.where(below, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
    inv = _unit_lower_inverse(a, r, INV_DOT)
    w = _mm(inv, k * (beta * tl.exp(big_g))[:, None], DOT)  # [C, BK]
    v = tl.load(
        v_ptr + t[:, None] * stride_vt + hv * stride_vh + vv[None, :], mask=v_mask, other=0.0
    ).to(tl.float32)
    u = _mm(inv, v * beta[:, None], DOT)  # [C, BDV]
    row = t * num_v_heads + hv
    out_k = row[:, None] * DK + kk[None, :]
    tl.store(w_ptr + out_k, w.to(w_ptr.dtype.element_ty), mask=k_mask)
    tl.store(u_ptr + row[:, None] * DV + vv[None, :], u.to(u_ptr.dtype.element_ty), mask=v_mask)
    tl.store(gcum_ptr + row, big_g, mask=row_ok)


@jit
def _gdn_chunk_scan_kernel(
    w_ptr,
    u_ptr,
    k_ptr,
    gcum_ptr,
    vnew_ptr,
    hbuf_ptr,
    state_ptr,
    state_slots_ptr,
    cu_ptr,
    has_init_ptr,
    chunk_offsets_ptr,
    stride_kt,
    stride_kh,
    stride_ss,
    stride_sh,
    num_v_heads,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    MIN_LEN: tl.constexpr,
    DOT: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    if end - start <= MIN_LEN:
        return
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = kk < DK
    v_ok = vv < DV
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_offs = kk[:, None] * DV + vv[None, :]
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    if tl.load(has_init_ptr + b) != 0:
        h = tl.load(state_ptr + slot * stride_ss + hv * stride_sh + s_offs, mask=s_mask, other=0.0)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    chunk = tl.load(chunk_offsets_ptr + b).to(tl.int64)
    r = tl.arange(0, CHUNK)
    for c0 in range(start, end, CHUNK):
        t = (c0 + r).to(tl.int64)
        row_ok = c0 + r < end
        row = t * num_v_heads + hv
        tl.store(
            hbuf_ptr + (chunk * num_v_heads + hv) * (DK * DV) + s_offs,
            h.to(hbuf_ptr.dtype.element_ty),
            mask=s_mask,
        )
        w = tl.load(
            w_ptr + row[:, None] * DK + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        u = tl.load(
            u_ptr + row[:, None] * DV + vv[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0
        )
        v_new = u - _mm(w, h, DOT)  # [C, BV]
        tl.store(
            vnew_ptr + row[:, None] * DV + vv[None, :],
            v_new.to(vnew_ptr.dtype.element_ty),
            mask=row_ok[:, None] & v_ok[None, :],
        )
        last = (tl.minimum(c0 + CHUNK, end) - 1).to(tl.int64)
        g_last = tl.load(gcum_ptr + last * num_v_heads + hv)
        # exp(G_last - G) k: what each row adds to the state at the chunk end (k normalised)
        k_t = tl.load(
            k_ptr + t[None, :] * stride_kt + hk * stride_kh + kk[:, None],
            mask=row_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(tl.float32)  # [BK, C]
        big_g = tl.load(gcum_ptr + row, mask=row_ok, other=0.0)
        k_tail_t = k_t * tl.where(row_ok, tl.exp(g_last - big_g), 0.0)[None, :]
        h = h * tl.exp(g_last) + _mm(k_tail_t, v_new, DOT)
        chunk += 1
    tl.store(state_ptr + slot * stride_ss + hv * stride_sh + s_offs, h, mask=s_mask)


@jit
def _gdn_chunk_out_kernel(
    q_ptr,
    k_ptr,
    gcum_ptr,
    vnew_ptr,
    hbuf_ptr,
    out_ptr,
    chunks_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    num_v_heads,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    CHUNK: tl.constexpr,
    DOT: tl.constexpr,
):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    start = tl.load(chunks_ptr + 2 * c)
    end = tl.load(chunks_ptr + 2 * c + 1)
    if end <= start:
        return
    r = tl.arange(0, CHUNK)
    t = (start + r).to(tl.int64)
    row_ok = start + r < end
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = kk < DK
    v_ok = vv < DV
    qk_mask = row_ok[:, None] & k_ok[None, :]
    q = tl.load(
        q_ptr + t[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=qk_mask, other=0.0
    )
    k = tl.load(
        k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=qk_mask, other=0.0
    )
    row = t * num_v_heads + hv
    big_g = tl.load(gcum_ptr + row, mask=row_ok, other=0.0)
    causal = r[:, None] >= r[None, :]
    scores = _mm(q, tl.trans(k), DOT)
    decay = tl.exp(tl.where(causal, big_g[:, None] - big_g[None, :], 0.0))
    scores = tl.where(causal, scores * decay, 0.0)
    h = tl.load(
        hbuf_ptr + (c.to(tl.int64) * num_v_heads + hv) * (DK * DV) + kk[:, None] * DV + vv[None, :],
        mask=k_ok[:, None] & v_ok[None, :],
        other=0.0,
    )
    v_new = tl.load(
        vnew_ptr + row[:, None] * DV + vv[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0
    )
    o = _mm(q.to(tl.float32) * tl.exp(big_g)[:, None], h, DOT) + _mm(scores, v_new, DOT)
    tl.store(
        out_ptr + t[:, None] * stride_ot + hv * stride_oh + vv[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & v_ok[None, :],
    )


def _check_gdn(q, k, v, g, beta, ssm_states):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    if q.shape != k.shape or v.shape[0] != q.shape[0] or v.shape[1] % q.shape[1]:
        raise ValueError(f"gdn: q {q.shape} k {k.shape} v {v.shape}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"gdn: g {g.shape} / beta {beta.shape} must be [T, Hv] = {v.shape[:2]}")
    if ssm_states.dtype != torch.float32 or ssm_states.shape[-3:] != (
        v.shape[1],
        q.shape[2],
        v.shape[2],
    ):
        raise ValueError(f"gdn: ssm_states {ssm_states.dtype} {ssm_states.shape}")
    if ssm_states.stride(-1) != 1 or ssm_states.stride(-2) != v.shape[2]:
        raise ValueError("gdn: each state [slot, head] must be a contiguous [Dk, Dv] matrix")


def _dot_mode(dtype: torch.dtype) -> str:
    return {torch.float32: "ieee", torch.float16: "fp16"}.get(dtype, "bf16")


@jit
def _qk_l2norm_kernel(
    q_ptr,
    k_ptr,
    qn_ptr,
    kn_ptr,
    rows,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    q_scale,
    DK: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """qn = l2norm(q) * q_scale and kn = l2norm(k), [T, H, DK] contiguous, once per prefill (the
    three chunk kernels then read them instead of normalising per (chunk, value head) program)."""
    i = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    d = tl.arange(0, BK)
    mask = (i < rows)[:, None] & (d < DK)[None, :]
    t, h = i // num_heads, i % num_heads
    if tl.program_id(1) == 0:
        x = tl.load(
            q_ptr + (t * stride_qt + h * stride_qh)[:, None] + d[None, :], mask=mask, other=0.0
        )
        y = _l2norm(x.to(tl.float32), 1e-6) * q_scale
        tl.store(qn_ptr + i[:, None] * DK + d[None, :], y.to(qn_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(
            k_ptr + (t * stride_kt + h * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0
        )
        y = _l2norm(x.to(tl.float32), 1e-6)
        tl.store(kn_ptr + i[:, None] * DK + d[None, :], y.to(kn_ptr.dtype.element_ty), mask=mask)


@jit
def _chunk_table_kernel(
    cu_ptr, table_ptr, offsets_ptr, batch, bound, MIN_LEN: tl.constexpr, CHUNK: tl.constexpr
):
    """One program: the [bound, 2] first/end token of every CHUNK-row chunk of the requests longer
    than MIN_LEN (entries past the last chunk empty), and [B] each request's first chunk."""
    n = 0
    for b in range(batch):
        start = tl.load(cu_ptr + b)
        end = tl.load(cu_ptr + b + 1)
        tl.store(offsets_ptr + b, n)
        if end - start > MIN_LEN:
            for c in range(start, end, CHUNK):
                tl.store(table_ptr + 2 * n, c)
                tl.store(table_ptr + 2 * n + 1, tl.minimum(c + CHUNK, end))
                n += 1
    for e in range(n, bound):
        tl.store(table_ptr + 2 * e, 0)
        tl.store(table_ptr + 2 * e + 1, 0)


def _chunk_tables(
    cu_seqlens: torch.Tensor, num_tokens: int, min_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk table sized by a host bound (num_tokens // CHUNK + B chunks), filled on the device:
    no sync, so a prefill step does not wait for the GPU to drain before launching."""
    batch = cu_seqlens.shape[0] - 1
    bound = num_tokens // CHUNK + batch
    table = torch.empty(bound, 2, dtype=torch.int32, device=cu_seqlens.device)
    offsets = torch.empty(batch, dtype=torch.int32, device=cu_seqlens.device)
    _chunk_table_kernel[(1,)](
        cu_seqlens, table, offsets, batch, bound, MIN_LEN=min_len, CHUNK=CHUNK, num_warps=1
    )
    return table, offsets


def gdn_chunked_triton(
    q,
    k,
    v,
    g,
    beta,
    ssm_states,
    state_slots,
    cu_seqlens,
    has_initial_state,
    *,
    min_len: int = 0,  # skip requests with at most this many rows (they go to the recurrent kernel)
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked prefill (chunk 64, fp32 state); same result as gdn_chunked_ref."""
    _check_gdn(q, k, v, g, beta, ssm_states)
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    if num_tokens == 0 or state_slots.shape[0] == 0:
        return out
    chunks, offsets = _chunk_tables(cu_seqlens, num_tokens, min_len)
    num_chunks = chunks.shape[0]
    group = num_v_heads // num_k_heads
    dot = _dot_mode(v.dtype)
    # intermediates that only feed 16-bit dots are kept in that type (half the traffic)
    low = torch.float32 if dot == "ieee" else v.dtype
    dev = v.device
    w = torch.empty(num_tokens, num_v_heads, dk, dtype=low, device=dev)
    u = torch.empty(num_tokens, num_v_heads, dv, dtype=low, device=dev)  # feeds only v_new
    v_new = torch.empty(num_tokens, num_v_heads, dv, dtype=low, device=dev)
    gcum = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=dev)
    h_chunks = torch.empty(num_chunks, num_v_heads, dk, dv, dtype=low, device=dev)
    min_tile = 1 if dot == "ieee" else MIN_TILE_16BIT
    bk, bdv = max(next_pow2(dk), min_tile), max(next_pow2(dv), min_tile)
    # q (with Dk^-0.5 folded in) and k normalised once, in the dots' 16-bit type: 75-90 us less
    # than normalising in every (chunk, value head) program at 8k tokens on the H200
    qn = torch.empty(num_tokens, num_k_heads, dk, dtype=low, device=dev)
    kn = torch.empty_like(qn)
    rows, block_r = num_tokens * num_k_heads, 16
    _qk_l2norm_kernel[(-(-rows // block_r), 2)](
        q, k, qn, kn, rows, num_k_heads, *q.stride()[:2], *k.stride()[:2], dk**-0.5,
        DK=dk, BK=bk, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
    common = dict(DK=dk, DV=dv, BK=bk, CHUNK=CHUNK, DOT=dot)
    _gdn_chunk_prep_kernel[(num_chunks, num_v_heads)](
        kn,
        v,
        g,
        beta,
        w,
        u,
        gcum,
        chunks,
        kn.stride(0),
        kn.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        num_v_heads,
        GROUP=group,
        BDV=bdv,
        INV_DOT="ieee" if dot == "ieee" else "tf32",
        num_warps=TUNING["prep_warps"],
        **common,
    )
    batch = state_slots.shape[0]
    bv = min(bdv, TUNING["scan_bv"])
    scan_warps = TUNING["scan_warps"] or (8 if bk * bv >= 128 * 64 else 4)
    _gdn_chunk_scan_kernel[(batch, num_v_heads, -(-dv // bv))](
        w,
        u,
        kn,
        gcum,
        v_new,
        h_chunks,
        ssm_states,
        state_slots,
        cu_seqlens,
        has_initial_state,
        offsets,
        kn.stride(0),
        kn.stride(1),
        ssm_states.stride(0),
        ssm_states.stride(1),
        num_v_heads,
        GROUP=group,
        BV=bv,
        MIN_LEN=min_len,
        num_warps=scan_warps,
        num_stages=2,
        **common,
    )
    bvo = min(bdv, TUNING["out_bv"])
    _gdn_chunk_out_kernel[(num_chunks, num_v_heads, -(-dv // bvo))](
        qn,
        kn,
        gcum,
        v_new,
        h_chunks,
        out,
        chunks,
        qn.stride(0),
        qn.stride(1),
        kn.stride(0),
        kn.stride(1),
        out.stride(0),
        out.stride(1),
        num_v_heads,
        GROUP=group,
        BV=bvo,
        num_warps=TUNING["out_warps"],
        **common,
    )
    return out
