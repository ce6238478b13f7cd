"""Gated DeltaNet (gated delta rule) with per-request fp32 state: chunked prefill and token
recurrence,
varlen over requests. Called by appliance/models/layers/gdn.py.

Per value head: S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t,
with q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5. q/k heads are shared by Hv/Hk value
heads
(value head h uses key head h // (Hv/Hk)). ssm_states[state_slot] is [Hv, Dk, Dv] fp32, read when
has_initial_state and overwritten with the final state.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl, use_triton

CHUNK = 64


def _prep(q, k, v, g, beta, num_v_heads):
    group = num_v_heads // q.shape[1]
    q = q.float().repeat_interleave(group, dim=1)
    k = k.float().repeat_interleave(group, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    return q, k, v.float(), g.float(), beta.float()


def _chunked_one(q, k, v, g, beta, state):
    """One sequence. q,k [L,H,Dk], v [L,H,Dv], g,beta [L,H], state [H,Dk,Dv] -> (o [L,H,Dv],
    state)."""
    length = q.shape[0]
    outs = []
    for c0 in range(0, length, CHUNK):
        qc, kc, vc = (t[c0 : c0 + CHUNK].transpose(0, 1) for t in (q, k, v))  # [H, C, D]
        gc, bc = (t[c0 : c0 + CHUNK].transpose(0, 1) for t in (g, beta))  # [H, C]
        n = qc.shape[1]
        cum = gc.cumsum(-1)  # [H, C] log decay from chunk start
        diff = cum[:, :, None] - cum[:, None, :]  # [H, C, C] G_i - G_j
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
        k_beta = kc * bc[..., None]
        lower = (k_beta @ kc.transpose(1, 2)) * decay
        system = torch.eye(n, device=q.device) + lower.tril(-1)
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False)
        w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False)
        v_new = u - w @ state  # [H, C, Dv]
        attn = (qc @ kc.transpose(1, 2)) * decay  # [H, C, C]
        out = (qc * cum.exp()[..., None]) @ state + attn @ v_new
        last = cum[:, -1:]  # [H, 1]
        k_tail = kc * (last - cum).exp()[..., None]
        state = state * last.exp()[..., None] + k_tail.transpose(1, 2) @ v_new
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0), state


def _recurrent_one(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][:, :, None]).sum(1)  # [H, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(outs, dim=0), state


def _run(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state, pick):
    num_v_heads = v.shape[1]
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, num_v_heads)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu = cu_seqlens.tolist()
    for b, (slot, has_init) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        if has_init:
            state = ssm_states[slot].float()
        else:
            state = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=v.device)
        o, state = pick(e - s)(qf[s:e], kf[s:e], vf[s:e], gf[s:e], bf[s:e], state)
        out[s:e] = o.to(v.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def gdn_chunked_ref(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] fp32
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
) -> torch.Tensor:
    """Chunked (UT-transform) algorithm, chunk 64; returns [T, Hv, Dv] in v's dtype."""
    return _run(
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        state_slots,
        cu_seqlens,
        has_initial_state,
        lambda n: _chunked_one,
    )


