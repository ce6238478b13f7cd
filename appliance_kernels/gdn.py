"""Gated DeltaNet (gated delta rule) with per-request fp32 state: chunked prefill and token
recurrence, varlen over requests. Called by appliance/models/layers/gdn.py.

Per value head: S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t,
with q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5. q/k heads are shared by Hv/Hk value
heads (value head h uses key head h // (Hv/Hk)). ssm_states[state_slot] is [Hv, Dk, Dv] fp32, read
when has_initial_state and overwritten with the final state.
"""

from __future__ import annotations

import torch

from appliance_kernels.gdn_chunk import CHUNK, _check_gdn, gdn_chunked_triton
from appliance_kernels.gdn_gate import RawGates, gate_values, gdn_gating
from appliance_kernels.head_norm import GateNorm, PendingHeadNorm, split_gated_norm_ref
from appliance_kernels.triton_utils import (
    jit,
    next_pow2,
    pdl,
    pdl_release,
    pdl_wait,
    tl,
    use_triton,
)


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
# Under PDL the recurrent kernel reads its programs' state (and the batch's row offsets, slots and
# flags, which the host writes before the step) before it waits for the kernel before it: only
# q, k, v and the gates come from that kernel (the GDN in_proj GEMV or the conv). The state was
# last written by this layer's recurrence a step earlier (or between steps, by MTP's commit and
# the prefix cache's copies), long finished by then: every kernel since has waited on the one
# before it. On the H200 (run CZ in docs/benchmarks.md, with fp8_gemv.CONV_RELEASE) it took
# 0.04-0.06 ms off the overlapped 27B batch-1 step (ops/bench/bench_static.py --gdn-preload), on
# an H100 0.05 ms (run ES); there (runs EQ, ER) the engine's GPU tests pass with it, and eager
# steps and captured graphs give the same tokens and SSM states, bit for bit, with it and without.
PRELOAD_STATE = True
# The recurrent kernel's value columns a program (BV) and warps. Default (None): 32 columns, 4 warps
# ([128, 32] of fp32 state a program; 8 warps above 4096 elements): 192 programs for the 27B's 48
# value heads at batch 1, under two an SM. Narrower blocks give more programs (more loads in flight
# at batch 1, the q / k normalisation repeated by each); `ops/bench/bench_static.py --gdn-tile`
# sets it. On the H100 (runs DM, DS) 16 columns, 4 warps gained nothing at batch 1 and cost the
# 27B step 1.1 ms at batch 16 and 4.7 ms at batch 64; not yet timed on the H200.
RECURRENT_TILE: dict[str, int] | None = None


def recurrent_tile(dk: int, dv: int) -> tuple[int, int, int]:
    """(BK, BV, warps) of the recurrent kernel for heads of dk x dv."""
    bk = next_pow2(dk)
    if RECURRENT_TILE is not None:
        bv = min(next_pow2(dv), RECURRENT_TILE["bv"])
        return bk, bv, RECURRENT_TILE["warps"]
    bv = min(next_pow2(dv), 32)
    return bk, bv, 4 if bk * bv <= 4096 else 8


