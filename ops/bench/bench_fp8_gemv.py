"""Decode-sized fp8 linears as weight reads on the GPU: what fp8_linear runs, the fp8 x fp8 route
(per-token activation quantisation + tiled / split-K fp8 GEMM) and, at one row, the weight-only
GEMV of appliance_kernels/fp8_gemv.py over a sweep of its tiles; the block-scaled variants, a bf16
GEMM (cuBLAS, and the same GEMV reading the bf16 weight) and the copy bandwidth measured in the same
run (the floor: fp8 weight bytes / copy bandwidth, from bench_static.copy_bandwidth: copies timed
outside any graph, where a captured copy becomes a memcpy node that ran at 2.7 TB/s against 4.2).

Every case is timed as a CUDA graph of REPS launches cycling over enough weight copies that none is
served from L2 (what a model step sees: each layer's weight is read once), so launch overhead is
the graph's, as in the served decode step.
  python ops/bench/bench_fp8_gemv.py --json gemv.json     # Qwen3.5-27B shapes, 1 / 2 / 4 rows
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch

from appliance_kernels import fp8, fp8_block
from appliance_kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv, fp8_gemv_block, gemv_config, linear

SHAPES = {  # Qwen3.5-27B, TP1: (N, K)
    "gdn in_proj qkvz": (16384, 5120),
    "gdn out_proj": (5120, 6144),
    "attn qkv (gated q)": (14336, 5120),
    "mlp gate_up": (34816, 5120),
    "mlp down": (5120, 17408),
}


def copy_bandwidth() -> float:
    """bench_static.copy_bandwidth, imported when called: importing this module (its SHAPES, the
    timing helpers) then needs no engine package (ops/bench/bench_block_mm.py)."""
    from bench_static import copy_bandwidth as measure  # ops/bench is on the path as a script

    return measure()


L2_BYTES = 256 << 20  # copies of each weight: more than L2 (50 MB) several times over
REPS = 40
DEV = "cuda"


def sweep_configs(full: bool) -> list[dict]:
    if not full:
        return []
    grid = itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (1, 3))
    return [{"block_n": n, "block_k": k, "num_warps": w, "stages": st} for n, k, w, st in grid]


def graph_time_us(fns: list, reps: int = REPS) -> float:
    """Mean µs of one call when `reps` calls (cycling over fns) replay as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    del graph
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="the default tile only, no sweep")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4], help="rows")
    p.add_argument("--json")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, L2_BYTES // (n * k))
        w = torch.randn(n, k, device=DEV) * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        w_s = w_s.reshape(n)
        b_q, b_s = fp8_block.quantize_block_ref(w, (128, 128))
        w16 = w.to(torch.bfloat16)
        del w
        wq = [w_q.clone() for _ in range(copies)]
        bq = [b_q.clone() for _ in range(copies)]
        w16s = [w16.clone() for _ in range(max(2, copies // 2))]
        floor_us = n * k / bw * 1e6
        for m in args.m:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m, "floor_us": floor_us}
            row["quant+gemm_us"] = graph_time_us([partial(_fp8_route, x, q, w_s) for q in wq])
            row["block quant+gemm_us"] = graph_time_us(
                [partial(_fp8_block_route, x, q, b_s) for q in bq]
            )
            row["bf16_us"] = graph_time_us([partial(torch.matmul, x, v.t()) for v in w16s])
            if m <= GEMV_MAX_ROWS:  # the GEMV reading the bf16 weight, over a few tiles
                row["bf16_gemv_us"], row["bf16_gemv"] = best_of(x, w16s, None, BF16_TILES)
            row["bf16_linear_us"] = graph_time_us([partial(linear, x, v) for v in w16s])
            row["fp8_linear_us"] = graph_time_us([partial(fp8.fp8_linear, x, q, w_s) for q in wq])
            line = (
                f"{name:20s} M={m} floor {floor_us:6.1f} |"
                f" fp8_linear {row['fp8_linear_us']:6.1f} ({row['fp8_linear_us'] / floor_us:.2f}x)"
                f" | quant+gemm {row['quant+gemm_us']:6.1f}"
                f" block {row['block quant+gemm_us']:6.1f} | bf16 {row['bf16_us']:6.1f}"
                f" routed {row['bf16_linear_us']:6.1f}"
                + (
                    f" (gemv {row['bf16_gemv_us']:6.1f} {row['bf16_gemv']})"
                    if m <= GEMV_MAX_ROWS
                    else ""
                )
            )
            if 1 < m <= GEMV_MAX_ROWS:  # the rows GEMV on the fp8 weight (not routed)
                row["rows_gemv_us"], row["rows_gemv"] = best_of(x, wq, w_s, BF16_TILES)
                line += f" | rows gemv {row['rows_gemv_us']:6.1f} {row['rows_gemv']}"
            if m == 1:
                row.update(gemv_row(x, wq, w_s, not args.quick))
                row.update(block_gemv_row(x, bq, b_s))
                row["block_linear_us"] = graph_time_us(
                    [partial(fp8_block.fp8_block_linear, x, q, b_s, (128, 128)) for q in bq]
                )
                best_us = row["gemv_best_us"]
                line += (
                    f" | gemv {row['gemv_default_us']:6.1f}"
                    f" block routed {row['block_linear_us']:6.1f}"
                    f" gemv {row['block_gemv_us']:6.1f} {row['block_gemv']}"
                    f" best {best_us:6.1f} ({best_us / floor_us:.2f}x,"
                    f" {n * k / best_us / 1e3:.0f} GB/s) {row['gemv_best']}"
                )
            rows.append(row)
            print(line, flush=True)
        del wq, bq, w16s
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)


BF16_TILES = [  # a few tiles for the bf16-weight GEMV (one row, and 2-4 rows)
    {"block_n": n, "block_k": k, "num_warps": 4, "stages": st}
    for n, k, st in ((8, 256, 3), (8, 512, 3), (4, 512, 3), (16, 256, 3), (8, 256, 4), (4, 256, 4))
]
BLOCK_TILES = ((8, 512, 4, 3), (16, 512, 4, 3), (8, 256, 4, 4), (8, 1024, 4, 3), (16, 256, 8, 3))


def block_gemv_row(x, bq, b_s) -> dict:
    """The block-scaled GEMV over a few tiles (fp8_block_linear's route: its default tile)."""
    runs = []
    for n, k, w, st in BLOCK_TILES:
        cfg = {"block_n": n, "block_k": k, "num_warps": w, "stages": st}
        fns = [partial(fp8_gemv_block, x, q, b_s, (128, 128), None, cfg) for q in bq]
        runs.append((graph_time_us(fns), cfg))
    print("    block:", " ".join(f"{us:.1f}{tuple(c.values())}" for us, c in runs))
    runs.sort(key=lambda t: t[0])
    return {"block_gemv_us": runs[0][0], "block_gemv": runs[0][1]}


def best_of(x, weights, scale, configs) -> tuple[float, dict]:
    """(µs, config) of fp8_gemv at its fastest of `configs` over the weight copies; every
    config's time is printed."""
    timed = [
        (graph_time_us([partial(fp8_gemv, x, w, scale, None, c) for w in weights]), c)
        for c in configs
    ]
    print("   ", " ".join(f"{us:.1f}{tuple(c.values())}" for us, c in timed))
    return min(timed, key=lambda t: t[0])


def gemv_row(x, wq, w_s, full: bool) -> dict:
    """The GEMV at its default tile and the sweep's best tiles."""
    row = {"gemv_default_us": graph_time_us([partial(fp8_gemv, x, q, w_s) for q in wq])}
    sweep = [(row["gemv_default_us"], gemv_config(*wq[0].shape))]
    for cfg in sweep_configs(full):
        try:
            us = graph_time_us([partial(fp8_gemv, x, q, w_s, config=cfg) for q in wq])
            sweep.append((us, cfg))
        except Exception as exc:  # a tile Triton cannot build: reported, skipped
            print(f"  {tuple(wq[0].shape)} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
    sweep.sort(key=lambda t: t[0])
    row["gemv_best_us"], row["gemv_best"] = sweep[0]
    row["sweep_top5"] = [(round(us, 2), c) for us, c in sweep[:5]]
    return row


def _fp8_route(x, w_q, w_s):
    """The fp8 x fp8 route: per-token quant + split-K / tiled GEMM."""
    x_q, x_s = fp8.fp8_quant(x, per_token=True)
    if fp8.splitk_wins(x.shape[0], w_q.shape[0], w_q.shape[1]):
        return fp8.fp8_splitk_mm(x_q, w_q, x_s, w_s, x.dtype)
    return fp8.fp8_scaled_mm_triton(x_q, w_q, x_s, w_s, x.dtype)


def _fp8_block_route(x, w_q, w_s):
    x_q, x_s = fp8_block.per_token_group_quant(x, 128)
    if fp8_block.splitk_wins(x.shape[0], w_q.shape[0], w_q.shape[1]):
        return fp8_block.fp8_splitk_block_mm(x_q, x_s, w_q, w_s, (128, 128), x.dtype)
    return fp8_block.fp8_block_mm_triton(x_q, x_s, w_q, w_s, (128, 128), x.dtype)


if __name__ == "__main__":
    main()
