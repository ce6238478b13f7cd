"""Gated DeltaNet (gated delta rule) with per-request fp32 state: chunked prefill and token recurrence,
varlen over requests. Called by appliance/models/layers/gdn.py.

Per value head: S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t,
with q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5. q/k heads are shared by Hv/Hk value heads
(value head h uses key head h // (Hv/Hk)). ssm_states[state_slot] is [Hv, Dk, Dv] fp32, read when
has_initial_state and overwritten with the final state.
"""

from __future__ import annotations

import torch

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
    """One sequence. q,k [L,H,Dk], v [L,H,Dv], g,beta [L,H], state [H,Dk,Dv] -> (o [L,H,Dv], state)."""
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
    return _run(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state,
                lambda n: _chunked_one)


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
    return _run(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state,
                lambda n: _recurrent_one)


def gdn_ref(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state):
    """What the model calls: recurrence for one-token rows (decode), chunked for longer ones, per
    request, so a request computes the same way alone or in a mixed batch."""
    return _run(q, k, v, g, beta, ssm_states, state_slots, cu_seqlens, has_initial_state,
                lambda n: _recurrent_one if n == 1 else _chunked_one)