def gdn_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token recurrence (decode); same signature and result as gdn_chunked_ref."""
    return _run(
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        state_slots,
        cu_seqlens,
        has_initial_state,
        lambda n: _recurrent_one,
    )


def gdn_ref(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state):
    """What the model calls: recurrence for one-token rows (decode), chunked for longer ones, per
    request, so a request computes the same way alone or in a mixed batch."""
    return _run(
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        state_slots,
        cu_seqlens,
        has_initial_state,
        lambda n: _recurrent_one if n == 1 else _chunked_one,
    )


def gdn_verify_ref(
    q: torch.Tensor,  # [T, Hk, Dk] — each request's rows are its MTP verify rows
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] committed state (read only here)
    ssm_candidates: torch.Tensor,  # [num_state_slots, max_rows, Hv, Dk, Dv] state after each row
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
) -> torch.Tensor:
    """Recurrence over verify rows from the committed state, keeping one candidate state per row so
    that accepting row j commits candidate j (see commit in appliance/engine/mtp.py)."""
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, v.shape[1])
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        s, e = cu[b], cu[b + 1]
        state = ssm_states[slot].float()
        for j in range(e - s):
            o, state = _recurrent_one(
                qf[s + j : s + j + 1],
                kf[s + j : s + j + 1],
                vf[s + j : s + j + 1],
                gf[s + j : s + j + 1],
                bf[s + j : s + j + 1],
                state,
            )
            out[s + j] = o[0].to(v.dtype)
            ssm_candidates[slot, j] = state.to(ssm_candidates.dtype)
    return out


# -------------------------------------------------------------------------------------------------
# Triton. Decode / verify rows: one program per (request, value head, block of value columns)
# carries its [Dk, BV] slice of the state in registers through the request's rows. Prefill, three
# kernels:
#   prep (parallel over chunks x heads): UT transform w = T (k beta e^G), u = T (v beta) with
#       T = (I + A)^-1, and k~ = k e^(G_last - G) (the key as it enters the chunk-end state);
#   scan (per request x head x value block, sequential over chunks): v_new = u - w h, h_c saved,
#       h <- e^(G_last) h + k~^T v_new;
#   out (parallel over chunks x heads): o = (q e^G) h_c + (q k^T * decay, causal) v_new.
# q/k/v/g/beta may be strided views (token and head strides free, last dim contiguous).
# -------------------------------------------------------------------------------------------------

RECURRENT_MAX_ROWS = 8  # requests with at most this many rows use the recurrent kernel


@jit
def _l2norm(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + eps))


@jit
def _gdn_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    state_ptr,
    cand_ptr,
    state_slots_ptr,
    cu_ptr,
    has_init_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_cs,
    stride_cr,
    stride_ch,
    scale,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    MAX_LEN: tl.constexpr,
    VERIFY: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    skip = length == 0
    if MAX_LEN > 0:
        skip = skip | (length > MAX_LEN)
    if skip:
        return
    hk = hv // GROUP
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = kk < DK
    v_ok = vv < DV
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_offs = kk[:, None] * DV + vv[None, :]
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    if VERIFY or tl.load(has_init_ptr + b) != 0:
        h = tl.load(state_ptr + slot * stride_ss + hv * stride_sh + s_offs, mask=s_mask, other=0.0)
    else:
        h = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, length):
        t = start.to(tl.int64) + i
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + kk, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + vv, mask=v_ok, other=0.0)
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + hv * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + hv * stride_bh).to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, 0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        h = h * tl.exp(g)
        delta = (v - tl.sum(h * k[:, None], 0)) * beta  # [BV]
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], 0)
        tl.store(
            out_ptr + t * stride_ot + hv * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok
        )
        if VERIFY:  # one candidate state per verify row; the committed state stays as it was
            tl.store(
                cand_ptr + slot * stride_cs + i * stride_cr + hv * stride_ch + s_offs,
                h,
                mask=s_mask,
            )
    if not VERIFY:
        tl.store(state_ptr + slot * stride_ss + hv * stride_sh + s_offs, h, mask=s_mask)


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
    ktail_ptr,
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
    r = tl.arange(0, CHUNK)
    t = (start + r).to(tl.int64)
    row_ok = start + r < end
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BDV)
    k_mask = row_ok[:, None] & (kk < DK)[None, :]
    v_mask = row_ok[:, None] & (vv < DV)[None, :]
    k = tl.load(
        k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=k_mask, other=0.0
    ).to(tl.float32)
    k = _l2norm(k, 1e-6)
    v = tl.load(
        v_ptr + t[:, None] * stride_vt + hv * stride_vh + vv[None, :], mask=v_mask, other=0.0
    ).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + hv * stride_gh, mask=row_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_bt + hv * stride_bh, mask=row_ok, other=0.0).to(tl.float32)
    big_g = tl.cumsum(g, 0)  # [C] log decay since the chunk start (masked rows add 0)
    g_last = tl.max(tl.where(r == end - start - 1, big_g, float("-inf")), 0)

    below = r[:, None] > r[None, :]
    k_beta = k * beta[:, None]
    a = _mm(k_beta, tl.trans(k), DOT)
    a = tl.where(below, a * tl.exp(tl.where(below, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
    inv = _unit_lower_inverse(a, r, INV_DOT)
    w = _mm(inv, k_beta * tl.exp(big_g)[:, None], DOT)  # [C, BK]
    u = _mm(inv, v * beta[:, None], DOT)  # [C, BDV]
    k_tail = k * tl.where(row_ok, tl.exp(g_last - big_g), 0.0)[:, None]
    row = t * num_v_heads + hv
    out_k = row[:, None] * DK + kk[None, :]
    tl.store(w_ptr + out_k, w.to(w_ptr.dtype.element_ty), mask=k_mask)
    tl.store(ktail_ptr + out_k, k_tail.to(ktail_ptr.dtype.element_ty), mask=k_mask)
    tl.store(u_ptr + row[:, None] * DV + vv[None, :], u, mask=v_mask)
    tl.store(gcum_ptr + row, big_g, mask=row_ok)


@jit
def _gdn_chunk_scan_kernel(
    w_ptr,
    u_ptr,
    ktail_ptr,
    gcum_ptr,
    vnew_ptr,
    hbuf_ptr,
    state_ptr,
    state_slots_ptr,
    cu_ptr,
    has_init_ptr,
    chunk_offsets_ptr,
    stride_ss,
    stride_sh,
    num_v_heads,
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
        k_tail_t = tl.load(
            ktail_ptr + row[None, :] * DK + kk[:, None],
            mask=row_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BK, C]
        last = (tl.minimum(c0 + CHUNK, end) - 1).to(tl.int64)
        g_last = tl.load(gcum_ptr + last * num_v_heads + hv)
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
    scale,
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
    ).to(tl.float32)
    k = tl.load(
        k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=qk_mask, other=0.0
    ).to(tl.float32)
    q = _l2norm(q, 1e-6) * scale
    k = _l2norm(k, 1e-6)
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
    o = _mm(q * tl.exp(big_g)[:, None], h, DOT) + _mm(scores, v_new, DOT)
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


def _recurrent_launch(
    q,
    k,
    v,
    g,
    beta,
    ssm_states,
    candidates,
    state_slots,
    cu_seqlens,
    has_initial_state,
    max_len,
    out,
):
    _check_gdn(q, k, v, g, beta, ssm_states)
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    batch = state_slots.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    bk, bv = next_pow2(dk), min(next_pow2(dv), 32)
    verify = candidates is not None
    cand = candidates if verify else ssm_states
    _gdn_recurrent_kernel[(batch, num_v_heads, -(-dv // bv))](
        q,
        k,
        v,
        g,
        beta,
        out,
        ssm_states,
        cand,
        state_slots,
        cu_seqlens,
        has_initial_state if has_initial_state is not None else state_slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        ssm_states.stride(0),
        ssm_states.stride(1),
        cand.stride(0),
        cand.stride(1) if verify else 0,
        cand.stride(2) if verify else 0,
        dk**-0.5,
        GROUP=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        MAX_LEN=max_len,
        VERIFY=verify,
        num_warps=4 if bk * bv <= 4096 else 8,
    )
    return out


def gdn_recurrent_triton(
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
    max_len: int = 0,  # >0: skip requests with more rows (they go to the chunked kernels)
    out: torch.Tensor | None = None,  # [T, Hv, Dv]
) -> torch.Tensor:
    """Fused recurrent decode over varlen rows; same result as gdn_recurrent_ref."""
    return _recurrent_launch(
        q, k, v, g, beta, ssm_states, None, state_slots, cu_seqlens, has_initial_state, max_len, out
    )


def gdn_verify_triton(
    q,
    k,
    v,
    g,
    beta,
    ssm_states,
    ssm_candidates,
    state_slots,
    cu_seqlens,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MTP verify rows: same result as gdn_verify_ref (candidates[slot, j] = state after row j)."""
    if ssm_candidates.stride(-1) != 1 or ssm_candidates.shape[2:] != ssm_states.shape[1:]:
        raise ValueError(f"gdn_verify: candidates {ssm_candidates.shape} vs {ssm_states.shape}")
    return _recurrent_launch(
        q, k, v, g, beta, ssm_states, ssm_candidates, state_slots, cu_seqlens, None, 0, out
    )


