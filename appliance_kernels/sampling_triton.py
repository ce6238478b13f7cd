"""Triton sampling kernel: `sample_triton()`, the same signature and semantics as
`appliance_kernels.sampling_ref.sample_ref` (the hash, the filter order and the tie rules are
documented there), with seeds, offsets and parameters read from device tensors and no host sync, so
a CUDA graph can hold it. Called by the dispatcher `appliance_kernels.sampling.sample`.
"""

from __future__ import annotations

import torch

from appliance_kernels.sampling_ref import SAMPLING_EPS
from appliance_kernels.triton_utils import HAS_TRITON, check_last_dim_contiguous, jit, next_pow2, tl

if HAS_TRITON:  # precise fp32 log on CUDA (tl.log is lg2.approx-based); absent in the interpreter
    from triton.language.extra import libdevice
else:  # pragma: no cover
    libdevice = None

_BLOCK = 1024  # vocab entries per loop step
_CAP = 1024  # candidates sorted in registers (power of 2)
_PIVOTS = 4  # thresholds per search pass (power of 2)
_TOPK_CAP = 64  # rows with 0 < top_k <= this sample from per-chunk top-k candidates (power of 2)
_TOPK_CHUNK = 4096  # vocabulary ids per candidate program (power of 2)
_TOPK_COLS = 1024  # a candidate program's tile is [chunk / cols, cols]

# -------------------------------------------------------------------------------------------------
# Triton: one program per row, no sort of the vocabulary, no host sync (CUDA-graph capturable).
# Every filter keeps a prefix of the reference's order (value desc, id asc), so the kept set is
# always {x > tv} + {x == tv, id <= tid} for a boundary token (tv, tid). Pass 1 finds the max m (and
# the finite min). A filter (top-k: count of kept tokens >= t reaches k; top-p: their softmax mass
# exp(x - m) reaches p * Z) then searches the boundary value: each pass evaluates NP pivots in
# [lo, hi) (value-spaced while the interval is wide, else spaced in the gap-free integer order of
# fp32 keys) and keeps the sub-interval holding the boundary. It stops when the tokens >= lo fit in
# CAP (gathered to scratch, sorted by (value, id) in registers: the filters and the Gumbel argmax
# finish there), or those in [lo, hi) fit (sorted: exact boundary token), or [lo, hi) holds a single
# value (boundary = its r-th tie by id, one counting pass). A last pass takes argmax(x + G) over the
# kept set. Typical rows: greedy or temperature-only 1 pass; top-k <= CAP and/or a peaked top-p 3-4.
# Matches sample_ref token for token; differences are rounding-level, documented in sample_triton.
# Top-k rows (0 < k <= TOPK_CAP, the common case: Qwen's defaults are top-k 20, top-p 0.95) skip the
# search: _topk_partial_kernel spreads the row over vocabulary chunks, each keeping its TOPK_CAP
# largest (value, id) keys, and the row's program takes the top TOPK_CAP of those candidates,
# which hold the row's exact top-k (keys are a strict order: value desc, id asc), and finishes
# min-p, top-k, top-p and the Gumbel argmax in registers.
# -------------------------------------------------------------------------------------------------


@jit
def _mix(x):  # murmur3 fmix32 on uint32
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@jit
def _row_key(seed_ptr, offset_ptr, row):
    seed = tl.load(seed_ptr + row).to(tl.int64)
    offset = tl.load(offset_ptr + row).to(tl.int64)
    key = _mix((seed >> 32).to(tl.uint32) ^ 0x9E3779B9)
    key = _mix(key ^ seed.to(tl.uint32))
    key = _mix(key ^ (offset >> 32).to(tl.uint32))
    return _mix(key ^ offset.to(tl.uint32))


@jit
def _uniform(key, ids):
    bits = _mix(key ^ _mix(ids.to(tl.uint32) + 0x632BE5AB))
    return (bits >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.9604644775390625e-08


@jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@jit
def _gumbel(key, ids, PRECISE: tl.constexpr):
    return -_log(-_log(_uniform(key, ids), PRECISE), PRECISE)


@jit
def _order_key(x):  # fp32 -> int32 of the same order; -0.0 and +0.0 share key 0, no gaps
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, -(b & 0x7FFFFFFF), b)


