"""Why the one-row fp8 GEMV reads 1.07-1.35x its floor when the bf16 one reads 1.0-1.1x: at the
27B projections, times `appliance_kernels.fp8_gemv` over its tiles and K-loop stages. Each call is
timed inside a CUDA graph of 40 launches over weight copies larger than L2, with programmatic
dependent launch off and on (the decode step runs with it on). Runs BJ / BK (docs/benchmarks.md)
also timed a [BLOCK_N] accumulator, weight tiles prefetched into registers and the first tiles
loaded before the PDL wait: slower or no faster, so they were removed. `--block`: the block-scaled
GEMV's (fp8_gemv_block) tiles and stages (run CI).

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
from appliance_kernels.fp8_block import quantize_block_ref  # noqa: E402
from appliance_kernels.fp8_gemv import block_gemv_config, fp8_gemv, fp8_gemv_block  # noqa: E402

L2_BYTES = 256 << 20


def stages(x, w_q, s, cfg):
    return fp8_gemv(x, w_q, s, None, cfg)


def tile(n, k, w, st, **extra):
    return {"block_n": n, "block_k": k, "num_warps": w, "stages": st, **extra}


VARIANTS = [("stages", stages, tile(8, 512, 4, st)) for st in (2, 3, 4, 5, 6)] + [
    ("stages", stages, tile(n, k, w, st))
    for n, k, w, st in ((16, 512, 4, 4), (8, 1024, 4, 4), (4, 512, 4, 5), (8, 256, 4, 8))
]


def block(x, w_q, s, cfg):
    return fp8_gemv_block(x, w_q, s, (128, 128), None, cfg)


BLOCK_VARIANTS = [
    ("block", block, tile(n, k, 4, st)) for n in (8, 16, 32) for k in (256, 512) for st in (3, 4, 5)
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--pdl", nargs="+", default=["off", "on"])
    p.add_argument(
        "--block",
        action="store_true",
        help="128 x 128 block scales (fp8_gemv_block, Qwen's -FP8 layout): its tiles and stages",
    )
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda") * 0.05
        if args.block:
            w_q, w_s = quantize_block_ref(w, (128, 128))
            variants = BLOCK_VARIANTS + [("default", block, block_gemv_config(n, k))]
        else:
            w_q, w_s = fp8.per_token_quant_ref(w)
            w_s = w_s.reshape(n).float()
            variants = VARIANTS
        wq = [w_q.clone() for _ in range(max(2, L2_BYTES // (n * k)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = variants[-1][1](x, w_q, w_s, variants[-1][2]).float()
        floor = n * k / bw * 1e6
        for pdl in args.pdl:
            tu.USE_PDL = pdl == "on"
            results = []
            for kind, fn, cfg in variants:
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
