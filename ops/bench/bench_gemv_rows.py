"""2-16 rows times a 27B weight on the GPU: the tensor-core rows GEMV
(appliance_kernels/gemv_rows.py) over a sweep of its tiles, against what the layers run today
(`linear`: cuBLAS or the FMA rows GEMV for 16-bit weights; fp8_linear for fp8) and cuBLAS bf16, next
to the weight-read floor measured in the same run (bytes / copy bandwidth). Timed as
bench_fp8_gemv.py times (a CUDA graph of launches cycling over more weight copies than L2 holds).
  python ops/bench/bench_gemv_rows.py --json rows.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
from bench_fp8_gemv import L2_BYTES, SHAPES, graph_time_us
from bench_static import copy_bandwidth

from appliance_kernels import fp8
from appliance_kernels.activation import silu_and_mul
from appliance_kernels.fp8_gemv import linear
from appliance_kernels.gemv_rows import gemv_rows, rows_config
from appliance_kernels.gemv_swiglu import gemv_swiglu, swiglu_config

DEV = "cuda"


def tiles(full: bool) -> list[dict]:
    if not full:
        return []
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))
    return [
        {"block_n": n, "block_k": k, "num_warps": w, "stages": st}
        for n, k, w, st in grid
        if n * k <= 16384
    ]


F16_TILES = [
    {"block_n": n, "block_k": k, "num_warps": w, "stages": st}
    for n, k, w, st in ((32, 256, 4, 3), (64, 256, 8, 3), (64, 128, 4, 4), (32, 512, 4, 3))
]


def sweep(x, weights, scale, configs) -> list[tuple[float, dict]]:
    runs = []
    for cfg in configs:
        try:
            runs.append(
                (graph_time_us([partial(gemv_rows, x, w, scale, None, cfg) for w in weights]), cfg)
            )
        except Exception as exc:  # a tile Triton cannot build: reported, skipped
            print(f"    {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
    return sorted(runs, key=lambda t: t[0])


def swiglu_rows(bw: float, full: bool) -> list[dict]:
    """One row through the 27B MLP's gate_up + activation: appliance_kernels/gemv_swiglu.py over a
    few tiles against the two kernels the step runs today (the gate_up GEMV, then silu_and_mul)."""
    n, k = SHAPES["mlp gate_up"]
    w = torch.randn(n, k, device=DEV) * 0.05
    w_q, w_s = fp8.per_token_quant_ref(w)
    w_s = w_s.reshape(n)
    w16 = w.to(torch.bfloat16)
    del w
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    tiles = [swiglu_config(n // 2, k)] + (
        [
            {"block_n": bn, "block_k": bk, "num_warps": 4, "stages": st}
            for bn, bk, st in ((2, 512, 3), (4, 256, 4), (8, 512, 3), (4, 1024, 3), (8, 256, 4))
        ]
        if full
        else []
    )
    out = []
    for kind, base, scale in (("bf16", w16, None), ("fp8", w_q, w_s)):
        weights = [base.clone() for _ in range(max(2, L2_BYTES // base.nbytes))]
        if scale is None:
            today = graph_time_us([partial(_two_kernels, linear, x, v) for v in weights])
        else:
            today = graph_time_us(
                [partial(_two_kernels, fp8.fp8_linear, x, v, scale) for v in weights]
            )
        runs = sorted(
            (
                (graph_time_us([partial(gemv_swiglu, x, v, scale, c) for v in weights]), c)
                for c in tiles
            ),
            key=lambda t: t[0],
        )
        floor = base.nbytes / bw * 1e6
        best_us, best = runs[0]
        print(
            f"gate_up + act {kind:4s} floor {floor:6.1f} | GEMV + silu_and_mul {today:6.1f}"
            f" | fused {best_us:6.1f} {tuple(best.values())}"
            f" | all {[(round(us, 1), tuple(c.values())) for us, c in runs]}",
            flush=True,
        )
        out.append(
            {
                "weight": kind,
                "floor_us": floor,
                "two_kernels_us": today,
                "fused_us": best_us,
                "fused": best,
            }
        )
        del weights
    return out


def _two_kernels(fn, x, *args):
    return silu_and_mul(fn(x, *args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--quick", action="store_true", help="the default tile only")
    p.add_argument("--swiglu", action="store_true", help="also the one-row gate_up + activation")
    p.add_argument(
        "--f16-rows",
        action="store_true",
        help="fp8 weights: also the rows kernel on fp16 rows (the weight converted to fp16, which "
        "the GPU does in one instruction per two values, against bf16's longer path)",
    )
    p.add_argument("--json")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    swiglu = swiglu_rows(bw, not args.quick) if args.swiglu else []
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=DEV) * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        w_s = w_s.reshape(n)
        w16 = w.to(torch.bfloat16)
        del w
        for kind in args.weights:
            base, scale = (w16, None) if kind == "bf16" else (w_q, w_s)
            weights = [base.clone() for _ in range(max(2, L2_BYTES // base.nbytes))]
            floor_us = base.nbytes / bw * 1e6
            for m in args.m:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                if kind == "bf16":
                    routed = graph_time_us([partial(linear, x, v) for v in weights])
                    cublas = graph_time_us([partial(torch.matmul, x, v.t()) for v in weights])
                else:
                    routed = graph_time_us([partial(fp8.fp8_linear, x, v, scale) for v in weights])
                    cublas = float("nan")
                default = graph_time_us([partial(gemv_rows, x, v, scale) for v in weights])
                runs = sweep(x, weights, scale, tiles(not args.quick)) or [
                    (default, rows_config(n, k))
                ]
                best_us, best = runs[0]
                row = {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "weight": kind,
                    "floor_us": floor_us,
                    "routed_us": routed,
                    "cublas_us": cublas,
                    "rows_default_us": default,
                    "rows_best_us": best_us,
                    "rows_best": best,
                    "top5": [(round(us, 2), c) for us, c in runs[:5]],
                }
                if args.f16_rows and kind == "fp8":  # e4m3 -> f16 is one cvt per two values
                    f16 = sweep(x.half(), weights, scale, F16_TILES)
                    row["rows_f16_us"], row["rows_f16"] = f16[0]
                    print(f"    fp16 rows: {[(round(us, 1), tuple(c.values())) for us, c in f16]}")
                rows.append(row)
                print(
                    f"{name:20s} {kind:4s} M={m:2d} floor {floor_us:6.1f} | routed {routed:6.1f}"
                    f" cublas {cublas:6.1f} | rows default {default:6.1f}"
                    f" best {best_us:6.1f} ({best_us / floor_us:.2f}x) {tuple(best.values())}"
                    f" | next {[(us, tuple(c.values())) for us, c in row['top5'][1:4]]}",
                    flush=True,
                )
            del weights
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows, "swiglu": swiglu}, f, indent=1)


if __name__ == "__main__":
    main()