@jit
def _from_order_key(k):
    k = k.to(tl.int64)
    return tl.where(k < 0, -k - 2147483648, k).to(tl.int32).to(tl.float32, bitcast=True)


@jit
def _pick(vec, idx, j):  # vec[j] of a small vector as a scalar
    return tl.sum(tl.where(idx == j, vec, 0), 0)


@jit
def _load_scaled(row_ptr, start, V, t, BLOCK: tl.constexpr):
    ids = start + tl.arange(0, BLOCK)
    ok = ids < V
    x = tl.load(row_ptr + ids, mask=ok, other=float("-inf")).to(tl.float32)
    return ids, ok, tl.div_rn(x, t)  # IEEE division, as torch's `logits / temperature`


@jit
def _in_set(x, ids, ok, tv, tid):  # membership of the kept set with boundary token (tv, tid)
    return ok & ((x > tv) | ((x == tv) & (ids <= tid)))


@jit
def _best(vals, start, best, best_id):  # running argmax, lowest id on ties
    val, idx = tl.max(vals, 0, return_indices=True)
    better = val > best
    return tl.where(better, val, best), tl.where(better, start + idx, best_id)


@jit
def _argmax_pass(row_ptr, V, BLOCK: tl.constexpr):
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        best, best_id = _best(x, start, best, best_id)
    return best_id


@jit
def _pack(x, ids, ok):  # (value desc, id asc) as one descending int64; below all keys if not ok
    packed = _order_key(x).to(tl.int64) * 4294967296 + (4294967295 - ids.to(tl.int64))
    return tl.where(ok, packed, -9223372036854775807)


@jit
def _unpack(packed):
    upper = packed >> 32
    ids = (4294967295 - (packed - (upper << 32))).to(tl.int32)
    return _from_order_key(upper.to(tl.int32)), ids


@jit
def _topk_eligible(t, k, V, eps, KC: tl.constexpr):
    return (t >= eps) & (k > 0) & (k <= KC) & (k < V)


