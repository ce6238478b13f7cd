"""Batch-1 linear as a weight read: y = x W^T for one row x kept in bf16/fp16 and W stored fp8
e4m3 (weight-only fp8), block-scaled fp8, or in the model's 16-bit dtype.

At decode sizes a linear layer is the read of its weight: the time is bytes / bandwidth, so the
kernel's only jobs are to keep enough loads in flight and to spend nothing else. Quantising the
activations first (what the tiled and split-K fp8 GEMMs need) costs one more kernel per linear
and buys nothing here: the tensor cores are idle either way. So this kernel reads the bf16 row
as it is, converts each weight tile to fp32 and multiply-adds into a [BLOCK_N, BLOCK_K] register
tile summed over K at the end (no tensor cores: one row). Each program owns BLOCK_N output
channels and streams their whole K, so no partial sums leave the SM and there is no second
kernel; the K loop is software-pipelined (`tl.range(num_stages=...)`), which is what keeps enough
bytes in flight. More rows (batch > 1, an MTP verify) of an fp8 weight go through the fp8 x fp8
kernels; of a 16-bit weight, 2-8 rows through appliance_kernels/gemv_rows.py (tensor cores) and 2-4
over a long K through `_gemv_rows_kernel` here, more through cuBLAS.

Where each is routed (ops/bench/bench_fp8_gemv.py on the H200, docs/benchmarks.md):
- per-channel / per-tensor fp8 (`fp8_gemv`, from appliance_kernels.fp8.fp8_linear): 3.1-4.0 TB/s
against
  1.5-3.3 for quantise + tiled / split-K;
- block-scaled fp8 (`fp8_gemv_block`, from appliance_kernels.fp8_block.fp8_block_linear; Qwen's -FP8
  repos): the per-channel tile, with each K step's G scales (one vector load) on x's columns:
  from 2 % slower (gate_up) to 1.8x faster (out_proj) than quantise + block GEMM, 0.6 ms off
  the 27B step (run AG); as fast as per channel at every 27B projection since x is scaled as
  [G, 128] and laid out flat (run DH; a [BLOCK_N, G, 128] tile was 10-20 % slower at down and
  out_proj, a scalar scale load per 128 columns 1.2-2x, a per-element gather 2-4x: runs AD,
  AE, DH);
- a bf16 / fp16 weight (`linear`, from the unquantised layers and the LM head): 2-16 % faster
  than cuBLAS at every 27B projection (runs AF, AG; the bf16 27B step 15.00 -> 14.18 ms); 2-4
  rows over a long K (the down projection) with `_gemv_rows_kernel`, other 2-8 rows with
  appliance_kernels.gemv_rows (run AV: the MTP k = 3 verify at batch 1 15.61 -> 15.03 ms).
The references are the products with the dequantised weight in fp32: what these kernels compute
up to summation order (closer to the full-precision layer than the fp8 x fp8 GEMMs, which also
round the activations).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from appliance_kernels.gemv_epilogue import finish, head_scaled, load_partials, rstd_of
from appliance_kernels.gemv_norm import (
    AddNorm,
    PendingNorm,
    add_norm_args,
    check_pending,
    norm_in_args,
    pending,
    producer_pdl,
)
from appliance_kernels.gemv_rows import gemv_rows, rows_wins, store_rows
from appliance_kernels.head_norm import PendingHeadNorm, head_norm_args
from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    gemv_pdl,
    jit,
    next_pow2,
    pdl_release,
    pdl_wait,
    tl,
    use_triton,
)

GEMV_MAX_ROWS = 4  # an MTP verify at batch 1 (k + 1 rows); one row is the routed case
GEMV_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit weights `linear` reads with the GEMV
USE_GEMV = True  # False: every row count takes the GEMM routes (bench_static.py --gemv off)


def fp8_gemv_ref(
    x: torch.Tensor,  # [M, K]
    w_q: torch.Tensor,  # [N, K] e4m3 (or already dequantised)
    scale: torch.Tensor,  # [N] / [N, 1] per channel, or [1] per tensor
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    out = x.float() @ (w_q.float() * scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@jit
def _w_tile(w_rows, k, n_ok, k_size, EVEN: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile at columns k (masked unless EVEN)."""
    if EVEN:
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < k_size)[None, :], other=0.0)


