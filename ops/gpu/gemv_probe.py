"""Why the one-row fp8 GEMV reads 1.07-1.35x its floor when the bf16 one reads 1.0-1.1x: at the
27B projections, times `appliance_kernels.fp8_gemv` over its tiles and K-loop stages. Each call is
timed inside a CUDA graph of 40 launches over weight copies larger than L2, with programmatic
dependent launch off and on (the decode step runs with it on). Runs BJ / BK (docs/benchmarks.md)
also timed a [BLOCK_N] accumulator, weight tiles prefetched into registers and the first tiles
loaded before the PDL wait: slower or no faster, so they were removed.

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

from appliance_kernels import fp8  # noqa: E402
from appliance_kernels import triton_utils as tu  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv  # noqa: E402
from appliance_kernels.triton_utils import jit, pdl_wait, tl  # noqa: E402

L2_BYTES = 256 << 20


def stages(x, w_q, s, cfg):
    return fp8_gemv(x, w_q, s, None, cfg)


@jit
def _math_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    k_size,
    stride_wn,
    MATH: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The plain kernel's loads with other arithmetic, to see whether the e4m3 -> fp32 conversion
    and the fp32 multiply-add bound the fp8 GEMV: MATH 0 as fp8_gemv (e4m3 -> fp32, fp32 FMA);
    1 e4m3 -> fp16 and an fp16 product widened to fp32; 2 the e4m3 bits moved into an fp32's by
    integer ops (2^-120 times the value, subnormals included; the sum times 2^120 at the end); 3
    no floating point at all (the bytes summed as integers: a wrong result, the load-only
    time)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    pdl_wait(PDL)
    if MATH == 3:
        iacc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        k = k0 + rk
        w = tl.load(w_rows + k[None, :])
        x = tl.load(x_ptr + k)
        if MATH == 0:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        elif MATH == 1:
            acc += (w.to(tl.float16) * x.to(tl.float16)[None, :]).to(tl.float32)
        elif MATH == 2:  # e4m3 bits placed in an fp32's: 2^-120 times the value (also subnormal)
            b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
            wf = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
            acc += wf * x.to(tl.float32)[None, :]
        else:
            iacc += w.to(tl.int8, bitcast=True).to(tl.int32)
    if MATH == 3:
        acc = iacc.to(tl.float32)
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + rn)
    if MATH == 2:
        out = out * 1.329227995784916e36  # 2^120
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


def math_variant(x, w_q, s, cfg):
    n, k = w_q.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _math_kernel[(n // cfg["block_n"],)](
        x,
        w_q,
        s,
        out,
        k,
        w_q.stride(0),
        MATH=cfg["math"],
        STAGES=cfg["stages"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"],
        **tu.pdl(w_q),
    )
    return out


def tile(n, k, w, st, **extra):
    return {"block_n": n, "block_k": k, "num_warps": w, "stages": st, **extra}


VARIANTS = [("stages", stages, tile(8, 512, 4, st)) for st in (3, 4)] + [
    (f"math{m}", math_variant, tile(8, 512, 4, st, math=m)) for m in (0, 1, 2, 3) for st in (3, 4)
]


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
