"""Why the one-row fp8 GEMV reads 1.07-1.35x its floor when the bf16 one reads 1.0-1.1x: at the
27B projections, times `kernels.fp8_gemv` at more K-loop stages than the bench's sweep, with
its [BLOCK_N] accumulator (ROW_ACC: fewer registers, more programs per SM), and a variant here that
prefetches weight tiles into registers two or three K steps ahead (no shared-memory round
trip): each keeps more weight bytes in flight per SM. Each call is timed inside a CUDA graph of 40
launches over weight copies larger than L2, with programmatic dependent launch off and on (the
decode step runs with it on). The variants live here until one wins.

  python3 ops/gpu/gemv_probe.py [--shapes ...] [--pdl off on]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]  # bench_fp8_gemv imports bench_static

from bench_fp8_gemv import SHAPES, copy_bandwidth, graph_time_us  # noqa: E402

from kernels import fp8  # noqa: E402
from kernels import triton_utils as tu  # noqa: E402
from kernels.fp8_gemv import fp8_gemv  # noqa: E402
from kernels.triton_utils import jit, pdl_wait, tl  # noqa: E402

L2_BYTES = 256 << 20


@jit
def _gemv_regs_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    k_size,
    stride_wn,
    DEPTH: tl.constexpr,  # 2 or 3 weight tiles loaded ahead, in registers
    ACC1D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The weight tiles of the next DEPTH K steps are loaded into registers before the current
    one is multiplied (no cp.async / shared memory); K must be a multiple of BLOCK_K and hold at
    least DEPTH + 1 steps."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    steps = k_size // BLOCK_K
    w0 = tl.load(w_rows + rk[None, :])
    w1 = tl.load(w_rows + (BLOCK_K + rk)[None, :])
    w2 = w1
    if DEPTH == 3:
        w2 = tl.load(w_rows + (2 * BLOCK_K + rk)[None, :])
    pdl_wait(PDL)
    if ACC1D:
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.range(0, steps, num_stages=1):
        k_next = (i + DEPTH) * BLOCK_K + rk
        wn = tl.load(w_rows + k_next[None, :], mask=(k_next < k_size)[None, :], other=0.0)
        x = tl.load(x_ptr + i * BLOCK_K + rk).to(tl.float32)
        prod = w0.to(tl.float32) * x[None, :]
        if ACC1D:
            acc1 += tl.sum(prod, axis=1)
        else:
            acc2 += prod
        if DEPTH == 3:
            w0 = w1
            w1 = w2
            w2 = wn
        else:
            w0 = w1
            w1 = wn
    if ACC1D:
        out = acc1
    else:
        out = tl.sum(acc2, axis=1)
    out = out * tl.load(s_ptr + rn)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


def regs(x, w_q, s, cfg):
    n, k = w_q.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_regs_kernel[(n // cfg["block_n"],)](
        x, w_q, s, out, k, w_q.stride(0), DEPTH=cfg["depth"], ACC1D=cfg["acc1d"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
        num_stages=1, **tu.gemv_pdl(w_q),
    )  # fmt: skip
    return out


def stages(x, w_q, s, cfg):
    return fp8_gemv(x, w_q, s, None, cfg)


def tile(n, k, w, st, **extra):
    return {"block_n": n, "block_k": k, "num_warps": w, "stages": st, **extra}


VARIANTS = (
    [("stages", stages, tile(8, 512, 4, st)) for st in (2, 3, 4, 5, 6)]
    + [
        ("stages", stages, tile(n, k, w, st))
        for n, k, w, st in ((16, 512, 4, 4), (8, 1024, 4, 4), (4, 512, 4, 5), (8, 256, 4, 8))
    ]
    + [
        ("rowacc", stages, tile(n, k, 4, st, row_acc=1))
        for n, k, st in ((8, 512, 3), (8, 512, 5), (16, 512, 4), (16, 512, 6), (8, 1024, 4))
    ]
    + [
        ("regs", regs, tile(n, k, 4, 1, depth=d, acc1d=a))
        for n, k, d, a in (
            (8, 512, 2, False),
            (8, 512, 3, False),
            (8, 512, 3, True),
            (16, 256, 3, True),
        )
    ]
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--pdl", nargs="+", default=["off", "on"])
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda") * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        w_s = w_s.reshape(n).float()
        wq = [w_q.clone() for _ in range(max(2, L2_BYTES // (n * k)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = fp8_gemv(x, w_q, w_s).float()
        floor = n * k / bw * 1e6
        for pdl in args.pdl:
            tu.USE_PDL = pdl == "on"
            results = []
            for kind, fn, cfg in VARIANTS:
                try:
                    got = fn(x, w_q, w_s, cfg)
                    err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
                    us = graph_time_us([partial(fn, x, q, w_s, cfg) for q in wq])
                    results.append((us, kind, cfg, err))
                except Exception as exc:  # noqa: BLE001 - a variant Triton cannot build: shown
                    print(f"  {name} {kind} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
            results.sort(key=lambda r: r[0])
            print(f"{name:20s} N={n} K={k} pdl={pdl} floor {floor:6.1f} us")
            for us, kind, cfg, err in results:
                print(
                    f"   {us:6.1f} us {us / floor:5.2f}x {n * k / us / 1e3:5.0f} GB/s"
                    f"  {kind:6s} {tuple(cfg.values())} err {err:.1e}"
                )
        tu.USE_PDL = False
        del wq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
