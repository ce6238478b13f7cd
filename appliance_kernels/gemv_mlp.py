"""One row through a whole SwiGLU MLP in one launch: down(SiLU(x Wg^T) * (x Wu^T)), the weights
fp8 e4m3 (per channel, per tensor or 128 x 128 blocks) or in the row's 16-bit dtype.

Why: at batch-1 decode the MLP is two weight reads (gate_up, then down) and each launch pays a
ramp (programs start, the first loads are in flight before any byte arrives) and a tail (the
last wave leaves SMs idle while it drains); down cannot start before gate_up's last program has
stored. In the 27B step the 256 one-row GEMVs read their bytes about 1 ms slower than the HBM rate
(docs/benchmarks.md, run DI.1: gate_up 47.5 µs a launch against 41.9 at the floor rate), and PDL
did not hide it (a GEMV's programs still wait for the whole previous grid).

How: programs take tiles from one atomic ticket counter, in order (one tile a program, or with
`per_sm` a persistent grid whose programs take tiles until none is left): first the gate_up tiles
(BLOCK_A activation channels each: their gate and up rows over the whole K, SiLU-and-mul in
registers, stored to a [I] row), then the down tiles. The down projection is split over K into
segments of SEG activation channels; a down tile is (segment, BLOCK_N output rows): it waits
until every gate_up tile of its segment has stored (a counter per segment, released by those
tiles), reads its weight slice and stores one fp32 partial row; the last of a row block's segment
tiles to arrive (a counter per row block) sums the partials in segment order and finishes the
outputs (scales, the split norm's add of gemv_norm.py). So down tiles of the first segments run
while the last gate_up tiles are still reading, the two reads share one ramp and one tail, and
the sums do not depend on which program ran what (no atomics on data).

Deadlock-free without assuming co-residency or launch order: a program claims a ticket only once
it runs (a persistent one claims its next before it works on its current one), and a tile waits
only on tiles with lower tickets, all claimed by programs that are running and that never wait
on a higher ticket. The last program to leave (a done counter) puts the counters back to zero
for the next launch (CUDA-graph replays included); they live in a workspace per device and
stream (`_sync`): two launches must not run at once on one stream's counters (the engine runs
one stream). Under the Triton interpreter programs run one after another, in ticket order.

Memory ordering: a producer stores, passes a CTA barrier, then one release atomic; a consumer
polls the counter with volatile loads, then reads it once with acquire semantics (Triton lowers
the atomic add of 0 to ld.acquire.gpu, which invalidates the SM's L1 on sm_90), then reads what
others stored (`.cg`, L2 only, where Triton keeps the hint; its pipeliner turns the 8-byte
activation loads into L1-allocating cp.async, safe after that invalidate since no segment shares
a cache line with another: segments end on K steps of 256 or 512 channels by default).

Rounding: as the unfused path (gemv_swiglu_ref): gate and up rounded to the row's dtype, the SiLU
to the dtype, the activation stored in the dtype; the down sums differ by summation order only.

Off (USE_FUSED_MLP; ops/bench/bench_static.py --fused-mlp on): measured SLOWER on the H200 (run DL
in docs/benchmarks.md, 27B MLP, PDL on: fp8 per channel 83.6 µs against 68.3 for the two GEMVs and
silu_and_mul, block fp8 86.3 against 71.4; persistent grids and any segment count slower too,
one segment, with nothing overlapped, 81.6): the ticket, split-K and counter round trips cost
more than the ramp and tail they share. Correct on CUDA (tests/kernels/test_gemv_mlp.py).
"""

from __future__ import annotations

import torch

from appliance_kernels.activation import silu_and_mul_ref
from appliance_kernels.fp8_gemv import (
    _scaled_x,
    _w_tile,
    _x_tile,
    fp8_gemv_block_ref,
    fp8_gemv_ref,
)
from appliance_kernels.gemv_epilogue import finish, load_partials, rstd_of, swiglu_store
from appliance_kernels.gemv_norm import (
    AddNorm,
    PendingNorm,
    add_norm_args,
    check_pending,
    norm_in_args,
    pending,
)
from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    gemv_pdl,
    jit,
    next_pow2,
    num_sms,
    pdl_release,
    pdl_wait,
    tl,
    use_triton,
)

