"""How far the per-pair decode MoE (kernels/moe_gemv.py) should reach: fused_moe at 4-64 tokens of
Qwen3.5-35B-A3B with the per-pair kernels (any pair count) against the grouped GEMMs, next to the
touched experts' bytes / 4.26 TB/s; then, with --static, bench_static.py's 35B-A3B step with the
per-pair limit raised (the remaining arguments go to it).
  python ops/gpu/moe_pairs_probe.py [--static --batch 1 16 64 ...]
"""

from __future__ import annotations

import runpy
import sys
from functools import partial

import torch
from triton.testing import do_bench_cudagraph

import kernels.moe_gemv as moe_gemv
import kernels.moe_triton as moe_triton
from kernels.moe import fused_moe, moe_route_ref


def set_limit(pairs: int) -> None:
    moe_gemv.GEMV_MAX_ROWS = moe_triton.GEMV_MAX_ROWS = pairs


def main() -> None:
    experts, top_k, hidden, inter = 256, 8, 2048, 512
    dev, bf16 = "cuda", torch.bfloat16
    w1 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf16) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=bf16) * inter**-0.5
    for tokens in (4, 8, 16, 32, 64):
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
        w, ids = moe_route_ref(torch.randn(tokens, experts, device=dev), top_k, True)
        touched = torch.unique(ids).numel()
        floor = touched * 3 * hidden * inter * 2 / 4.26e12 * 1e6
        times, outs = [], []
        for pairs in (16, 1 << 20):  # grouped above 16 pairs (the rule today) / per-pair always
            set_limit(pairs)
            outs.append(fused_moe(x, w1, w2, w, ids).float())
            times.append(do_bench_cudagraph(partial(fused_moe, x, w1, w2, w, ids)) * 1e3)
        diff = (outs[0] - outs[1]).abs().max().item()
        print(
            f"T={tokens:3d} ({touched:3d} experts, floor {floor:6.1f} us): today {times[0]:7.1f}"
            f" | per-pair {times[1]:7.1f} us | max diff {diff:.2e}",
            flush=True,
        )
    set_limit(16)
    if "--static" in sys.argv:
        set_limit(1 << 20)
        rest = sys.argv[sys.argv.index("--static") + 1 :]
        sys.path.insert(0, "ops/bench")
        sys.argv = ["bench_static.py", *rest]
        runpy.run_path("ops/bench/bench_static.py", run_name="__main__")


if __name__ == "__main__":
    main()
