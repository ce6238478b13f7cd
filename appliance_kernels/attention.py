"""Attention over the token-granular KV pool: one op for decode, MTP verify rows and varlen prefill
with a cached prefix. Called by appliance/models/layers/attention.py.

Layout: request b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (q_len rows) and has seq_lens[b]
tokens in the KV after this step; query row j sits at position seq_lens[b] - q_len + j and attends
causally to KV positions 0..that position, whose slots are req_to_token[req_slots[b], :seq_len].

An fp8 (e4m3) cache (appliance_kernels/kv_cache.py writes it) holds k / k_scale and v / v_scale;
the scales are read through device pointers, so CUDA graphs replay with whatever the loader put
there. Reads dequantise: k_scale folds into the softmax scale,
v_scale into the output. With a bf16 q the dots of an fp8 cache run in fp16 (every e4m3 value is
an fp16 one, and e4m3 -> fp16 is one conversion per pair where e4m3 -> bf16 goes through fp32);
the decode reads the fp8 V as int16 words of two columns, so the PV dot's operand loads take whole
words where e4m3 columns (keys along the dot's K) would be read a byte at a time.
"""

from __future__ import annotations

import torch

from appliance_kernels.kv_cache import KVScales, check_kv_scales, dequantize_kv_ref, is_fp8_cache
from appliance_kernels.triton_utils import (
    HAS_TRITON,
    check_last_dim_contiguous,
    jit,
    next_pow2,
    num_sms,
    pdl,
    pdl_start,
    tl,
    triton,
    use_triton,
)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_len] int -> kv slot
    req_slots: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] fp32 dequantisation scales of an fp8 cache
    v_scale: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,  # [T, Hq, D]: output * sigmoid(gate) (Qwen3.5's gate)
) -> torch.Tensor:
    """Returns [T, Hq, D] in q's dtype; softmax in fp32 (and the gate's product)."""
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
        k = dequantize_kv_ref(k_cache[kv_idx], k_scale).repeat_interleave(group, dim=1)  # [L,Hq,D]
        v = dequantize_kv_ref(v_cache[kv_idx], v_scale).repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, v)
        if gate is not None:
            o = o * torch.sigmoid(gate[q_start:q_end].float())
        out[q_start:q_end] = o.to(q.dtype)
    return out


# -------------------------------------------------------------------------------------------------
# Triton: one kernel for decode, verify rows and prefill. A program owns (request, block of query
# rows, kv head, kv split); its M rows are (query row, q head of the GQA group) pairs, so K/V tiles
# gathered through req_to_token are loaded once per group. Long KV with few programs is split
# (flash-decoding) and the partial results are merged by a second kernel. Prefill block sizes are
# autotuned on the GPU.
# -------------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


@jit
def _e4m3_pairs_as_f16(v, ASM: tl.constexpr):
    """int16 words each holding two e4m3 bytes -> (low byte, high byte) as fp16, in the words'
    layout (the dot operand they were loaded in). ASM (CUDA): a byte permute gathers two words' low
    (high) bytes and one conversion widens the pair. Otherwise (the interpreter): shifts and masks
    move each byte's sign, exponent and mantissa into fp16's fields (e4m3's bias 7 read with fp16's
    15: 2^-8 of the value, subnormals included), then x 256."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            .reg .b16 l, h;
            prmt.b32 t, $2, 0, 0x3320;
            mov.b32 {l, h}, t;
            cvt.rn.f16x2.e4m3x2 $0, l;
            prmt.b32 t, $2, 0, 0x3331;
            mov.b32 {l, h}, t;
            cvt.rn.f16x2.e4m3x2 $1, l;
            }""",
            constraints="=r,=r,r",
            args=[v],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        lo = (((v << 8) & -32768) | ((v << 7) & 0x3F80)).to(tl.float16, bitcast=True) * 256.0
        hi = ((v & -32768) | ((v >> 1) & 0x3F80)).to(tl.float16, bitcast=True) * 256.0
    return lo, hi


@jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    start,
    hi,
    q_pos,
    r2t,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    qk_scale,
    d,
    d_ok,
    acc_hi,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PREC: tl.constexpr,
    FP8_KV: tl.constexpr,
    V_PAIRS: tl.constexpr,
    PAIRS_ASM: tl.constexpr,
):
    """One online-softmax step over keys start .. start+BLOCK_N; MASKED adds causal / end masks.
    V_PAIRS: the fp8 V read as int16 column pairs; acc holds the even columns, acc_hi the odd."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = n < hi
        slot = tl.load(r2t + n, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        slot = tl.load(r2t + n).to(tl.int64)
        kv_mask = d_ok[None, :]
    k = tl.load(
        k_cache_ptr + slot[:, None] * stride_kcs + kv_head * stride_kch + d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    if V_PAIRS:
        d2 = tl.arange(0, BLOCK_D // 2)
        v_mask = (d2 < HEAD_DIM // 2)[None, :]
        if MASKED:
            v_mask = n_ok[:, None] & v_mask
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_vcs + kv_head * stride_vch + d2[None, :],
            mask=v_mask,
            other=0,
        )  # [BLOCK_N, BLOCK_D // 2] int16: columns 2j (low byte) and 2j + 1 (high byte)
    else:
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_vcs + kv_head * stride_vch + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
    if FP8_KV:  # e4m3 tiles widened to q's dtype; their scales are folded in by the caller
        k = k.to(q.dtype)
        if not V_PAIRS:
            v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_PAIRS:
        v_lo, v_hi = _e4m3_pairs_as_f16(v, PAIRS_ASM)
        p = p.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p, v_lo)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc, acc_hi


@jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    req_to_token_ptr,
    req_slots_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    k_scale_ptr,  # [1] fp32 dequantisation scales of an fp8 cache (FP8_KV)
    v_scale_ptr,
    gate_ptr,  # [T, Hq, D] output gate (GATED; the merge applies it when the KV is split)
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_gt,
    stride_gh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ot,
    stride_oh,
    stride_r2t,
    stride_ps,
    stride_pt,
    stride_ls,
    stride_lt,
    q_bucket,  # autotuning key only: next power of two of the longest query (prefill path)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PREC: tl.constexpr,
    FP8_KV: tl.constexpr,
    F16_DOT: tl.constexpr,  # fp8 cache, bf16 q: dots in fp16 (one cvt per 2 e4m3 values)
    GATED: tl.constexpr = False,  # out * sigmoid(gate)
    PDL: tl.constexpr = False,
    V_PAIRS: tl.constexpr = False,  # fp8 V given as int16 [slots, Hkv, D / 2] (_e4m3_pairs_as_f16)
    PAIRS_ASM: tl.constexpr = False,  # their conversion in PTX (CUDA; not the interpreter)
):
    pdl_start(PDL)
    ROWS = BLOCK_M // GROUP  # query rows per program
    b = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    row0 = q_block * ROWS
    if row0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    req_slot = tl.load(req_slots_ptr + b).to(tl.int64)

    m = tl.arange(0, BLOCK_M)
    q_row = row0 + m // GROUP  # query row inside the request
    head = kv_head * GROUP + m % GROUP  # q head
    row_ok = (m < ROWS * GROUP) & (q_row < q_len)
    q_pos = seq_len - q_len + q_row  # absolute position of each query row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr
        + (q_start + q_row)[:, None].to(tl.int64) * stride_qt
        + head[:, None] * stride_qh
        + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if F16_DOT:  # the e4m3 tiles then widen to q's dtype in one instruction per pair
        q = q.to(tl.float16)

    # keys this block can see: up to the last row's position (causal), split evenly across programs
    kv_hi = tl.minimum(seq_len, seq_len - q_len + tl.minimum(row0 + ROWS, q_len))
    chunk = tl.cdiv(tl.cdiv(kv_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)
    # keys up to the first row's position are visible to every row: no mask for those blocks
    first_visible = tl.minimum(hi, seq_len - q_len + row0 + 1)
    unmasked_hi = lo + tl.maximum(first_visible - lo, 0) // BLOCK_N * BLOCK_N

    v_scale = 1.0
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if V_PAIRS:  # even and odd output columns
        acc = tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, 1], dtype=tl.float32)  # unused
    r2t = req_to_token_ptr + req_slot * stride_r2t
    for start in range(lo, unmasked_hi, BLOCK_N):
        m_i, l_i, acc, acc_hi = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            start,
            hi,
            q_pos,
            r2t,
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            stride_kcs,
            stride_kch,
            stride_vcs,
            stride_vch,
            qk_scale,
            d,
            d_ok,
            acc_hi,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            False,
            PREC,
            FP8_KV,
            V_PAIRS,
            PAIRS_ASM,
        )
    for start in range(unmasked_hi, hi, BLOCK_N):
        m_i, l_i, acc, acc_hi = _attend_block(
            q,
            m_i,
            l_i,
            acc,
            start,
            hi,
            q_pos,
            r2t,
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            stride_kcs,
            stride_kch,
            stride_vcs,
            stride_vch,
            qk_scale,
            d,
            d_ok,
            acc_hi,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            True,
            PREC,
            FP8_KV,
            V_PAIRS,
            PAIRS_ASM,
        )

    t_row = (q_start + q_row).to(tl.int64)
    out_mask = row_ok[:, None] & d_ok[None, :]
    if V_PAIRS:  # columns 2j, 2j + 1 side by side
        acc = tl.reshape(tl.join(acc, acc_hi), [BLOCK_M, BLOCK_D])
    o = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if NUM_SPLITS == 1:
        if GATED:
            gate = tl.load(
                gate_ptr + t_row[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :],
                mask=out_mask,
                other=0.0,
            )
            o = o * tl.sigmoid(gate.to(tl.float32))
        tl.store(
            out_ptr + t_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(
            part_o_ptr
            + split * stride_ps
            + t_row[:, None] * stride_pt
            + head[:, None] * HEAD_DIM
            + d[None, :],
            o,
            mask=out_mask,
        )
        tl.store(part_lse_ptr + split * stride_ls + t_row * stride_lt + head, lse, mask=row_ok)


def _prefill_configs() -> list:
    shapes = (
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (128, 64, 8, 2),
        (128, 32, 8, 2),
        (64, 32, 4, 3),
        (128, 128, 8, 2),
    )
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in shapes
    ]


# prefill (many query rows): block sizes tuned once per (group, head_dim, length class) on the GPU
_paged_attention_prefill = (
    triton.autotune(configs=_prefill_configs(), key=["GROUP", "HEAD_DIM", "q_bucket"])(
        _paged_attention_kernel
    )
    if HAS_TRITON
    else None
)


@jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    gate_ptr,
    stride_ps,
    stride_pt,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,  # a power of two <= NUM_SPLITS
    GATED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h)  # [S]
    m = tl.max(lse, 0)
    # the partial outputs SPLIT_CHUNK splits at a time, in a loop: [S, BLOCK_D] fp32 at once
    # spilled beyond 64 splits of a 256-wide head (compiled for sm_90 offline, Triton 3.6: 255
    # registers + 512 B stack at 128 splits, 3160 B at 256; the loop: 32 registers, no stack)
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    for s0 in tl.range(0, NUM_SPLITS, SPLIT_CHUNK):
        sc = s0 + tl.arange(0, SPLIT_CHUNK)
        # empty splits have lse -inf -> weight 0
        w_c = tl.exp2(tl.load(part_lse_ptr + sc * stride_ls + t * stride_lt + h) - m)
        total += tl.sum(w_c, 0)
        o_c = tl.load(
            part_o_ptr + sc[:, None] * stride_ps + t * stride_pt + h * HEAD_DIM + d[None, :],
            mask=d[None, :] < HEAD_DIM,
            other=0.0,
        )  # [SPLIT_CHUNK, BLOCK_D]
        o += tl.sum(o_c * w_c[:, None], 0)
    o = o / total
    if GATED:
        gate = tl.load(gate_ptr + t * stride_gt + h * stride_gh + d, mask=d < HEAD_DIM, other=0.0)
        o = o * tl.sigmoid(gate.to(tl.float32))
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# decode / verify launch knobs, swept by ops/gpu/gdn_probe.py on the H200 (27B heads, kv 4096):
# split_factor 1 (split the KV until there is about one program per SM) 84.0 us at B=16 decode
# vs 87.8 / 92.5 / 98.9 at 2 / 4 / 8; B=16 x 4 verify rows 93.5 vs 99.3 at 2
# fp8_tile: (BLOCK_N, num_stages, num_warps[, maxnreg]) of decode / verify over an fp8 cache
# (None: the bf16 cache's tiles, which hold half the bytes per stage in e4m3: AD measured that at
# half the GB/s).
# Run AG's sweep (bench_kv_fp8.py --sweep, 27B heads): a third stage of 64-key tiles took batch
# 16-64 at 8k-32k from 2.4-2.5 to 2.8-3.1 TB/s of fp8 bytes (1.21-1.37x bf16 against 1.01-1.15x).
# Run BF: widening V to fp16 before it is staged in shared memory (ldmatrix.trans instead of byte
# loads for the PV dot) was slower at every tile (1.00x at (64, 3, 4)); flashinfer's fp8 decode
# reached 1.24-1.34x its bf16 in the same run, against 1.28-1.38x here (batch 64, batch 16 at 32k).
# fp8_split_factor: split_factor over an fp8 cache. Runs CJ / CL: 2 or 4 programs per SM (1.22-1.32x
# at batch 64 and 16 x 32k against 1.35-1.41x for 1) and a register cap (maxnreg 168 / 128: 1.12-
# 1.17x / 0.75-0.94x) were slower; batch 16 at 8k stays erratic between runs whatever the setting.
# tile: the same override for a bf16 / fp16 cache (None: the tiles chosen below). Triton's software
# pipeliner keeps a single K / V buffer for keys gathered through req_to_token (an indirect load)
# below num_stages 5: the next tile is then fetched only after the current one's dots.
# Runs DI-DK (2026-12-04): the fp8 V read as int16 column pairs (fp8_v_pairs) took batch 64 and
# 16 x 32k from 2.9-3.1 to 3.4-3.5 TB/s of e4m3 (1.60-1.64x bf16 against 1.32-1.42x), and a second
# K / V buffer (64, 5, 4) to 3.65-3.76 TB/s (1.70-1.79x); bf16 gains nothing from 5 stages (its
# (64, 2, 4) reads 4.2-4.3 TB/s already).
ATTN_TUNING = {
    "max_block_m": 64,
    "split_factor": 1,
    "tile": None,
    "fp8_tile": (64, 5, 4),
    "fp8_split_factor": 1,
    "fp8_v_pairs": True,  # decode reads an fp8 V as int16 column pairs (_e4m3_pairs_as_f16)
    # the most KV splits a short query block gets (batch 1 x 4 kv heads: 128 programs at 32).
    # Runs DN / DO (graph-timed, bench_kv_fp8.py --max-splits): 64 or 128 cost 3 us a layer at
    # batch 1 x 8k on the H100 and the H200 and gained 2 us only on the H200 at 32k
    "max_splits": 32,
}


def _attention_splits(num_programs: int, max_q_len: int, device: torch.device, fp8: bool) -> int:
    """Split the KV only for short query blocks (decode, verify) that leave SMs idle: until there
    are split_factor programs per SM."""
    wanted = ATTN_TUNING["fp8_split_factor" if fp8 else "split_factor"] * num_sms(device)
    if max_q_len > 16 or num_programs >= wanted:
        return 1
    return min(next_pow2(-(-wanted // num_programs)), ATTN_TUNING["max_splits"])


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_len] int
    req_slots: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    max_q_len: int | None = None,  # host bound on q rows per request; given -> no device sync
    num_splits: int | None = None,  # KV splits (fixed for CUDA graphs); None -> heuristic
    out: torch.Tensor | None = None,  # [T, Hq, D]
    k_scale: torch.Tensor | None = None,  # [1] fp32; required by an fp8 cache
    v_scale: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,  # [T, Hq, D] (strided view): out * sigmoid(gate)
) -> torch.Tensor:
    """Same result as paged_attention_ref; q and gate may be strided views (last dim
    contiguous)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if gate is not None:
        check_last_dim_contiguous("gate", gate)
        if gate.shape != q.shape:
            raise ValueError(f"paged_attention: gate {tuple(gate.shape)} vs q {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_q_heads % num_kv_heads or k_cache.shape[2] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {q.shape} vs cache {k_cache.shape}/{v_cache.shape}")
    fp8 = check_kv_scales("paged_attention", k_cache, v_cache, k_scale, v_scale)
    if req_to_token.stride(1) != 1:
        raise ValueError("paged_attention: req_to_token rows must be contiguous")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    batch = req_slots.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    strides = (
        q.stride(0),
        q.stride(1),
        gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
    )
    fixed = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_KV=fp8,
        F16_DOT=fp8 and q.dtype in (torch.bfloat16, torch.float16),
    )
    tensors = (q, k_cache, v_cache, out)
    kv_scales = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)  # unread without FP8_KV
    gated = gate is not None
    gate_t = gate if gated else q  # unread without GATED
    meta = (req_to_token, req_slots, cu_seqlens_q, seq_lens, *kv_scales, gate_t, scale * _LOG2E)
    if max_q_len > 16 and q.is_cuda and num_splits in (None, 1):

        def grid(cfg):
            return (batch, -(-max_q_len // (cfg["BLOCK_M"] // group)), num_kv_heads)

        _paged_attention_prefill[grid](
            *tensors,
            out,
            out,
            *meta,
            *strides,
            0,
            0,
            0,
            0,
            min(next_pow2(max_q_len), 4096),
            NUM_SPLITS=1,
            GATED=gated,
            **fixed,
        )
        return out
    # rows of a program = query rows x the q heads of one kv head; the smallest tile holding a
    # request's verify rows (k + 1 <= 4 rows x group 6 -> 32) keeps the dots small
    block_m = max(16, next_pow2(group))
    if max_q_len * group > 16:
        block_m = max(block_m, min(ATTN_TUNING["max_block_m"], next_pow2(max_q_len * group)))
    num_q_blocks = -(-max_q_len // (block_m // group))
    if num_splits is None:
        programs = batch * num_q_blocks * num_kv_heads
        num_splits = _attention_splits(programs, max_q_len, q.device, fp8)
    if num_splits & (num_splits - 1):
        raise ValueError(f"paged_attention: num_splits {num_splits} must be a power of two")
    block_n = 64 if block_m >= 64 or block_d > 128 else 128
    num_warps = 8 if block_m * block_d >= 64 * 256 else 4
    num_stages = 2 if block_d >= 256 else 3
    launch = {}
    tile = ATTN_TUNING["fp8_tile" if fp8 else "tile"]
    if tile:
        block_n, num_stages, num_warps, *maxnreg = tile
        if maxnreg:  # a register cap (ptxas .maxnreg): more programs resident per SM
            launch["maxnreg"] = maxnreg[0]
    if num_splits > 1:
        part_o = torch.empty(
            num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_splits, num_tokens, num_q_heads, dtype=torch.float32, device=q.device
        )
        part_strides = (part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1))
    else:
        part_o = part_lse = out  # unused
        part_strides = (0, 0, 0, 0)
    grid = (batch, num_q_blocks, num_kv_heads * num_splits)
    # an fp8 V as int16 words of two columns: its PV dot reads whole words (ldmatrix) where e4m3
    # columns are read a byte at a time (their keys are the dot's K dimension, not contiguous)
    v_pairs = (
        fixed["F16_DOT"]
        and ATTN_TUNING["fp8_v_pairs"]
        and head_dim % 2 == 0
        and v_cache.stride(0) % 2 == 0
        and v_cache.stride(1) % 2 == 0
        and v_cache.storage_offset() % 2 == 0
    )
    if v_pairs:
        v16 = v_cache.view(torch.int16)
        tensors = (q, k_cache, v16, out)
        strides = (*strides[:6], v16.stride(0), v16.stride(1), *strides[8:])
    _paged_attention_kernel[grid](
        *tensors,
        part_o,
        part_lse,
        *meta,
        *strides,
        *part_strides,
        0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        GATED=gated,
        V_PAIRS=v_pairs,
        PAIRS_ASM=v_pairs and q.is_cuda,
        **fixed,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
        **pdl(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_o,
            part_lse,
            out,
            gate_t,
            part_o.stride(0),
            part_o.stride(1),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            strides[2],
            strides[3],
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            SPLIT_CHUNK=min(num_splits, 32),
            GATED=gated,
            **pdl(part_o),
        )
    return out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_len]
    req_slots: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    max_q_len: int | None = None,
    num_splits: int | None = None,
    kv_scales: KVScales | None = None,  # an fp8 cache's scales (ignored by other caches)
    gate: torch.Tensor | None = None,  # [T, Hq, D] strided view: out * sigmoid(gate), fused
) -> torch.Tensor:
    """Dispatcher used by the model layers: the backend chosen in appliance_kernels.backends on CUDA
    (Triton by default, flashinfer's paged wrappers, or the torch reference); the reference on
    CPU."""
    args = (q, k_cache, v_cache, req_to_token, req_slots, cu_seqlens_q, seq_lens, scale)
    fp8 = is_fp8_cache(k_cache)
    scales = (kv_scales.k, kv_scales.v) if fp8 and kv_scales is not None else (None, None)
    if not q.is_cuda:
        return paged_attention_ref(*args, *scales, gate)
    from appliance_kernels import backends

    backend = backends.selected("attention")
    if backend == "flashinfer":
        from appliance_kernels.adapters import paged_attention_flashinfer

        host = (kv_scales.k_host, kv_scales.v_host) if fp8 and kv_scales is not None else None
        out = paged_attention_flashinfer(*args, max_q_len=max_q_len, kv_scales=host)
        return out if gate is None else (out.float() * torch.sigmoid(gate.float())).to(q.dtype)
    if backend == "triton" and use_triton(q):
        return paged_attention_triton(
            *args,
            max_q_len=max_q_len,
            num_splits=num_splits,
            k_scale=scales[0],
            v_scale=scales[1],
            gate=gate,
        )
    return paged_attention_ref(*args, *scales, gate)