@jit
def _gdn_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,  # RAW_GATES: the gate input a [T, Hv]
    beta_ptr,  # RAW_GATES: b [T, Hv]
    a_log_ptr,  # RAW_GATES: A_log [Hv], dt_bias [Hv] (else unread)
    dt_bias_ptr,
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
    z_ptr,  # GATE_NORM: the gate [T, Hv, Dv], the norm's weight [Dv], the partials [T, Hv, NB]
    nw_ptr,
    hp_ptr,
    stride_zt,
    stride_zh,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    MAX_LEN: tl.constexpr,
    VERIFY: tl.constexpr,
    RAW_GATES: tl.constexpr = False,  # g / beta computed here from a, b (gdn_gate.py)
    PRELOAD: tl.constexpr = False,  # the state read before the PDL wait (PRELOAD_STATE)
    GATE_NORM: tl.constexpr = False,  # the split gated norm's producer (head_norm.py)
    PDL: tl.constexpr = False,
):
    pdl_release(PDL)
    if not PRELOAD:
        pdl_wait(PDL)
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
    if RAW_GATES:
        a_log = tl.load(a_log_ptr + hv).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    if PRELOAD:  # q, k, v and the gates come from the kernel before this one
        pdl_wait(PDL)
    for i in range(0, length):
        t = start.to(tl.int64) + i
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + kk, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + vv, mask=v_ok, other=0.0)
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + hv * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + hv * stride_bh)
        if RAW_GATES:
            g, beta = gate_values(g, beta, a_log, dt_bias)
        beta = beta.to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, 0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        h = h * tl.exp(g)
        delta = (v - tl.sum(h * k[:, None], 0)) * beta  # [BV]
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], 0)
        if GATE_NORM:  # y = o * w * silu(z) and this block's sum of squares of o (as stored)
            o = o.to(out_ptr.dtype.element_ty).to(tl.float32)
            nb = tl.num_programs(2)
            part = hp_ptr + (t * tl.num_programs(1) + hv) * nb + tl.program_id(2)
            tl.store(part, tl.sum(o * o, 0))
            z = tl.load(z_ptr + t * stride_zt + hv * stride_zh + vv, mask=v_ok, other=0.0)
            z = z.to(tl.float32)
            nw = tl.load(nw_ptr + vv, mask=v_ok, other=0.0).to(tl.float32)
            o = o * nw * (z / (1.0 + tl.exp(-z)))
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
    raw: RawGates | None = None,  # given: g / beta are its a / b, gated inside the kernel
    gate_norm: GateNorm | None = None,  # given: the split gated norm's producer (head_norm.py)
):
    _check_gdn(q, k, v, g, beta, ssm_states)
    if raw is not None and (
        raw.a.stride(-1) != 1 or raw.b.stride(-1) != 1 or raw.A_log.shape != (v.shape[1],)
    ):
        raise ValueError(f"gdn: raw gates a {raw.a.shape} b {raw.b.shape} A_log {raw.A_log.shape}")
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    batch = state_slots.shape[0]
    if gate_norm is not None and max_len:
        raise ValueError("gdn: a gate norm needs every row in the recurrence (max_len 0)")
    if batch == 0 or num_tokens == 0:
        return out if gate_norm is None else split_gated_norm_ref(out, gate_norm, 1)
    bk, bv, warps = recurrent_tile(dk, dv)
    verify = candidates is not None
    cand = candidates if verify else ssm_states
    nb = -(-dv // bv)
    z = nw = partials = out
    if gate_norm is not None:
        z, nw = gate_norm.z, gate_norm.weight
        if z.shape != v.shape or z.stride(-1) != 1 or nw.shape != (dv,):
            raise ValueError(f"gdn: gate norm z {tuple(z.shape)} weight {tuple(nw.shape)}")
        partials = torch.empty(num_tokens, num_v_heads, nb, dtype=torch.float32, device=v.device)
    _gdn_recurrent_kernel[(batch, num_v_heads, nb)](
        q,
        k,
        v,
        g,
        beta,
        raw.A_log if raw is not None else g,
        raw.dt_bias if raw is not None else g,
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
        z,
        nw,
        partials,
        z.stride(0) if gate_norm is not None else 0,
        z.stride(1) if gate_norm is not None else 0,
        GROUP=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        MAX_LEN=max_len,
        VERIFY=verify,
        RAW_GATES=raw is not None,
        PRELOAD=PRELOAD_STATE,
        GATE_NORM=gate_norm is not None,
        num_warps=warps,
        **pdl(q),
    )
    if gate_norm is not None:
        return PendingHeadNorm(out.reshape(num_tokens, -1), partials, gate_norm.eps)
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
    gates: RawGates | None = None,  # given: g / beta (None) are computed from these
    gate_norm: GateNorm | None = None,  # given: a PendingHeadNorm (appliance_kernels/head_norm.py)
) -> torch.Tensor | PendingHeadNorm:
    """Fused recurrent decode over varlen rows; same result as gdn_recurrent_ref (with `gates`:
    as gdn_recurrent_ref on gdn_gating_ref(*gates); with `gate_norm`: as split_gated_norm_ref of
    that output)."""
    if gates is not None:
        g, beta = gates.a, gates.b
    return _recurrent_launch(
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        None,
        state_slots,
        cu_seqlens,
        has_initial_state,
        max_len,
        out,
        gates,
        gate_norm,
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
    gates: RawGates | None = None,  # given: g / beta (None) are computed from these
) -> torch.Tensor:
    """MTP verify rows: same result as gdn_verify_ref (candidates[slot, j] = state after row j)."""
    if ssm_candidates.stride(-1) != 1 or ssm_candidates.shape[2:] != ssm_states.shape[1:]:
        raise ValueError(f"gdn_verify: candidates {ssm_candidates.shape} vs {ssm_states.shape}")
    if gates is not None:
        g, beta = gates.a, gates.b
    return _recurrent_launch(
        q, k, v, g, beta, ssm_states, ssm_candidates, state_slots, cu_seqlens, None, 0, out, gates
    )


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
    backend chosen in appliance_kernels.backends; on CPU the reference runs."""
    args = (q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state)
    if not use_triton(q):
        return gdn_ref(*args)
    if max_q_len is None:
        max_q_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if len(state_slots) else 0
    if max_q_len <= RECURRENT_MAX_ROWS:
        return gdn_recurrent_triton(*args)
    from appliance_kernels import backends

    backend = backends.selected("gdn_prefill")
    if backend == "torch":
        return gdn_ref(*args)
    out = gdn_recurrent_triton(*args, max_len=RECURRENT_MAX_ROWS)
    if backend == "triton":
        return gdn_chunked_triton(*args, min_len=RECURRENT_MAX_ROWS, out=out)
    from appliance_kernels.adapters import gdn_chunked_external

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


def gdn_gated(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    gates: RawGates,  # a / b [T, Hv], A_log / dt_bias [Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] fp32
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    *,
    max_q_len: int | None = None,  # host bound on rows per request; given: no device sync
    gate_norm: GateNorm | None = None,  # given: a PendingHeadNorm (appliance_kernels/head_norm.py)
) -> torch.Tensor | PendingHeadNorm:
    """gdn() on gdn_gating(*gates). Decode-sized batches (every request at most
    RECURRENT_MAX_ROWS rows, known from max_q_len) run the recurrence with the gates computed
    inside it, one launch where the separate gating kernel made two; others gate first. With
    `gate_norm` the output is split_gated_norm_ref's (inside the recurrence where it runs)."""
    state_args = (ssm_states, state_slots, cu_seqlens, has_initial_state)
    if use_triton(q) and max_q_len is not None and max_q_len <= RECURRENT_MAX_ROWS:
        return gdn_recurrent_triton(
            q, k, v, None, None, *state_args, gates=gates, gate_norm=gate_norm
        )
    g, beta = gdn_gating(*gates)
    out = gdn(q, k, v, g, beta, *state_args, max_q_len=max_q_len)
    if gate_norm is None:
        return out
    return split_gated_norm_ref(out, gate_norm, 1)


def gdn_verify_gated(
    q: torch.Tensor,  # [T, Hk, Dk] MTP verify rows
    k: torch.Tensor,
    v: torch.Tensor,  # [T, Hv, Dv]
    gates: RawGates,  # a / b [T, Hv], A_log / dt_bias [Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] committed (read only)
    ssm_candidates: torch.Tensor,  # [num_state_slots, max_rows, Hv, Dk, Dv]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
) -> torch.Tensor:
    """gdn_verify() on gdn_gating(*gates); on CUDA the gates are computed inside the kernel."""
    args = (ssm_states, ssm_candidates, state_slots, cu_seqlens)
    if use_triton(q):
        return gdn_verify_triton(q, k, v, None, None, *args, gates=gates)
    return gdn_verify(q, k, v, *gdn_gating(*gates), *args)