@jit
def _x_tile(x_ptr, k, k_size, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + k).to(tl.float32)
    return tl.load(x_ptr + k, mask=k < k_size, other=0.0).to(tl.float32)


@jit
def _scaled_x(x_ptr, s_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K: tl.constexpr, EVEN):
    """x's BLOCK_K columns from k0 (kk: [G, SCALE_K]), each times its column block's scale: the
    G scales are one small vector load broadcast over their columns; returned flat, [BLOCK_K]."""
    sv = tl.load(s_row + k0 // SCALE_K + rg, mask=k0 + rg * SCALE_K < k_size, other=0.0)
    xs = _x_tile(x_ptr, k0 + kk, k_size, EVEN) * sv[:, None]
    return tl.reshape(xs, [BLOCK_K])


@jit
def _tail_rows(
    x_ptr,
    w2_ptr,
    out2_ptr,
    tid,
    n2_size,
    k_size,
    stride_w2n,
    np_ptr,  # NORM_IN: the pending norm's partials, their count, its eps (gemv_norm.py)
    n_parts,
    norm_eps,
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_IN: tl.constexpr,
    PARTS: tl.constexpr,
):
    """BLOCK_N rows (tile tid) of a small unscaled 16-bit weight read after a GEMV's own rows, in
    the same launch (`tail`): out2 = x W2^T (times the pending norm's 1 / rms with NORM_IN)."""
    if NORM_IN:
        partials = load_partials(np_ptr, n_parts, PARTS)
    rn = tid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < n2_size
    w_rows = w2_ptr + rn.to(tl.int64)[:, None] * stride_w2n
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        w = _w_tile(w_rows, k, n_ok, k_size, False)
        acc += w.to(tl.float32) * _x_tile(x_ptr, k, k_size, False)[None, :]
    out2 = tl.sum(acc, axis=1)
    if NORM_IN:
        out2 = out2 * rstd_of(partials, k_size, norm_eps)
    tl.store(out2_ptr + rn, out2.to(out2_ptr.dtype.element_ty), mask=n_ok)


@jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    n_size,
    k_size,
    stride_wn,
    w2_ptr,  # TAIL: a 16-bit weight [n2, K] whose rows follow W's in out
    n2_size,
    stride_w2n,
    conv_w_ptr,  # CONV_W > 0: a GDN conv over rows < conv_c (gemv_epilogue.conv_epilogue)
    conv_s_ptr,
    slot_ptr,
    init_ptr,
    conv_c,
    stride_cs,
    stride_cc,
    np_ptr,  # NORM_IN: the producer's partial sums of squares (appliance_kernels/gemv_norm.py)
    n_parts,
    norm_eps,
    res_ptr,  # ADD_NORM: residual in / out, the next norm's weight, this launch's partials
    res_out_ptr,
    nw_ptr,
    po_ptr,
    hp_ptr,  # HEAD_D > 0: a split GDN gated norm's per-head partials (head_norm.py)
    h_parts,
    h_eps,
    SCALED: tl.constexpr,  # an fp8 weight's per-channel / per-tensor scales, on the outputs
    PER_COL: tl.constexpr,  # per-channel scales (else one per tensor)
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    STAGES: tl.constexpr,  # software pipelining of the K loop (1: none)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL: tl.constexpr = False,
    CONV_W: tl.constexpr = 0,  # the conv's width; 0: no conv
    NORM_IN: tl.constexpr = False,  # x is a pending norm's x_pre: outputs times its 1 / rms
    PARTS: tl.constexpr = 1,  # power of two >= n_parts
    ADD_NORM: tl.constexpr = False,  # outputs + residual, normed for the next GEMV (gemv_norm.py)
    ZC: tl.constexpr = True,  # that norm's weight is zero-centred
    SCALE_N: tl.constexpr = 0,  # contiguous block scales [ceil(N / SCALE_N), ceil(K / SCALE_K)]
    SCALE_K: tl.constexpr = 0,  # 0: none; else BLOCK_K is a multiple of it, SCALE_N of BLOCK_N
    HEAD_D: tl.constexpr = 0,  # > 0: x's heads of HEAD_D columns each times its 1 / rms
    HPARTS: tl.constexpr = 1,  # power of two >= h_parts
    PDL: tl.constexpr = False,
    RELEASE: tl.constexpr = False,
):
    """BLOCK_N output rows of x W^T, the whole K. Block scales (SCALE_K > 0) go on the
    activations: a program's rows share one row of scales, so x's K step is loaded as [G,
    SCALE_K], times its G scales (one small vector load), then laid out flat. Measured against a
    [BLOCK_N, G, SCALE_K] tile (10-20 % slower at the 5120-row projections, run DH) and a
    per-column gather of the scales (2-4x slower; runs AD, AE, DH in docs/benchmarks.md;
    ops/gpu/block_probe.py)."""
    if RELEASE:
        pdl_release(PDL)
    pid = tl.program_id(0)
    if TAIL:  # the tail's programs come first: scheduled in the first wave, done in its time
        tail_programs = tl.cdiv(n2_size, BLOCK_N)
        if pid < tail_programs:
            pdl_wait(PDL)
            tail_args = (w2_ptr, out_ptr + n_size, pid, n2_size, k_size, stride_w2n)
            norm_in = (np_ptr, n_parts, norm_eps)
            _tail_rows(x_ptr, *tail_args, *norm_in, STAGES, BLOCK_N, BLOCK_K, NORM_IN, PARTS)
            return
        pid -= tail_programs
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < n_size
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if SCALE_K:
        rg = tl.arange(0, BLOCK_K // SCALE_K)
        kk = rg[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]  # [G, SCALE_K]
        s_row = s_ptr + (pid * BLOCK_N // SCALE_N) * tl.cdiv(k_size, SCALE_K)  # contiguous
    pdl_wait(PDL)
    if NORM_IN:  # loaded now, summed after the K loop: the load's latency hides behind it
        partials = load_partials(np_ptr, n_parts, PARTS)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        w = _w_tile(w_rows, k, n_ok, k_size, EVEN)
        if HEAD_D > 0:  # the split GDN gated norm: each head's columns times its 1 / rms
            if SCALE_K:
                xs = _scaled_x(x_ptr, s_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K, EVEN)
            else:
                xs = _x_tile(x_ptr, k, k_size, EVEN)
            xs = head_scaled(xs, hp_ptr, k0, k_size, h_parts, h_eps, HEAD_D, HPARTS, BLOCK_K)
            acc += w.to(tl.float32) * xs[None, :]
        elif SCALE_K:  # each branch keeps the op order that was timed (the compiled code too)
            xs = _scaled_x(x_ptr, s_row, k0, kk, rg, k_size, SCALE_K, BLOCK_K, EVEN)
            acc += w.to(tl.float32) * xs[None, :]
        else:
            acc += w.to(tl.float32) * _x_tile(x_ptr, k, k_size, EVEN)[None, :]
    out = tl.sum(acc, axis=1)
    if NORM_IN:
        out = out * rstd_of(partials, k_size, norm_eps)
    if SCALED:
        if PER_COL:
            out = out * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        else:
            out = out * tl.load(s_ptr)
    conv = (conv_w_ptr, conv_s_ptr, slot_ptr, init_ptr, conv_c, stride_cs, stride_cc)
    norm = (res_ptr, res_out_ptr, nw_ptr, po_ptr)
    finish(out, rn, n_ok, pid, out_ptr, bias_ptr, HAS_BIAS, *conv, CONV_W, *norm, ADD_NORM, ZC)


@jit
def _gemv_rows_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    m_size,
    n_size,
    k_size,
    stride_xm,
    stride_wn,
    stride_om,
    SCALED: tl.constexpr,
    PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    ROWS: tl.constexpr,  # next power of two of M (2 or 4)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    RELEASE: tl.constexpr = False,
):
    """_gemv_kernel for 2-4 rows (an MTP verify at batch 1): each weight tile is read once and
    multiplied into every row's [BLOCK_N, BLOCK_K] accumulator (a [ROWS, BLOCK_N, BLOCK_K] tile).
    Routed for 16-bit weights with K >= 2N (`bf16_gemv_wins`)."""
    if RELEASE:
        pdl_release(PDL)
    pid = tl.program_id(0)
    rm = tl.arange(0, ROWS)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m_size
    n_ok = rn < n_size
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    pdl_wait(PDL)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        k_ok = k < k_size
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    out = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    store_rows(
        out, s_ptr, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, SCALED, PER_COL, HAS_BIAS
    )


def gemv_wins(m: int, n: int, k: int) -> bool:
    """Where the GEMV beats quantising the row and running the fp8 x fp8 kernels: one row. On the
    H200 (ops/bench/bench_fp8_gemv.py, docs/benchmarks.md) it read the 27B weights at 3.1-4.0
    TB/s against 1.5-3.3 for the quantise + tiled / split-K route, at every projection; more rows
    (batch > 1, an MTP verify) stay on the fp8 x fp8 kernels."""
    return USE_GEMV and m == 1


def bf16_gemv_wins(m: int, n: int, k: int) -> bool:
    """A 16-bit weight: one row at every 27B projection (2-16 % faster than cuBLAS, run AG);
    2-4 rows (batch 2-4, an MTP verify at batch 1) only over a long reduction, K >= 2N, where
    cuBLAS read the 27B down projection (5120 x 17408) at 3.6 TB/s and the rows kernel at 4.2
    (42.1 against 49.8 µs at 4 rows); at the other projections cuBLAS was as fast or faster."""
    return USE_GEMV and (m == 1 or (1 < m <= GEMV_MAX_ROWS and k >= 2 * n))


# Under PDL a GDN in_proj GEMV with its conv lets the recurrence launch as its programs start, so
# the recurrence reads its state while the GEMV finishes (appliance_kernels/gdn.py PRELOAD_STATE,
# on and off with it).
CONV_RELEASE = True

# The one-row fp8 GEMV's tile where set, per channel and block (ops/bench/bench_static.py
# --fp8-gemv-tile), as gemv_config returns it.
GEMV_TILE: dict[str, int] | None = None
# The per-channel tile at the widest N (gate_up; gemv_config), settable on its own
# (bench_static.py --fp8-gemv-wide-tile): in the step's profiles the block GEMV's 32 x 256 x 5
# gate_up took 45.4 µs a launch where this took 47.0-47.5 (runs DH.4, DI.1), not yet timed per
# channel in the step.
WIDE_TILE: dict[str, int] = {"block_n": 8, "block_k": 512, "num_warps": 4, "stages": 5}


def gemv_config(n: int, k: int) -> dict[str, int]:
    """Tile, warps and K-loop stages (`ops/gpu/gemv_probe.py`, run CJ, µs with PDL against the
    8 x 512 x 3 tiles before; unpipelined, tiles were 10-40 % slower): 8 x 512 with 5 stages at
    the widest N (gate_up 44.0 / 45.1), 16 x 512 x 3 at N >= 8192 (the GDN in_proj with its bf16
    b / a rows 22.8 / 24.7; qkv 20.6 / 20.2, within the spread), 8 x 512 with 4 stages below
    (down 22.9 / 23.7, out_proj 9.8 / 10.0)."""
    if GEMV_TILE is not None:
        return dict(GEMV_TILE)
    if n > 20000:
        return dict(WIDE_TILE)
    if n >= 8192:
        return {"block_n": 16, "block_k": 512, "num_warps": 4, "stages": 3}
    return {"block_n": 8, "block_k": 512, "num_warps": 4, "stages": 4}


def bf16_gemv_config(n: int, k: int) -> dict[str, int]:
    """A 16-bit weight (run AG's sweep at the 27B projections, summed over a step's layers):
    8 x 512 tiles, 3 stages at K <= 5120 (qkv 35.2 µs, gate_up 79.9, in_proj 42.0 against
    39.2 / 84.2 / 39.8 for 8 x 256); 8 x 256, 4 stages at the longer K (down 41.6 µs against
    cuBLAS 49.5; out_proj 16.5 either way)."""
    if k <= 5120:
        return {"block_n": 8, "block_k": 512, "num_warps": 4, "stages": 3}
    return {"block_n": 8, "block_k": 256, "num_warps": 4, "stages": 4}


def block_gemv_config(n: int, k: int) -> dict[str, int]:
    """Block scales: 32 x 256 with 5 stages at the widest N (gate_up 45.4 µs a launch in the
    step's profile, 49.1 with the per-channel 8 x 512 x 5), else the per-channel tiles. Alone
    (ops/gpu/gemv_probe.py --kind block, run DH) 32 x 256 tiles also read the in_proj and qkv
    as fast or 0.3-0.8 µs faster, but in the step those GEMVs finish the pending norm, which
    takes them to 144-168 registers and 3 programs per SM: 515 and 448 programs of 32 rows then
    run in 1.3 and 1.1 waves (29.8 and 24.9 µs a launch against 27.4 and 21.1 with 16 x 512 x 3,
    run DH, profiles without PDL)."""
    if n > 20000 and GEMV_TILE is None:
        return {"block_n": 32, "block_k": 256, "num_warps": 4, "stages": 5}
    return gemv_config(n, k)


def block_gemv_fits(block: tuple[int, int], n: int, k: int) -> bool:
    """Whether fp8_gemv_block's tiles fit the scale blocks (Qwen's 128 x 128 do)."""
    cfg = block_gemv_config(n, k)
    bn, bk = block
    return bn % cfg["block_n"] == 0 and cfg["block_k"] % bk == 0 and bk & (bk - 1) == 0


def linear(
    x: torch.Tensor,  # [.., K]
    weight: torch.Tensor,  # [N, K] in x's dtype
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, except where a GEMV beats cuBLAS on CUDA: one row and 2-4 over a long K
    (`bf16_gemv_wins`), else 2-8 rows on the tensor cores
    (appliance_kernels.gemv_rows.rows_wins)."""
    m = x.numel() // x.shape[-1]
    if (
        use_triton(x)
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
    ):
        n, k = weight.shape
        if bf16_gemv_wins(m, n, k):
            out = fp8_gemv(x.reshape(-1, k), weight, None, bias, bf16_gemv_config(n, k))
            return out.reshape(*x.shape[:-1], n)  # rows of any leading shape, as F.linear
        if rows_wins(m, n, k):
            return gemv_rows(x, weight, None, bias)
    return F.linear(x, weight, bias)


def _prepare(
    x, w_q, config, max_rows=1, tail=None
) -> tuple[int, int, dict[str, int], torch.Tensor]:
    """Checks the rows against the weight (and a tail weight); (N, K, the tile config, the
    output: N columns, then the tail's)."""
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("w_q", w_q)
    n, k = w_q.shape
    if x.shape[-1] != k or x.numel() > max_rows * k:
        many = "one row" if max_rows == 1 else f"at most {max_rows} rows"
        raise ValueError(f"fp8 GEMV: x {tuple(x.shape)} w {tuple(w_q.shape)} ({many} of K)")
    n2 = 0
    if tail is not None:
        check_last_dim_contiguous("tail", tail)
        if tail.dim() != 2 or tail.shape[1] != k or tail.dtype != x.dtype or x.numel() != k:
            raise ValueError(
                f"fp8 GEMV: a tail {tuple(tail.shape)} {tail.dtype} needs one row x of K = {k} "
                f"in its dtype (x {tuple(x.shape)} {x.dtype})"
            )
        n2 = tail.shape[0]
    out = torch.empty(*x.shape[:-1], n + n2, dtype=x.dtype, device=x.device)
    return n, k, config or gemv_config(n, k), out


class GemvConv(NamedTuple):
    """A GDN layer's causal depthwise conv + SiLU that a one-row GEMV applies to its first C
    outputs as it stores them (`conv=`), updating the conv state: causal_conv1d_ref at one token
    of one request. Saves the conv's launch at batch-1 decode."""

    weight: torch.Tensor  # [C, W]
    states: torch.Tensor  # [slots, C, W - 1]
    slot: torch.Tensor  # [1] int: the request's state slot
    has_initial_state: torch.Tensor  # [1]: whether the slot holds a state (else zeros)


def _conv_args(conv: GemvConv | None, x: torch.Tensor, n: int) -> tuple[tuple, dict]:
    """The kernels' conv arguments and CONV_W (0 without a conv)."""
    if conv is None:
        return (x, x, x, x, 0, 0, 0), {}
    c, width = conv.weight.shape
    if (
        x.numel() != x.shape[-1]
        or c > n
        or width < 2
        or not conv.weight.is_contiguous()
        or conv.states.shape[1:] != (c, width - 1)
        or conv.states.stride(-1) != 1
    ):
        raise ValueError(
            f"fp8 GEMV conv: one row x, a [C <= {n}, W] weight and [slots, C, W - 1] states "
            f"(x {tuple(x.shape)}, weight {tuple(conv.weight.shape)}, "
            f"states {tuple(conv.states.shape)})"
        )
    states = conv.states
    args = (conv.weight, states, conv.slot, conv.has_initial_state, c)
    return (*args, states.stride(0), states.stride(1)), {"CONV_W": width}


def _tail_args(tail: torch.Tensor | None, w_q: torch.Tensor, block_n: int) -> tuple[tuple, int]:
    """The kernels' (w2, n2, stride) arguments and the tail's program count."""
    if tail is None:
        return (w_q, 0, 0), 0
    return (tail, tail.shape[0], tail.stride(0)), -(-tail.shape[0] // block_n)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] (or [K]) bf16 / fp16 / fp32, M <= GEMV_MAX_ROWS
    w_q: torch.Tensor,  # [N, K] e4m3 (or bf16 / fp16 with scale None: the same read, unscaled)
    scale: torch.Tensor | None,  # [N] / [N, 1] per channel, or [1] per tensor
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
    tail: torch.Tensor | None = None,  # [N2, K] in x's dtype: its rows too, in the same launch
    conv: GemvConv | None = None,  # one row: its first C outputs through this GDN conv
    norm_in: PendingNorm | None = None,  # one row: x is its x_pre (appliance_kernels/gemv_norm.py)
    add_norm: AddNorm | None = None,  # one row: the output added and normed for the next GEMV
    head_norm: PendingHeadNorm | None = None,  # one row: x is its y (head_norm.py)
) -> torch.Tensor | PendingNorm:
    """Same result as fp8_gemv_ref up to summation order; [M, N] (or [N] for a [K] input). A
    16-bit weight goes with scale None (`linear`); 2-4 rows run `_gemv_rows_kernel` (routed for
    16-bit weights with K >= 2N only: slower than the fp8 x fp8 route and mostly than cuBLAS).
    With a `tail` (one row only): [.., N + N2], x W^T then x tail^T (unscaled, no bias), one
    launch: the GDN layer's bf16 b / a rows beside an fp8 in_proj; with a `conv` (one row only),
    the first C outputs leave through that GDN conv (GemvConv). With `norm_in` every output (the
    tail's too) is multiplied by the pending norm's 1 / rms; with `add_norm` the result is the
    PendingNorm of (output + residual) for the next GEMV; with `head_norm` each head's columns of
    x are multiplied by that head's 1 / rms as they are read (x W^T of head_norm.materialize())."""
    n, k, cfg, out = _prepare(x, w_q, config, GEMV_MAX_ROWS, tail)
    conv_args, conv_consts = _conv_args(conv, x, n)
    if (norm_in, add_norm, head_norm) != (None,) * 3 and x.numel() != k:
        raise ValueError(f"fp8 GEMV: norm_in / add_norm / head_norm take one row (x {x.shape})")
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    s = scale.float().reshape(-1) if scale is not None else out
    m = x.numel() // k
    common = dict(
        SCALED=scale is not None,
        PER_COL=scale is not None and s.numel() > 1,
        HAS_BIAS=bias is not None,
        STAGES=cfg.get("stages", 1),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
    )
    pdl_options = _release(gemv_pdl(w_q), add_norm, conv)
    if m > 1:  # 2-4 rows: their own kernel (routed for a 16-bit weight with K >= 2N)
        _gemv_rows_kernel[(-(-n // block_n),)](
            x,
            w_q,
            s,
            bias if bias is not None else s,
            out,
            m,
            n,
            k,
            x.stride(-2),
            w_q.stride(0),
            out.stride(-2),
            ROWS=next_pow2(m),
            **common,
            **pdl_options,
        )
        return out
    tail_args, tail_programs = _tail_args(tail, w_q, block_n)
    norms = (norm_in, add_norm, head_norm)
    norm_args, norm_consts, filled = _norm_args(x, out, *norms, block_k, -(-n // block_n))
    _gemv_kernel[(-(-n // block_n) + tail_programs,)](
        x,
        w_q,
        s,
        bias if bias is not None else s,
        out,
        n,
        k,
        w_q.stride(0),
        *tail_args,
        *conv_args,
        *norm_args,
        EVEN=n % block_n == 0 and k % block_k == 0,
        TAIL=tail is not None,
        **conv_consts,
        **norm_consts,
        **common,
        **pdl_options,
    )
    return out if add_norm is None else pending(out, add_norm, filled)


def _release(options: dict, add_norm: AddNorm | None, conv: GemvConv | None) -> dict:
    """A one-row GEMV's PDL options: a split norm's producer (gemv_norm.producer_pdl) and a GDN
    in_proj with its conv (CONV_RELEASE) let the next kernel launch as their programs start."""
    if add_norm is not None:
        return producer_pdl(options)
    return options | {"RELEASE": True} if options and conv is not None and CONV_RELEASE else options


def _norm_args(
    x, out, norm_in, add_norm, head_norm, block_k, programs
) -> tuple[tuple, dict, tuple | None]:
    """The kernels' norm_in + add_norm + head_norm arguments, constexprs and the add_norm
    outputs."""
    if norm_in is not None:
        check_pending(x, norm_in)
    if norm_in is not None and head_norm is not None:
        raise ValueError("fp8 GEMV: norm_in and head_norm both scale the row; one at most")
    in_args, in_consts = norm_in_args(norm_in, out)
    add_args, add_consts, filled = add_norm_args(add_norm, out, programs)
    head_args, head_consts = head_norm_args(head_norm, x, block_k, out)
    return (*in_args, *add_args, *head_args), in_consts | add_consts | head_consts, filled


# ------------------------------------------ block scales ------------------------------------------


def fp8_gemv_block_ref(
    x: torch.Tensor,  # [M, K]
    w_q: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    (bn, bk), (n, k) = block, w_q.shape
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return fp8_gemv_ref(x, w_q.float() * s, s.new_ones(1), bias)


def fp8_gemv_block(
    x: torch.Tensor,  # [1, K] (or [K])
    w_q: torch.Tensor,  # [N, K] e4m3
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] fp32
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    tail: torch.Tensor | None = None,  # as in fp8_gemv
    conv: GemvConv | None = None,  # as in fp8_gemv
    norm_in: PendingNorm | None = None,  # as in fp8_gemv
    add_norm: AddNorm | None = None,  # as in fp8_gemv
    head_norm: PendingHeadNorm | None = None,  # as in fp8_gemv
) -> torch.Tensor | PendingNorm:
    """Same result as fp8_gemv_block_ref up to summation order (fp8_block_linear's one-row
    route); a `tail`, a `conv`, `norm_in`, `add_norm` and `head_norm` as in fp8_gemv."""
    n, k, _, out = _prepare(x, w_q, config, 1, tail)
    conv_args, conv_consts = _conv_args(conv, x, n)
    cfg = config or block_gemv_config(n, k)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    bn, bk = block
    if bn % block_n or block_k % bk or bk & (bk - 1):
        raise ValueError(f"fp8 GEMV: block {block} with {block_n} x {block_k} tiles")
    s = scale.float().contiguous()
    tail_args, tail_programs = _tail_args(tail, w_q, block_n)
    norms = (norm_in, add_norm, head_norm)
    norm_args, norm_consts, filled = _norm_args(x, out, *norms, block_k, -(-n // block_n))
    _gemv_kernel[(-(-n // block_n) + tail_programs,)](
        x,
        w_q,
        s,
        bias if bias is not None else s,
        out,
        n,
        k,
        w_q.stride(0),
        *tail_args,
        *conv_args,
        *norm_args,
        SCALE_N=bn,
        SCALE_K=bk,
        SCALED=False,
        PER_COL=False,
        HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0,
        STAGES=cfg.get("stages", 1),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TAIL=tail is not None,
        **conv_consts,
        **norm_consts,
        num_warps=cfg["num_warps"],
        **_release(gemv_pdl(w_q), add_norm, conv),
    )
    return out if add_norm is None else pending(out, add_norm, filled)
