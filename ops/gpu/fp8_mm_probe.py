"""Tiles of the fp8 x fp8 GEMM (appliance_kernels.fp8.launch_fp8_mm, per-channel and 128 x 128 block
scales) at decode batch sizes, where its weight read sets the step time: at batch 16 / 64 the
online-fp8 27B step's GEMMs read 3.1 / 2.6 TB/s under the profiler (run CC, docs/benchmarks.md).
Each (rows, projection, tile) is timed as a CUDA graph of 40 launches over weight copies larger
than L2; prints the fastest tiles per shape next to the default's (`fp8._mm_config`,
`fp8_block._block_mm_config`) and the copy-bandwidth floor of the weight.

  python3 ops/gpu/fp8_mm_probe.py [--m 16 64] [--scales channel block]
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

from appliance_kernels import fp8, fp8_block  # noqa: E402

L2_BYTES = 256 << 20


def tiles(m: int, block: bool) -> list[dict[str, int]]:
    """The swept tiles: BLOCK_M the rows' power of two; above 64 rows also 64-row tiles over
    several M tiles, in plain and paired (GROUP_M = 2) launch order."""
    bm = max(16, 1 << (m - 1).bit_length())
    out = []
    if block:  # BLOCK_K is the scales' 128; SUB groups of it per loop step (CF: 6-8 stages no help)
        for bn in (32, 64, 128):
            for stages in (3, 4, 5):
                for sub in (1, 2):
                    out.append(
                        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_stages=stages, SUB=sub)
                    )
                    if m > 64:
                        for group_m in (1, 2):
                            tile = dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128, num_stages=stages)
                            out.append(dict(tile, SUB=sub, GROUP_M=group_m))
    else:
        for bn in (32, 64, 128):
            for bk in (128, 256):
                for stages in (3, 4, 5):
                    out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages))
        out.append(dict(BLOCK_M=bm, BLOCK_N=256, BLOCK_K=128, num_stages=3, num_warps=8))
    return [dict(GROUP_M=1, num_warps=4) | t for t in out]  # a tile's own GROUP_M wins


def default(m: int, n: int, k: int, block: bool) -> dict[str, int]:
    if block:
        return dict(fp8_block._block_mm_config(m, n, k), BLOCK_K=128)
    return fp8._mm_config(m, n, k)


def _run(a_q, a_s, w_s, extra, cfg, wq):
    return fp8.launch_fp8_mm(a_q, wq, a_s, w_s, torch.bfloat16, None, cfg, **extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[16, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--scales", nargs="+", default=["channel", "block"])
    p.add_argument("--show", type=int, default=4, help="fastest tiles shown per shape")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for scales in args.scales:
        block = scales == "block"
        for name in args.shapes:
            n, k = SHAPES[name]
            w = torch.randn(n, k, device="cuda") * 0.05
            if block:
                w_q, w_s = fp8_block.quantize_block_ref(w, (128, 128))
            else:
                w_q, w_s = fp8.per_token_quant_ref(w)
                w_s = w_s.reshape(n).float()
            copies = [w_q.clone() for _ in range(max(2, L2_BYTES // (n * k)))]
            floor = n * k / bw * 1e6
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if block:
                    a_q, a_s = fp8_block.per_token_group_quant_ref(x, 128)
                    extra = {"scale_block_n": 128}
                else:
                    a_q, a_s = fp8.per_token_quant_ref(x)
                    a_s, extra = a_s.reshape(m), {}
                run = partial(_run, a_q, a_s.float(), w_s.float(), extra)
                base = default(m, n, k, block)
                ref = run(base, w_q).float()
                results = []
                cfgs = tiles(m, block)
                if base not in cfgs:
                    cfgs.append(base)
                for cfg in cfgs:
                    try:
                        err = (run(cfg, w_q).float() - ref).abs().max().item()
                        us = graph_time_us([partial(run, cfg, q) for q in copies])
                    except Exception as exc:  # noqa: BLE001 - a tile Triton cannot build: shown
                        print(f"  {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    results.append((us, cfg, err))
                results.sort(key=lambda r: r[0])
                base_us = next(us for us, cfg, _ in results if cfg == base)
                print(
                    f"{scales:7s} m={m:3d} {name:20s} N={n} K={k} floor {floor:6.1f} us, "
                    f"default {base_us:6.1f} us ({n * k / base_us / 1e3:4.0f} GB/s)"
                )
                for us, cfg, err in results[: args.show]:
                    tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"])
                    tile += (cfg["num_warps"], cfg.get("SUB", 1), cfg["GROUP_M"])
                    print(
                        f"   {us:6.1f} us {us / floor:5.2f}x {n * k / us / 1e3:5.0f} GB/s "
                        f"BM,BN,BK,stages,warps,SUB,GROUP_M {tile} max|diff| {err:.1e}"
                    )
            del copies
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