def _chunk_tables(cu_seqlens: torch.Tensor, min_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_chunks, 2] first/end token of every CHUNK-row chunk of the requests longer than
    min_len, [B] index of each request's first chunk); built on the host (prefill is not
    graph-captured)."""
    cu = cu_seqlens.tolist()
    rows, offsets = [], []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        offsets.append(len(rows))
        if e - s > min_len:
            rows.extend((c, min(c + CHUNK, e)) for c in range(s, e, CHUNK))
    device = cu_seqlens.device
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    return table.to(device, non_blocking=True), torch.tensor(offsets, dtype=torch.int32).to(device)


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
    chunks, offsets = _chunk_tables(cu_seqlens, min_len)
    num_chunks = chunks.shape[0]
    if num_chunks == 0:
        return out
    group = num_v_heads // num_k_heads
    dot = _dot_mode(v.dtype)
    # intermediates that only feed 16-bit dots are kept in that type (half the traffic)
    low = torch.float32 if dot == "ieee" else v.dtype
    dev = v.device
    w = torch.empty(num_tokens, num_v_heads, dk, dtype=low, device=dev)
    k_tail = torch.empty(num_tokens, num_v_heads, dk, dtype=low, device=dev)
    u = torch.empty(num_tokens, num_v_heads, dv, dtype=torch.float32, device=dev)
    v_new = torch.empty(num_tokens, num_v_heads, dv, dtype=low, device=dev)
    gcum = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=dev)
    h_chunks = torch.empty(num_chunks, num_v_heads, dk, dv, dtype=low, device=dev)
    bk, bdv = next_pow2(dk), next_pow2(dv)
    common = dict(DK=dk, DV=dv, BK=bk, CHUNK=CHUNK, DOT=dot)
    _gdn_chunk_prep_kernel[(num_chunks, num_v_heads)](
        k,
        v,
        g,
        beta,
        w,
        u,
        k_tail,
        gcum,
        chunks,
        k.stride(0),
        k.stride(1),
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
        num_warps=4,
        **common,
    )
    batch = state_slots.shape[0]
    bv = min(bdv, 64)
    _gdn_chunk_scan_kernel[(batch, num_v_heads, -(-dv // bv))](
        w,
        u,
        k_tail,
        gcum,
        v_new,
        h_chunks,
        ssm_states,
        state_slots,
        cu_seqlens,
        has_initial_state,
        offsets,
        ssm_states.stride(0),
        ssm_states.stride(1),
        num_v_heads,
        BV=bv,
        MIN_LEN=min_len,
        num_warps=8 if bk * bv >= 128 * 64 else 4,
        num_stages=2,
        **common,
    )
    bvo = min(bdv, 64)
    _gdn_chunk_out_kernel[(num_chunks, num_v_heads, -(-dv // bvo))](
        q,
        k,
        gcum,
        v_new,
        h_chunks,
        out,
        chunks,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        dk**-0.5,
        num_v_heads,
        GROUP=group,
        BV=bvo,
        num_warps=4,
        **common,
    )
    return out


def gdn(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] fp32
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    *,
    max_q_len: int | None = None,  # host bound on rows per request; given: no device sync
) -> torch.Tensor:
    """Dispatcher used by the model layers (the gdn_ref contract). On CUDA, requests with at most
    RECURRENT_MAX_ROWS rows run the fused recurrent kernel and longer ones the chunked prefill
    backend chosen in kernels.backends; on CPU the reference runs."""
    args = (q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state)
    if not use_triton(q):
        return gdn_ref(*args)
    if max_q_len is None:
        max_q_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if len(state_slots) else 0
    if max_q_len <= RECURRENT_MAX_ROWS:
        return gdn_recurrent_triton(*args)
    from kernels import backends

    backend = backends.selected("gdn_prefill")
    if backend == "torch":
        return gdn_ref(*args)
    out = gdn_recurrent_triton(*args, max_len=RECURRENT_MAX_ROWS)
    if backend == "triton":
        return gdn_chunked_triton(*args, min_len=RECURRENT_MAX_ROWS, out=out)
    from kernels.adapters import gdn_chunked_external

    return gdn_chunked_external(backend, *args, min_len=RECURRENT_MAX_ROWS, out=out)


def gdn_verify(
    q: torch.Tensor,  # [T, Hk, Dk] MTP verify rows
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] committed (read only)
    ssm_candidates: torch.Tensor,  # [num_state_slots, max_rows, Hv, Dk, Dv]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
) -> torch.Tensor:
    """Dispatcher for the gdn_verify_ref contract: Triton on CUDA, the reference elsewhere."""
    if use_triton(q):
        return gdn_verify_triton(
            q, k, v, g, beta, ssm_states, ssm_candidates, state_slots, cu_seqlens
        )
    return gdn_verify_ref(q, k, v, g, beta, ssm_states, ssm_candidates, state_slots, cu_seqlens)
