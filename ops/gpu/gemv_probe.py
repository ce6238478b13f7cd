"""Why the one-row fp8 GEMV reads 1.07-1.35x its floor when the bf16 one reads 1.0-1.1x: at the
27B projections, times `appliance_kernels.fp8_gemv` over its tiles and K-loop stages. Each call is
timed inside a CUDA graph of 40 launches over weight copies larger than L2, with programmatic
dependent launch off and on (the decode step runs with it on). Runs BJ / BK (docs/benchmarks.md)
also timed a [BLOCK_N] accumulator, weight tiles prefetched into registers and the first tiles
loaded before the PDL wait: slower or no faster, so they were removed (run DG timed the first tile
before the wait again in the step, added after the K loop: slower). `--kind block`: the
block-scaled GEMV's (fp8_gemv_block) tiles and stages (run CI); `--kind bf16`: a 16-bit
weight's; `--tail 96`: the GDN in_proj with the b / a rows its launch also reads.

  python3 ops/gpu/gemv_probe.py [--kind channel|block|bf16] [--tail 96] [--shapes out_proj ...]
      [--pdl on] [--tiles 8,512,4,4 ...]   (a shape: any part of its name)
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
from appliance_kernels.fp8_gemv import (  # noqa: E402
    bf16_gemv_config,
    block_gemv_config,
    fp8_gemv,
    fp8_gemv_block,
    gemv_config,
)

L2_BYTES = 256 << 20


def channel(x, w_q, s, cfg, tail=None):
    return fp8_gemv(x, w_q, s, None, cfg, tail)


def block(x, w_q, s, cfg, tail=None):
    return fp8_gemv_block(x, w_q, s, (128, 128), None, cfg, tail)


def tile(n, k, w, st):
    return {"block_n": n, "block_k": k, "num_warps": w, "stages": st}


GRID = [tile(n, k, 4, st) for n in (8, 16, 32) for k in (256, 512) for st in (3, 4, 5)]
DEFAULTS = {"channel": gemv_config, "block": block_gemv_config, "bf16": bf16_gemv_config}
TAIL_SHAPE = "gdn in_proj qkvz"  # the GDN layer's bf16 b / a rows ride on this GEMV (`tail`)


def weights(kind: str, n: int, k: int):
    """The weight in `kind`'s layout, its scales (None for bf16) and the GEMV that reads it."""
    w = torch.randn(n, k, device="cuda") * 0.05
    if kind == "block":
        return *quantize_block_ref(w, (128, 128)), block
    if kind == "bf16":
        return w.to(torch.bfloat16), None, channel
    w_q, w_s = fp8.per_token_quant_ref(w)
    return w_q, w_s.reshape(n).float(), channel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--pdl", nargs="+", default=["off", "on"])
    p.add_argument(
        "--kind",
        default="channel",
        choices=list(DEFAULTS),
        help="per-channel fp8 (online fp8, FP8_DYNAMIC), 128 x 128 block fp8 (Qwen's -FP8 "
        "repos) or a bf16 weight (scale None)",
    )
    p.add_argument(
        "--tail",
        type=int,
        default=0,
        help=f"bf16 rows read by the same launch at {TAIL_SHAPE!r} (27B: 96, the b / a rows)",
    )
    p.add_argument(
        "--tiles",
        nargs="+",
        default=[],
        help="BLOCK_N,BLOCK_K,WARPS,STAGES tiles timed instead of the default grid",
    )
    args = p.parse_args()
    grid = [tile(*map(int, t.split(","))) for t in args.tiles] or GRID
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {args.kind} weights")
    names = [s for s in SHAPES if any(want in s for want in args.shapes)]  # "out_proj" matches
    for name in names:
        n, k = SHAPES[name]
        w_q, w_s, fn = weights(args.kind, n, k)
        tail = None
        if args.tail and name == TAIL_SHAPE:
            tail = torch.randn(args.tail, k, device="cuda", dtype=torch.bfloat16) * 0.05
        nbytes = w_q.numel() * w_q.element_size() + (tail.numel() * 2 if tail is not None else 0)
        variants = grid + [DEFAULTS[args.kind](n, k)]
        wq = [w_q.clone() for _ in range(max(2, L2_BYTES // nbytes))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = fn(x, w_q, w_s, variants[-1], tail).float()
        floor = nbytes / bw * 1e6
        for pdl in args.pdl:
            tu.USE_PDL = pdl == "on"
            results = []
            for i, cfg in enumerate(variants):
                label = "default" if i == len(variants) - 1 else ""
                try:
                    got = fn(x, w_q, w_s, cfg, tail)
                    err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
                    us = graph_time_us([partial(fn, x, q, w_s, cfg, tail) for q in wq])
                    results.append((us, label, cfg, err))
                except Exception as exc:  # noqa: BLE001 - a variant Triton cannot build: shown
                    print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
            results.sort(key=lambda r: r[0])
            extra = f" + {args.tail} bf16 tail rows" if tail is not None else ""
            print(f"{name:20s} N={n} K={k}{extra} pdl={pdl} floor {floor:6.1f} us")
            for us, label, cfg, err in results:
                print(
                    f"   {us:6.1f} us {us / floor:5.2f}x {nbytes / us / 1e3:5.0f} GB/s"
                    f"  {tuple(cfg.values())} err {err:.1e} {label}"
                )
        tu.USE_PDL = False
        del wq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
