"""Attention over the token-granular KV pool: one op for decode, MTP verify rows and varlen prefill with
a cached prefix. Called by appliance/models/layers/attention.py.

Layout: request b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (q_len rows) and has seq_lens[b]
tokens in the KV after this step; query row j sits at position seq_lens[b] - q_len + j and attends
causally to KV positions 0..that position, whose slots are req_to_token[req_slots[b], :seq_len].
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    kv_slots: torch.Tensor,  # [T] int64
) -> None:
    k_cache[kv_slots] = k.to(k_cache.dtype)
    v_cache[kv_slots] = v.to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_len] int -> kv slot
    req_slots: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    """Returns [T, Hq, D] in q's dtype; softmax in fp32."""
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    slots = req_slots.tolist()
    for b, (slot, kv_len) in enumerate(zip(slots, lens)):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        kv_idx = req_to_token[slot, :kv_len].long()
        k = k_cache[kv_idx].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[kv_idx].float().repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