@jit
def _topk_partial_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    top_k_ptr,
    cand_ptr,
    V,
    eps,
    KC: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    NCH: tl.constexpr,
):
    """Program (row, c) of a top-k row: the KC largest packed keys of temperature-scaled logits
    over ids [c * R * C, (c + 1) * R * C), sorted, to cand[row, c * KC:]; other rows return."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    if _topk_eligible(t, k, V, eps, KC):
        ids = c * (R * C) + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        ok = ids < V
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        x = tl.load(row_ptr + ids, mask=ok, other=float("-inf")).to(tl.float32)
        top = tl.topk(_pack(tl.div_rn(x, t), ids, ok), KC)  # [R, KC] per row of the tile
        if R > 1:
            top = tl.topk(tl.reshape(top, [R * KC]), KC)
        else:
            top = tl.reshape(top, [KC])
        tl.store(cand_ptr + row.to(tl.int64) * (NCH * KC) + c * KC + tl.arange(0, KC), top)


@jit
def _finish_topk(
    cand_ptr,
    row,
    nch,
    V,
    key,
    k,
    p,
    p_on,
    min_p,
    KC: tl.constexpr,
    NCH: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """A top-k row from its chunks' candidates: the top KC keys over all chunks hold the row's
    top k; min-p, top-k, top-p and the Gumbel argmax as _finish_complete. Returns (done, token):
    done = 0 for a row with no finite logit (the caller's Gumbel pass then gives id 0)."""
    slots = tl.arange(0, NCH * KC)
    packed = tl.load(
        cand_ptr + row.to(tl.int64) * (NCH * KC) + slots,
        mask=slots < nch * KC,
        other=-9223372036854775807,
    )
    top = tl.topk(packed, KC)
    x, ids = _unpack(top)
    m = tl.max(x, 0)
    valid = top > -9223372036854775807
    if min_p > 0:
        valid = valid & (x >= m + _log(tl.maximum(min_p, 1e-30), PRECISE))
    n = tl.sum(valid.to(tl.int32), 0)  # a prefix: the keys are sorted
    tok = _finish_complete(x, ids, n, m, key, k, p, p_on, -1.0, V, KC, PRECISE)
    return (m > float("-inf")).to(tl.int32), tok


@jit
def _argmax_partial_kernel(
    logits_ptr, stride_row, temp_ptr, part_val_ptr, part_id_ptr, V, eps, CHUNK, BLOCK: tl.constexpr
):
    """Greedy rows, split over the vocabulary: program (row, c) writes the max and its lowest id
    over ids [c * CHUNK, (c + 1) * CHUNK); sampled rows are skipped (their slots unread)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    t = tl.load(temp_ptr + row).to(tl.float32)
    if t < eps:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        best = tl.full((), float("-inf"), tl.float32)
        best_id = tl.full((), 0, tl.int32)
        for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), BLOCK):
            ids = start + tl.arange(0, BLOCK)
            ok = (ids < V) & (ids < c * CHUNK + CHUNK)
            x = tl.load(row_ptr + ids, mask=ok, other=float("-inf")).to(tl.float32)
            best, best_id = _best(x, start, best, best_id)
        tl.store(part_val_ptr + row * chunks + c, best)
        tl.store(part_id_ptr + row * chunks + c, best_id)


@jit
def _argmax_from_partials(part_val_ptr, part_id_ptr, row, CHUNKS: tl.constexpr):
    """The row's argmax from its chunks' (max, lowest id): chunks are in id order and tl.max
    returns the first of equal maxima, so ties still go to the lowest id (an all -inf row: id
    0, as _argmax_pass)."""
    offs = tl.arange(0, CHUNKS)
    vals = tl.load(part_val_ptr + row * CHUNKS + offs)
    ids = tl.load(part_id_ptr + row * CHUNKS + offs)
    best, idx = tl.max(vals, 0, return_indices=True)
    return tl.where(best > float("-inf"), _pick(ids, offs, idx), 0)


@jit
def _gumbel_pass(row_ptr, V, t, tv, tid, key, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        ids, ok, x = _load_scaled(row_ptr, start, V, t, BLOCK)
        keep = _in_set(x, ids, ok, tv, tid)
        noisy = tl.where(keep, x + _gumbel(key, ids, PRECISE), float("-inf"))
        best, best_id = _best(noisy, start, best, best_id)
    return best_id


@jit
def _max_min_pass(row_ptr, V, t, BLOCK: tl.constexpr):
    hi = tl.full((), float("-inf"), tl.float32)
    lo = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        ids, ok, x = _load_scaled(row_ptr, start, V, t, BLOCK)
        hi = tl.maximum(hi, tl.max(x, 0))
        lo = tl.minimum(lo, tl.min(tl.where(x > float("-inf"), x, float("inf")), 0))
    return tl.where(hi == 0, 0.0, hi), tl.where(lo == 0, 0.0, lo)  # -0.0 -> +0.0


@jit
def _pivots(lo, hi, first, jj, NP: tl.constexpr):
    """NP increasing thresholds in [lo, hi]: lo first on the first pass, then interior ones."""
    num = jj + tl.where(first, 0, 1)
    den = tl.where(first, NP, NP + 1)
    k_lo = _order_key(lo).to(tl.int64)
    k_hi = _order_key(hi).to(tl.int64)
    q_key = _from_order_key((k_lo + (k_hi - k_lo) * num // den).to(tl.int32))
    width = hi - lo
    scale = tl.maximum(tl.abs(lo), tl.abs(hi))
    by_value = (width > 0.0625 * scale) & (scale > 1e-6) & (width < float("inf"))
    q = tl.where(by_value, lo + width * (num.to(tl.float32) / den.to(tl.float32)), q_key)
    q = tl.minimum(tl.maximum(q, lo), hi)
    return tl.where(q == 0, 0.0, q)


@jit
def _pivot_stats(
    row_ptr, V, t, m, tv, tid, q, MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr
):
    """Per pivot: count (and softmax mass exp(x - m)) of kept tokens with x >= pivot."""
    cnt = tl.zeros([BLOCK, NP], tl.int32)
    mass = tl.zeros([BLOCK, NP], tl.float32)
    for start in range(0, V, BLOCK):
        ids, ok, x = _load_scaled(row_ptr, start, V, t, BLOCK)
        ge = (x[:, None] >= q[None, :]) & _in_set(x, ids, ok, tv, tid)[:, None]
        cnt += ge.to(tl.int32)
        if MASS:
            mass += tl.where(ge, tl.exp(x - m)[:, None], 0.0)
    return tl.sum(cnt, 0), tl.sum(mass, 0)


@jit
def _search(
    row_ptr,
    V,
    t,
    m,
    tv,
    tid,
    lo,
    target,
    p,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NP: tl.constexpr,
):
    """Narrows [lo, hi) around the boundary value: stat(>= lo) >= target > stat(>= hi)."""
    jj = tl.arange(0, NP)
    hi = _from_order_key(_order_key(m) + 1)
    zero = tl.program_id(0) * 0
    c_lo = zero + V  # kept tokens >= lo (an upper bound until the first pass)
    c_hi = zero  # kept tokens >= hi
    g_hi = zero.to(tl.float32)  # stat of the kept tokens >= hi
    z = g_hi - 1.0  # top-p: mass of the whole kept set (first pass), -1 = not computed
    it = zero
    nocut = zero > 0
    go = c_lo > CAP
    while go:
        first = it == 0
        q = _pivots(lo, hi, first, jj, NP)
        g_cnt, g_mass = _pivot_stats(row_ptr, V, t, m, tv, tid, q, MASS, BLOCK, NP)
        if MASS:
            z = tl.where(first, tl.sum(tl.where(jj == 0, g_mass, 0.0), 0), z)
            target = tl.where(first, tl.maximum(p * z, 1e-30), target)
            stat = g_mass
        else:
            stat = g_cnt.to(tl.float32)
        sel = tl.max(tl.where(stat >= target, jj, -1), 0)
        nocut = first & (sel < 0)  # the whole kept set is below target: the filter keeps it all
        at, above = jj == sel, jj == sel + 1  # one-hot picks of the chosen sub-interval's ends
        lo = tl.where(sel >= 0, tl.sum(tl.where(at, q, 0.0), 0), lo)
        c_lo = tl.where(sel >= 0, tl.sum(tl.where(at, g_cnt, 0), 0), c_lo)
        inner = sel + 1 < NP
        hi = tl.where(inner, tl.sum(tl.where(above, q, 0.0), 0), hi)
        c_hi = tl.where(inner, tl.sum(tl.where(above, g_cnt, 0), 0), c_hi)
        g_hi = tl.where(inner, tl.sum(tl.where(above, stat, 0.0), 0), g_hi)
        it += 1
        gap = _order_key(hi).to(tl.int64) - _order_key(lo).to(tl.int64)
        go = (nocut == 0) & (c_lo > CAP) & (c_lo - c_hi > CAP) & (gap > 1) & (it < 64)
    return lo, hi, c_lo, c_hi, g_hi, target, z, nocut


@jit
def _gather_sorted(row_ptr, scratch, V, t, tv, tid, lo, hi, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Kept tokens with lo <= x < hi (at most CAP), sorted by (value desc, id asc)."""
    tl.debug_barrier()  # the row's scratch may still be read by an earlier gather
    n = tl.program_id(0) * 0
    for start in range(0, V, BLOCK):
        ids, ok, x = _load_scaled(row_ptr, start, V, t, BLOCK)
        take = _in_set(x, ids, ok, tv, tid) & (x >= lo) & (x < hi)
        packed = _pack(x, ids, take)
        pos = n + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(scratch + pos, packed, mask=take & (pos < CAP))
        n += tl.sum(take.to(tl.int32), 0)
    tl.debug_barrier()
    slots = tl.arange(0, CAP)
    packed = tl.load(
        scratch + slots, mask=slots < n, other=-9223372036854775807, cache_modifier=".cg"
    )
    x, ids = _unpack(tl.sort(packed, descending=True))
    return x, ids, tl.minimum(n, CAP)


@jit
def _finish_complete(
    x, ids, n, m, key, k_lim, p, p_on, z, V, CAP: tl.constexpr, PRECISE: tl.constexpr
):
    """Sorted x, ids hold every kept token >= lo: top-k (first k_lim), top-p, Gumbel argmax."""
    slots = tl.arange(0, CAP)
    keep = (slots < n) & (slots < k_lim)
    e = tl.where(keep, tl.exp(x - m), 0.0)
    total = tl.where(z > 0, z, tl.sum(e, 0))
    reach = keep & (tl.cumsum(e, 0) >= tl.maximum(p * total, 1e-30))
    last = tl.min(tl.where(reach, slots, CAP), 0)
    keep = keep & ((slots <= last) | (p_on == 0))
    noisy = tl.where(keep, x + _gumbel(key, ids, PRECISE), float("-inf"))
    best = tl.max(noisy, 0)
    return tl.min(tl.where(keep & (noisy == best), ids, V), 0)


@jit
def _finish_interval(x, ids, n, m, g_hi, target, MASS: tl.constexpr, CAP: tl.constexpr):
    """Sorted x, ids hold the kept tokens in [lo, hi): the boundary is the first reaching target."""
    slots = tl.arange(0, CAP)
    valid = slots < n
    if MASS:
        stat = tl.where(valid, tl.exp(x - m), 0.0)
    else:
        stat = valid.to(tl.float32)
    reach = valid & (g_hi + tl.cumsum(stat, 0) >= target)
    last = tl.min(tl.where(reach, slots, n - 1), 0)
    return _pick(x, slots, last), _pick(ids, slots, last)


@jit
def _finish_ties(
    row_ptr, V, t, m, tv, tid, lo, c_in, g_hi, target, MASS: tl.constexpr, BLOCK: tl.constexpr
):
    """[lo, hi) holds only the value lo (c_in ties): the boundary is its r-th kept tie by id."""
    if MASS:
        each = tl.exp(lo - m)
    else:
        each = lo * 0.0 + 1.0
    r = tl.minimum(tl.maximum(tl.ceil((target - g_hi) / each), 1.0), c_in.to(tl.float32))
    r = r.to(tl.int32)
    seen = tl.program_id(0) * 0
    found = seen - 1
    for start in range(0, V, BLOCK):
        ids, ok, x = _load_scaled(row_ptr, start, V, t, BLOCK)
        tie = _in_set(x, ids, ok, tv, tid) & (x == lo)
        rank = seen + tl.cumsum(tie.to(tl.int32), 0)
        found = tl.maximum(found, tl.max(tl.where(tie & (rank == r), ids, -1), 0))
        seen += tl.sum(tie.to(tl.int32), 0)
    return lo, found


@jit
def _filter(
    row_ptr,
    scratch,
    V,
    t,
    m,
    mn,
    tv,
    tid,
    key,
    k,
    p,
    p_on,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NP: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """Top-k (MASS=False, target k) or top-p (MASS=True) on the kept set (tv, tid). Returns the
    new boundary, and (done, token) when the whole rest was finished in registers."""
    lo = tl.maximum(tv, mn)
    lo, hi, c_lo, c_hi, g_hi, target, z, nocut = _search(
        row_ptr, V, t, m, tv, tid, lo, k.to(tl.float32), p, MASS, BLOCK, CAP, NP
    )
    done = c_lo * 0
    tok = c_lo * 0
    if nocut:
        done = done * 0
    elif (c_lo <= CAP) | (c_lo - c_hi <= CAP):  # one gather + sort (one sort site per filter)
        complete = c_lo <= CAP
        x, ids, n = _gather_sorted(
            row_ptr, scratch, V, t, tv, tid, lo, tl.where(complete, float("inf"), hi), BLOCK, CAP
        )
        if complete:
            tok = _finish_complete(x, ids, n, m, key, k, p, p_on, z, V, CAP, PRECISE)
            done = done + 1
        else:
            tv, tid = _finish_interval(x, ids, n, m, g_hi, target, MASS, CAP)
    else:
        tv, tid = _finish_ties(
            row_ptr, V, t, m, tv, tid, lo, c_lo - c_hi, g_hi, target, MASS, BLOCK
        )
    return tv, tid, done, tok


@jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    offset_ptr,
    out_ptr,
    scratch_ptr,
    part_val_ptr,
    part_id_ptr,
    cand_ptr,
    nch,
    V,
    eps,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NP: tl.constexpr,
    PRECISE: tl.constexpr,
    CHUNKS: tl.constexpr,  # > 0: greedy rows reduce _argmax_partial_kernel's chunks
    TOPK_KC: tl.constexpr,  # > 0: top-k rows up to this k finish _topk_partial_kernel's candidates
    TOPK_NCH: tl.constexpr,  # candidate chunks per row, a power of 2 >= nch
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    scratch = scratch_ptr + row.to(tl.int64) * CAP
    t = tl.load(temp_ptr + row).to(tl.float32)
    if t < eps:
        if CHUNKS > 0:
            tok = _argmax_from_partials(part_val_ptr, part_id_ptr, row, CHUNKS)
        else:
            tok = _argmax_pass(row_ptr, V, BLOCK)
    else:
        key = _row_key(seed_ptr, offset_ptr, row)
        k = tl.load(top_k_ptr + row).to(tl.int64)
        p = tl.load(top_p_ptr + row).to(tl.float32)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        k_on = (k > 0) & (k < V)
        p_on = p < 1.0
        k = tl.where(k_on, k, V).to(tl.int32)
        tv = tl.full((), float("-inf"), tl.float32)  # kept set: x > tv, or x == tv and id <= tid
        tid = row * 0 + V
        done = row * 0
        tok = row * 0
        if TOPK_KC > 0:
            if k_on & (k <= TOPK_KC):
                done, tok = _finish_topk(
                    cand_ptr, row, nch, V, key, k, p, p_on, min_p, TOPK_KC, TOPK_NCH, PRECISE
                )
        if (done == 0) & (k_on | p_on | (min_p > 0)):
            m, mn = _max_min_pass(row_ptr, V, t, BLOCK)
            if m > float("-inf"):
                if min_p > 0:
                    tv = m + _log(tl.maximum(min_p, 1e-30), PRECISE)
                if k_on:
                    tv, tid, done, tok = _filter(
                        row_ptr,
                        scratch,
                        V,
                        t,
                        m,
                        mn,
                        tv,
                        tid,
                        key,
                        k,
                        p,
                        p_on,
                        False,
                        BLOCK,
                        CAP,
                        NP,
                        PRECISE,
                    )
                if p_on & (done == 0):
                    tv, tid, done, tok = _filter(
                        row_ptr,
                        scratch,
                        V,
                        t,
                        m,
                        mn,
                        tv,
                        tid,
                        key,
                        row * 0 + V,
                        p,
                        p_on,
                        True,
                        BLOCK,
                        CAP,
                        NP,
                        PRECISE,
                    )
        if done == 0:
            tok = _gumbel_pass(row_ptr, V, t, tv, tid, key, BLOCK, PRECISE)
    tl.store(out_ptr + row, tok.to(tl.int64))


@jit
def _uniform_kernel(seed_ptr, offset_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _row_key(seed_ptr, offset_ptr, row)
    tl.store(out_ptr + row.to(tl.int64) * V + ids, _uniform(key, ids), mask=ids < V)


def uniform_noise_triton(
    seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The kernels' uniforms [B, V] fp32 (bit for bit those of uniform_noise; for tests)."""
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=seeds.device)
    block = min(1024, next_pow2(vocab_size))
    if rows and vocab_size:
        _uniform_kernel[(rows, -(-vocab_size // block))](
            seeds.long().contiguous(), offsets.long().contiguous(), out, vocab_size, BLOCK=block
        )
    return out


def sample_triton(
    logits: torch.Tensor,  # [B, V] fp32 / bf16 / fp16, rows contiguous
    temperature: torch.Tensor,  # [B] fp32; < SAMPLING_EPS = greedy
    top_k: torch.Tensor,  # [B] int; -1 or 0 = off
    top_p: torch.Tensor,  # [B] fp32 in (0, 1]
    min_p: torch.Tensor,  # [B] fp32 in [0, 1]
    seeds: torch.Tensor,  # [B] int64
    offsets: torch.Tensor,  # [B] int64
    *,
    out: torch.Tensor | None = None,  # [B] int64
    block: int = _BLOCK,
    cap: int = _CAP,
    pivots: int = _PIVOTS,
    chunks: int | None = None,
    topk_cap: int = _TOPK_CAP,
    topk_chunk: int = _TOPK_CHUNK,
) -> torch.Tensor:
    """Same contract and tokens as sample_ref, without host syncs (graph-capturable). Differences,
    all rounding-level: top-p masses are summed in another order (and with tl.exp), so a row whose
    top-p cut lies within float error of p may keep one token more or less; the interpreter's log
    (numpy) may differ from torch's in the last ulp (on CUDA the kernel calls libdevice's logf);
    -0.0 and +0.0 are one value (as torch's CPU sort). NaN logits are unsupported.

    `chunks` (a power of 2; None: `argmax_chunks`): greedy rows first take the max of that many
    vocabulary chunks in parallel, then reduce them, instead of one program scanning the row.
    `topk_cap` (a power of 2; 0: off): in batches of up to TOPK_MAX_ROWS rows, rows with
    0 < top_k <= topk_cap take their top-k from per-chunk candidates (chunks of `topk_chunk` ids,
    a power of 2 >= topk_cap) instead of the value search; the tokens are the same."""
    check_last_dim_contiguous("logits", logits)
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = min(block, next_pow2(vocab))
    chunks = argmax_chunks(rows, vocab, block) if chunks is None else chunks
    scratch = torch.empty(rows, cap, dtype=torch.long, device=logits.device)
    temperature = temperature.float().contiguous()
    top_k = top_k.contiguous()
    part_val = part_id = scratch  # unread unless chunks: no allocation for it then
    if chunks:
        part_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
        chunk = -(-vocab // chunks)
        _argmax_partial_kernel[(rows, chunks)](
            logits,
            logits.stride(0),
            temperature,
            part_val,
            part_id,
            vocab,
            SAMPLING_EPS,
            -(-chunk // block) * block,
            BLOCK=block,
            num_warps=4,
        )
    cand, nch = scratch, 0  # cand unread without topk_cap: no allocation for it then
    if topk_cap and rows <= TOPK_MAX_ROWS:
        cand, nch = topk_candidates(logits, temperature, top_k, topk_cap, topk_chunk)
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        seeds.long().contiguous(),
        offsets.long().contiguous(),
        out,
        scratch,
        part_val,
        part_id,
        cand,
        nch,
        vocab,
        SAMPLING_EPS,
        BLOCK=block,
        CAP=cap,
        NP=pivots,
        PRECISE=logits.is_cuda,
        CHUNKS=chunks,
        TOPK_KC=topk_cap if nch else 0,
        TOPK_NCH=cand.shape[1] // topk_cap if nch else 1,
        num_warps=8,
    )
    return out


def topk_candidates(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32, contiguous
    top_k: torch.Tensor,  # [B] int, contiguous
    cap: int = _TOPK_CAP,
    chunk: int = _TOPK_CHUNK,
) -> tuple[torch.Tensor, int]:
    """The per-chunk candidates of the top-k rows (0 < top_k <= cap, not greedy): [B, chunks_p2 *
    cap] int64 packed (value, id) keys of the temperature-scaled logits, chunk c's cap largest at
    [c * cap, (c + 1) * cap) in descending order (other rows' slots unwritten), and the chunk count
    (chunks_p2 is its next power of 2)."""
    if cap & (cap - 1) or chunk & (chunk - 1) or chunk < cap:
        raise ValueError(f"topk cap {cap} / chunk {chunk}: powers of 2, cap <= chunk")
    rows, vocab = logits.shape
    chunk = min(chunk, max(cap, next_pow2(vocab)))
    nch = -(-vocab // chunk)
    cand = torch.empty(rows, next_pow2(nch) * cap, dtype=torch.long, device=logits.device)
    cols = min(chunk, _TOPK_COLS)
    _topk_partial_kernel[(rows, nch)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        cand,
        vocab,
        SAMPLING_EPS,
        KC=cap,
        R=chunk // cols,
        C=cols,
        NCH=next_pow2(nch),
        num_warps=8,
    )
    return cand, nch


# The candidates cost ~9 µs a row (a bitonic top-k per 4096 ids), the value search ~1.1 ms for up
# to a wave of rows: on the H200 (run AQ) 80 vs 855 µs at 1 row, 608 vs 1059 at 64, 2302 vs 1165
# at 256.
TOPK_MAX_ROWS = 96


ARGMAX_CHUNKS = 64  # vocabulary chunks of a greedy row when rows are few
ARGMAX_MAX_ROWS = 32  # above this, one program per row already spreads over the SMs


def argmax_chunks(rows: int, vocab: int, block: int) -> int:
    """Chunks for greedy rows: a few rows over a large vocabulary (an MTP verify at batch 1: 4
    rows of 248k, 118 µs in one program per row on the H200, run AJ) split the scan."""
    if rows > ARGMAX_MAX_ROWS or vocab < 16 * block:
        return 0
    return ARGMAX_CHUNKS
