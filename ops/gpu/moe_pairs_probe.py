"""How far the per-pair decode MoE (appliance_kernels/moe_gemv.py) should reach: fused_moe at 4-64
tokens of Qwen3.5-35B-A3B, bf16 and per-channel fp8 experts, with the per-pair kernels (any pair
count) against the grouped GEMMs, next to the touched experts' bytes / 4.26 TB/s; then, with
--static, bench_static.py (the remaining arguments go to it, e.g. its --moe-pairs to time the step
at several limits).
  python ops/gpu/moe_pairs_probe.py [--static --config ... --batch 1 16 64 --moe-pairs 16 128]
"""

from __future__ import annotations

import runpy
import sys
from functools import partial

import torch
from triton.testing import do_bench_cudagraph

import appliance_kernels.moe_gemv as moe_gemv
from appliance_kernels.fp8 import per_token_quant_ref
from appliance_kernels.moe import fused_moe, moe_route_ref


def set_limit(pairs: int) -> None:
    moe_gemv.GEMV_MAX_ROWS = (
        pairs  # appliance_kernels.moe_triton reads it from the module at each call
    )


def main() -> None:
    experts, top_k, hidden, inter = 256, 8, 2048, 512
    dev, bf16 = "cuda", torch.bfloat16
    w1 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf16) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=bf16) * inter**-0.5
    q1, s1 = per_token_quant_ref(w1.flatten(0, 1))
    q2, s2 = per_token_quant_ref(w2.flatten(0, 1))
    fp8 = dict(w_gate_up_scale=s1.view(experts, -1), w_down_scale=s2.view(experts, -1))
    default = moe_gemv.GEMV_MAX_ROWS
    kinds = {"bf16": (w1, w2, {}, 2), "fp8": (q1.view(w1.shape), q2.view(w2.shape), fp8, 1)}
    for kind, (a, b, scales, size) in kinds.items():
        for tokens in (4, 8, 16, 24, 32, 64):
            x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
            w, ids = moe_route_ref(torch.randn(tokens, experts, device=dev), top_k, True)
            touched = torch.unique(ids).numel()
            floor = touched * 3 * hidden * inter * size / 4.26e12 * 1e6
            times, outs = [], []
            for pairs in (0, 1 << 20):  # grouped GEMMs always / per-pair kernels always
                set_limit(pairs)
                run = partial(fused_moe, x, a, b, w, ids, **scales)
                outs.append(run().float())
                times.append(do_bench_cudagraph(run) * 1e3)
            diff = (outs[0] - outs[1]).abs().max().item()
            print(
                f"{kind} T={tokens:3d} ({touched:3d} experts, floor {floor:6.1f} us): grouped"
                f" {times[0]:7.1f} | per-pair {times[1]:7.1f} us | max diff {diff:.2e}",
                flush=True,
            )
    set_limit(default)
    if "--static" in sys.argv:  # e.g. --moe-pairs 16 128: each limit captured and timed
        rest = sys.argv[sys.argv.index("--static") + 1 :]
        sys.path.insert(0, "ops/bench")
        sys.argv = ["bench_static.py", *rest]
        runpy.run_path("ops/bench/bench_static.py", run_name="__main__")


if __name__ == "__main__":
    main()
