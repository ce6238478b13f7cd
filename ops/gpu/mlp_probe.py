"""Whether one launch reads a batch-1 MLP faster than its GEMVs: at the 27B MLP (H 5120, I 17408),
times appliance_kernels.gemv_mlp (gate_up + SiLU-and-mul + down in one launch; one tile a program,
persistent grids of 2 and 4 programs an SM, one segment (down after all of gate_up) and shorter
segments, and the tiles given) against the path served today
(the one-row gate_up GEMV, silu_and_mul, the down GEMV) and the one-row SwiGLU GEMV + down, each
inside a CUDA graph of 40 MLPs over weight copies larger than L2, with programmatic dependent
launch off and on; the floor is the weight bytes at the copy bandwidth. Each variant's output is
checked against the served path's.

  python3 ops/gpu/mlp_probe.py [--kinds channel block bf16] [--pdl off on]
      [--tiles 4,8,512,4,5,9,0 ...]   (BLOCK_A,BLOCK_N,BLOCK_K,WARPS,STAGES,SEG_STEPS,PER_SM)
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from bench_fp8_gemv import copy_bandwidth, graph_time_us  # noqa: E402

from appliance_kernels import fp8  # noqa: E402
from appliance_kernels import triton_utils as tu  # noqa: E402
from appliance_kernels.activation import silu_and_mul  # noqa: E402
from appliance_kernels.fp8_block import quantize_block_ref  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv, fp8_gemv_block, linear  # noqa: E402
from appliance_kernels.gemv_mlp import gemv_mlp, mlp_config, stalled  # noqa: E402
from appliance_kernels.gemv_swiglu import gemv_swiglu  # noqa: E402

HIDDEN, INTER = 5120, 17408
BLOCK = (128, 128)
L2_BYTES = 256 << 20
KEYS = ("block_a", "block_n", "block_k", "num_warps", "stages", "seg_steps", "per_sm")


def weight(kind: str, n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.05
    if kind == "block":
        return quantize_block_ref(w, BLOCK)
    if kind == "bf16":
        return w.to(torch.bfloat16), None
    w_q, s = fp8.per_token_quant_ref(w)
    return w_q, s.reshape(n).float()


def gemv(kind, x, w, s):
    """The served one-row GEMV of each weight kind (the layers' routes)."""
    if kind == "block":
        return fp8_gemv_block(x, w, s, BLOCK)
    return linear(x, w) if kind == "bf16" else fp8_gemv(x, w, s)


def layers(kind, x, w_gu, s_gu, w_d, s_d):
    """The path served today: the one-row GEMVs and silu_and_mul."""
    return gemv(kind, silu_and_mul(gemv(kind, x, w_gu, s_gu)), w_d, s_d)


def swiglu(kind, x, w_gu, s_gu, w_d, s_d):
    return gemv(kind, gemv_swiglu(x, w_gu, s_gu), w_d, s_d)


def one_launch(kind, x, w_gu, s_gu, w_d, s_d, cfg=None):
    return gemv_mlp(x, w_gu, s_gu, w_d, s_d, BLOCK if kind == "block" else None, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["channel", "block", "bf16"])
    p.add_argument("--pdl", nargs="+", default=["off", "on"])
    p.add_argument("--tiles", nargs="+", default=[], help=",".join(k.upper() for k in KEYS))
    args = p.parse_args()
    tiles = [dict(zip(KEYS, map(int, t.split(",")), strict=True)) for t in args.tiles]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; MLP H {HIDDEN} I {INTER}")
    for kind in args.kinds:
        gu, d = weight(kind, 2 * INTER, HIDDEN), weight(kind, HIDDEN, INTER)
        nbytes = sum(t.numel() * t.element_size() for t in (gu[0], d[0]))
        copies = [(gu[0].clone(), gu[1], d[0].clone(), d[1]) for _ in range(1 + L2_BYTES // nbytes)]
        x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ref = layers(kind, x, *gu, *d).float()
        floor = nbytes / bw * 1e6
        variants = [("layers", layers, None)]
        if kind != "block":
            variants.append(("swiglu + down", swiglu, None))
        default = mlp_config(INTER, HIDDEN, kind != "bf16")
        persistent = [default | {"per_sm": n} for n in (2, 4)]  # per_sm 0: one tile a program
        # one segment: down waits for all of gate_up (no overlap); more, shorter segments
        segments = [default | {"seg_steps": n} for n in (INTER // default["block_k"] + 1, 5)]
        grid = [default, *persistent, *segments, *tiles]
        variants += [("one launch", one_launch, c) for c in grid]
        for pdl in args.pdl:
            tu.USE_PDL = pdl == "on"
            print(f"{kind} weights, pdl {pdl}: floor {floor:6.1f} us ({nbytes / 2**20:.0f} MiB)")
            for name, fn, cfg in variants:
                extra = (cfg,) if cfg is not None else ()
                try:
                    got = fn(kind, x, *gu, *d, *extra).float()
                    err = (got - ref).abs().max().item() / ref.abs().max().item()
                    calls = [partial(fn, kind, x, *c, *extra) for c in copies]
                    us = graph_time_us(calls)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot build: shown
                    print(f"   {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                label = "" if cfg is None else str(tuple(cfg.values()))
                label += " STALLED (a down tile gave up waiting)" if stalled() else ""
                print(
                    f"   {us:7.1f} us {us / floor:5.2f}x {nbytes / us / 1e3:5.0f} GB/s "
                    f"err {err:.1e}  {name} {label}",
                    flush=True,
                )
        tu.USE_PDL = False
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