USE_FUSED_MLP = False  # the MLP's one-row route through gemv_mlp (see the docstring)
MLP_DTYPES = (torch.bfloat16, torch.float16)
# The tile config where set (ops/bench/bench_static.py --fused-mlp-tile), as mlp_config returns it.
MLP_TILE: dict[str, int] | None = None
# Polls of a down tile before it gives up waiting and flags a stall (`stalled`) instead of hanging
# the GPU: about a second or more at L2 latency, far past any wait for a gate_up tile.
MAX_SPINS = 1 << 22
# per (device, stream): [ticket, done, segment counters.., row-block counters..]
_SYNC: dict[tuple[torch.device, int], torch.Tensor] = {}


def gemv_mlp_ref(
    x: torch.Tensor,  # [1, K]
    w_gu: torch.Tensor,  # [2I, K]: gate rows, then up rows (fp8 with scales, or 16-bit)
    s_gu: torch.Tensor | None,  # [2I] / [1], block scales, or None (16-bit)
    w_d: torch.Tensor,  # [H, I]
    s_d: torch.Tensor | None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The unfused path: the gate_up GEMV as stored, SiLU-and-mul, the down GEMV."""
    if block is not None:
        act = silu_and_mul_ref(fp8_gemv_block_ref(x, w_gu, s_gu, block))
        return fp8_gemv_block_ref(act, w_d, s_d, block)
    ones = torch.ones(1, device=w_gu.device)
    act = silu_and_mul_ref(fp8_gemv_ref(x, w_gu, s_gu if s_gu is not None else ones))
    return fp8_gemv_ref(act, w_d, s_d if s_d is not None else ones)


@jit
def _act_tile(act_ptr, k, k_size, EVEN: tl.constexpr):
    """The activation row's columns k, written by other programs of this launch: read via L2."""
    if EVEN:
        return tl.load(act_ptr + k, cache_modifier=".cg").to(tl.float32)
    return tl.load(act_ptr + k, mask=k < k_size, other=0.0, cache_modifier=".cg").to(tl.float32)


@jit
def _scaled_act(act_ptr, s_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K: tl.constexpr, EVEN):
    """_scaled_x of fp8_gemv.py over the activation row (read via L2)."""
    sv = tl.load(s_row + k0 // SCALE_K + rg, mask=k0 + rg * SCALE_K < k_size, other=0.0)
    return tl.reshape(_act_tile(act_ptr, k0 + kk, k_size, EVEN) * sv[:, None], [BLOCK_K])


@jit
def _gate_up_tile(
    t,
    x_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    inter,
    k_size,
    stride_w,
    rstd,
    SCALED: tl.constexpr,
    PER_COL: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_IN: tl.constexpr,
):
    """Activation channels [t * BLOCK_A, +BLOCK_A): their gate and up rows over the whole K, then
    SiLU(gate) * up rounded as the unfused path and stored."""
    rn = t * BLOCK_A + tl.arange(0, BLOCK_A)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < inter
    gate_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    up_rows = w_ptr + (rn + inter).to(tl.int64)[:, None] * stride_w
    if SCALE_K:  # block scales: the gate and the up rows each share one row of scales
        rg = tl.arange(0, BLOCK_K // SCALE_K)
        kk = rg[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]
        sg_row = s_ptr + ((t * BLOCK_A) // SCALE_N) * tl.cdiv(k_size, SCALE_K)
        su_row = s_ptr + ((t * BLOCK_A + inter) // SCALE_N) * tl.cdiv(k_size, SCALE_K)
    acc_g = tl.zeros([BLOCK_A, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_A, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        wg = _w_tile(gate_rows, k, n_ok, k_size, EVEN).to(tl.float32)
        wu = _w_tile(up_rows, k, n_ok, k_size, EVEN).to(tl.float32)
        if SCALE_K:
            xg = _scaled_x(x_ptr, sg_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K, EVEN)
            xu = _scaled_x(x_ptr, su_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K, EVEN)
        else:
            xg = _x_tile(x_ptr, k, k_size, EVEN)
            xu = xg
        acc_g += wg * xg[None, :]
        acc_u += wu * xu[None, :]
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if NORM_IN:
        gate, up = gate * rstd, up * rstd
    swiglu_store(gate, up, rn, n_ok, s_ptr, inter, act_ptr, SCALED, PER_COL)


@jit
def _down_part(
    seg,
    nb,
    w_ptr,
    s_ptr,
    act_ptr,
    part_ptr,
    inter,
    hidden,
    stride_w,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SEG: tl.constexpr,
):
    """Rows [nb * BLOCK_N, +BLOCK_N) of act W^T over the activation columns of segment seg,
    stored as that segment's fp32 partial row."""
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < hidden
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    if SCALE_K:
        rg = tl.arange(0, BLOCK_K // SCALE_K)
        kk = rg[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]
        s_row = s_ptr + ((nb * BLOCK_N) // SCALE_N) * tl.cdiv(inter, SCALE_K)
    k_lo = seg * SEG
    k_hi = tl.minimum(k_lo + SEG, inter)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        w = _w_tile(w_rows, k, n_ok, inter, EVEN).to(tl.float32)
        if SCALE_K:
            xs = _scaled_act(act_ptr, s_row, k0, kk, rg, inter, SCALE_K, BLOCK_K, EVEN)
        else:
            xs = _act_tile(act_ptr, k, inter, EVEN)
        acc += w * xs[None, :]
    tl.store(part_ptr + seg * hidden + rn, tl.sum(acc, axis=1), mask=n_ok)


@jit
def _gemv_mlp_kernel(
    x_ptr,
    wgu_ptr,
    sgu_ptr,
    wd_ptr,
    sd_ptr,
    act_ptr,  # [I] in x's dtype: the activation row (written, then read, in this launch)
    part_ptr,  # [n_segs, H] fp32: the down projection's per-segment sums
    out_ptr,
    sync_ptr,  # int32 [2 + SEGS + n_blocks], zero at launch, zero again at exit
    stall_ptr,  # int32 [1]: set where a down tile gave up waiting (never reset here)
    inter,
    k_size,
    hidden,
    stride_gu,
    stride_d,
    sync_size,
    np_ptr,  # NORM_IN: x is a pending norm's x_pre (appliance_kernels/gemv_norm.py)
    n_parts,
    norm_eps,
    res_ptr,  # ADD_NORM: the outputs added to the residual and normed for the next GEMV
    res_out_ptr,
    nw_ptr,
    po_ptr,
    SCALED: tl.constexpr,  # per-channel / per-tensor scales on the outputs (fp8)
    PER_COL: tl.constexpr,  # gate_up's scales per channel (else one)
    PER_COL_D: tl.constexpr,  # down's
    SCALE_N: tl.constexpr,  # block scales (0: none)
    SCALE_K: tl.constexpr,
    EVEN_A: tl.constexpr,  # I % BLOCK_A == 0 and K % BLOCK_K == 0
    EVEN_B: tl.constexpr,  # H % BLOCK_N == 0 and I % BLOCK_K == 0
    STAGES: tl.constexpr,
    BLOCK_A: tl.constexpr,  # activation channels of a gate_up tile
    BLOCK_N: tl.constexpr,  # output rows of a down tile
    BLOCK_K: tl.constexpr,
    SEG: tl.constexpr,  # activation channels of a down segment (a multiple of BLOCK_K, BLOCK_A)
    SEGS: tl.constexpr,  # power of two >= the segment count
    NORM_IN: tl.constexpr = False,
    PARTS: tl.constexpr = 1,
    ADD_NORM: tl.constexpr = False,
    ZC: tl.constexpr = True,
    PERSIST: tl.constexpr = False,  # each program takes tiles until none is left (else one)
    MAX_SPINS: tl.constexpr = 1 << 22,  # polls before a down tile gives up
    PDL: tl.constexpr = False,
    RELEASE: tl.constexpr = False,  # GEMV_PDL "full": the next kernel may launch now
):
    if RELEASE:
        pdl_release(PDL)
    pdl_wait(PDL)
    tiles_a = tl.cdiv(inter, BLOCK_A)
    n_segs = tl.cdiv(inter, SEG)
    n_blocks = tl.cdiv(hidden, BLOCK_N)
    seg_count = sync_ptr + 2
    block_count = seg_count + SEGS
    rstd = 1.0
    if NORM_IN:
        rstd = rstd_of(load_partials(np_ptr, n_parts, PARTS), k_size, norm_eps)
    tiles = tiles_a + n_segs * n_blocks
    # tickets order nothing by themselves (the counters below do): relaxed, no fence
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while t < tiles:
        if PERSIST:  # the next one claimed now: its latency hides behind this tile
            t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        else:
            t_next = tiles  # one tile a program
        if t < tiles_a:
            gu = (x_ptr, wgu_ptr, sgu_ptr, act_ptr, inter, k_size, stride_gu, rstd)
            _gate_up_tile(
                t, *gu, SCALED, PER_COL, SCALE_N, SCALE_K, EVEN_A, STAGES, BLOCK_A, BLOCK_K, NORM_IN
            )
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(seg_count + (t * BLOCK_A) // SEG, 1, sem="release", scope="gpu")
        else:
            seg = (t - tiles_a) // n_blocks
            nb = (t - tiles_a) % n_blocks
            need = tl.minimum(SEG // BLOCK_A, tiles_a - seg * (SEG // BLOCK_A))
            spins = 0
            while (tl.load(seg_count + seg, volatile=True) < need) & (spins < MAX_SPINS):
                spins += 1  # a plain poll, no RMW; bounded: a stall is flagged, not a hang
            # then one acquire read, its result used (an unused one is dropped in the lowering)
            if tl.atomic_add(seg_count + seg, 0, sem="acquire", scope="gpu") < need:
                tl.store(stall_ptr, 1)  # gave up waiting: the output is wrong (`stalled`)
            tl.debug_barrier()
            down = (wd_ptr, sd_ptr, act_ptr, part_ptr, inter, hidden, stride_d)
            _down_part(seg, nb, *down, SCALE_N, SCALE_K, EVEN_B, STAGES, BLOCK_N, BLOCK_K, SEG)
            tl.debug_barrier()
            arrived = tl.atomic_add(block_count + nb, 1, sem="acq_rel", scope="gpu")
            if arrived == n_segs - 1:  # the row block's last segment: sum them in order
                rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = rn < hidden
                rs = tl.arange(0, SEGS)
                ok = (rs < n_segs)[:, None] & n_ok[None, :]
                parts = tl.load(
                    part_ptr + rs[:, None] * hidden + rn[None, :],
                    mask=ok,
                    other=0.0,
                    cache_modifier=".cg",
                )
                out = tl.sum(parts, axis=0)
                if SCALED:
                    if PER_COL_D:
                        out = out * tl.load(sd_ptr + rn, mask=n_ok, other=0.0)
                    else:
                        out = out * tl.load(sd_ptr)
                no_conv = (out_ptr, out_ptr, out_ptr, out_ptr, 0, 0, 0)  # and CONV_W = 0
                norm = (res_ptr, res_out_ptr, nw_ptr, po_ptr)
                finish(out, rn, n_ok, nb, out_ptr, out_ptr, False, *no_conv, 0, *norm, ADD_NORM, ZC)
        t = t_next
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        for i in tl.range(0, sync_size, 1024):  # the last to leave: counters back to zero
            ri = i + tl.arange(0, 1024)
            tl.store(sync_ptr + ri, tl.zeros([1024], dtype=tl.int32), mask=ri < sync_size)


def mlp_config(inter: int, k: int, fp8: bool = True) -> dict[str, int]:
    """Tiles (not yet tuned on a GPU): a gate_up tile of 4 channels reads 8 rows, as the
    one-row SwiGLU GEMV's (gemv_swiglu.swiglu_config); down tiles of 8 rows, the GEMV's at
    that shape; segments of 9 K steps (4 over the 27B down's 17408 channels). per_sm 0: one
    tile a program, the hardware scheduling programs as slots free (a persistent one-row GEMV,
    per_sm programs an SM each taking tiles in turn, was slower at every 27B projection, run BZ
    in docs/benchmarks.md)."""
    if MLP_TILE is not None:
        return dict(MLP_TILE)
    if fp8:
        return {"block_a": 4, "block_n": 8, "block_k": 512, "num_warps": 4, "stages": 5,
                "seg_steps": 9, "per_sm": 0}  # fmt: skip
    return {"block_a": 4, "block_n": 8, "block_k": 256, "num_warps": 4, "stages": 4,
            "seg_steps": 17, "per_sm": 0}  # fmt: skip


def _sync(device: torch.device, size: int) -> torch.Tensor:
    """The counters of launches on the current stream (zeroed once; each launch leaves them zero)
    and, last, the stall flag: launches on one stream run one after another; a graph captured on
    a side stream keeps the side stream's counters, so its replays and eager launches never share
    them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    have = _SYNC.get((device, stream))
    if have is None or have.numel() <= size:
        have = torch.zeros(max(size + 1, 4096), dtype=torch.int32, device=device)
        _SYNC[(device, stream)] = have
    return have


def stalled() -> bool:
    """Whether a launch so far gave up waiting for its gate_up tiles (a scheduling bug, or
    MAX_SPINS too small for the GPU): its output was wrong. Reads the device (synchronises)."""
    return any(int(sync[-1]) != 0 for sync in _SYNC.values())


def _check(x, w_gu, s_gu, w_d, s_d, block) -> tuple[int, int, int]:
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w_gu", w_gu)
    check_last_dim_contiguous("w_d", w_d)
    rows, k = w_gu.shape
    hidden, inter = w_d.shape
    if x.numel() != k or x.shape[-1] != k or rows != 2 * inter:
        raise ValueError(
            f"gemv_mlp: one row x of K and weights [2I, K], [H, I] (x {tuple(x.shape)}, "
            f"gate_up {tuple(w_gu.shape)}, down {tuple(w_d.shape)})"
        )
    if x.dtype not in MLP_DTYPES:
        raise ValueError(f"gemv_mlp: a 16-bit row (x {x.dtype})")
    unscaled_16bit = w_gu.dtype == w_d.dtype == x.dtype
    if (s_gu is None) != (s_d is None) or (s_gu is None and not unscaled_16bit):
        raise ValueError(
            f"gemv_mlp: both weights in x's dtype, or both fp8 with scales (x {x.dtype}, gate_up "
            f"{w_gu.dtype}, down {w_d.dtype})"
        )
    if block is not None and s_gu is None:
        raise ValueError(f"gemv_mlp: block {block} given for weights without scales")
    if block is not None and inter % block[0]:
        raise ValueError(f"gemv_mlp: block scales {block} need I = {inter} a multiple of block_n")
    return inter, k, hidden


def gemv_mlp(
    x: torch.Tensor,  # [1, K] (or [K]) bf16 / fp16
    w_gu: torch.Tensor,  # [2I, K] gate rows then up rows: x's dtype, or e4m3 with s_gu
    s_gu: torch.Tensor | None,  # [2I] / [1], or block scales [ceil(2I / bn), ceil(K / bk)]
    w_d: torch.Tensor,  # [H, I] like w_gu
    s_d: torch.Tensor | None,  # [H] / [1], or block scales
    block: tuple[int, int] | None = None,  # (bn, bk) of block scales
    config: dict[str, int] | None = None,
    norm_in: PendingNorm | None = None,  # x is its x_pre
    add_norm: AddNorm | None = None,  # the output added and normed for the next GEMV
) -> torch.Tensor | PendingNorm:
    """Same result as gemv_mlp_ref up to summation order: [1, H] (or [H] for a [K] row), or with
    `add_norm` the PendingNorm of (that + residual)."""
    inter, k, hidden = _check(x, w_gu, s_gu, w_d, s_d, block)
    if norm_in is not None:
        check_pending(x, norm_in)
    cfg = config or mlp_config(inter, k, s_gu is not None)
    block_a, block_n, block_k = cfg["block_a"], cfg["block_n"], cfg["block_k"]
    seg = cfg["seg_steps"] * block_k
    if block is not None and (block[0] % block_a or block[0] % block_n or block_k % block[1]):
        raise ValueError(f"gemv_mlp: block {block} with tiles {block_a} / {block_n} x {block_k}")
    if seg % block_a:
        raise ValueError(f"gemv_mlp: segments of {seg} channels over tiles of {block_a}")
    n_segs, n_blocks = -(-inter // seg), -(-hidden // block_n)
    segs = next_pow2(n_segs)
    out = torch.empty(*x.shape[:-1], hidden, dtype=x.dtype, device=x.device)
    act = torch.empty(inter, dtype=x.dtype, device=x.device)
    parts = torch.empty(n_segs, hidden, dtype=torch.float32, device=x.device)
    sync_size = 2 + segs + n_blocks
    sync = _sync(x.device, sync_size)
    if block is not None:
        s1, s2 = s_gu.float().contiguous(), s_d.float().contiguous()
    else:
        s1 = s_gu.float().reshape(-1) if s_gu is not None else out
        s2 = s_d.float().reshape(-1) if s_d is not None else out
    in_args, in_consts = norm_in_args(norm_in, out)
    add_args, add_consts, filled = add_norm_args(add_norm, out, n_blocks)
    tiles = -(-inter // block_a) + n_segs * n_blocks
    per_sm = cfg["per_sm"]
    programs = min(tiles, num_sms(x.device) * per_sm) if per_sm else tiles
    _gemv_mlp_kernel[(programs,)](
        x,
        w_gu,
        s1,
        w_d,
        s2,
        act,
        parts,
        out,
        sync,
        sync[-1:],
        inter,
        k,
        hidden,
        w_gu.stride(0),
        w_d.stride(0),
        sync_size,
        *in_args,
        *add_args,
        SCALED=s_gu is not None and block is None,
        PER_COL=s_gu is not None and block is None and s1.numel() > 1,
        PER_COL_D=s_d is not None and block is None and s2.numel() > 1,
        SCALE_N=block[0] if block is not None else 0,
        SCALE_K=block[1] if block is not None else 0,
        EVEN_A=inter % block_a == 0 and k % block_k == 0,
        EVEN_B=hidden % block_n == 0 and inter % block_k == 0,
        STAGES=cfg["stages"],
        BLOCK_A=block_a,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SEG=seg,
        SEGS=segs,
        PERSIST=per_sm > 0,
        MAX_SPINS=MAX_SPINS,
        num_warps=cfg["num_warps"],
        **in_consts,
        **add_consts,
        **gemv_pdl(w_gu),
    )
    return out if add_norm is None else pending(out, add_norm, filled)


def mlp_fits(
    x: torch.Tensor,
    w_gu: torch.Tensor,
    s_gu: torch.Tensor | None,
    w_d: torch.Tensor,
    s_d: torch.Tensor | None,
    block: tuple[int, int] | None,
) -> bool:
    """Whether the MLP takes gemv_mlp (USE_FUSED_MLP, CUDA, one contiguous 16-bit row; both
    weights 16-bit like the row, or both fp8 with per-channel / per-tensor or fitting block
    scales)."""
    if not (
        USE_FUSED_MLP
        and use_triton(x)
        and x.numel() == x.shape[-1]
        and x.dtype in MLP_DTYPES
        and x.stride(-1) == 1
        and w_gu.stride(-1) == 1
        and w_d.stride(-1) == 1
        and w_gu.shape[0] == 2 * w_d.shape[1]
    ):
        return False
    if s_gu is None or s_d is None:
        return s_gu is None and s_d is None and w_gu.dtype == w_d.dtype == x.dtype
    if block is None:
        return s_gu.numel() in (1, w_gu.shape[0]) and s_d.numel() in (1, w_d.shape[0])
    cfg = mlp_config(w_d.shape[1], w_gu.shape[1])
    bn, bk = block
    return (
        w_d.shape[1] % bn == 0
        and bn % cfg["block_a"] == 0
        and bn % cfg["block_n"] == 0
        and cfg["block_k"] % bk == 0
    )
