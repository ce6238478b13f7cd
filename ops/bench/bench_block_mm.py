"""Block-scaled fp8 GEMM at prefill sizes (the compose default model's layout, Qwen's -FP8 repos:
128 x 128 weight blocks, activations quantised per token and group of 128): the Triton block GEMM
against cuBLASLt's block recipe (`fp8_block.fp8_block_mm_torch`, torch.nn.functional.scaled_mm)
and bf16 cuBLAS (F.linear) on the same shapes, each with its activation quantisation. Prints µs,
TFLOP/s, the ratios and which route `fp8_block.block_mm_route` takes.

  python3 ops/bench/bench_block_mm.py [--m 128 1024 4096] [--shapes "mlp down" ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from bench_fp8_gemv import SHAPES  # noqa: E402  (the 27B projections)

from appliance_kernels import fp8_block  # noqa: E402

BLOCK = (128, 128)
ORDER = ("triton", "cublaslt", "bf16")  # the TFLOP/s column's order


def triton_route(x, w_q, w_s):
    x_q, x_s = fp8_block.per_token_group_quant(x, 128)
    return fp8_block.fp8_block_mm_triton(x_q, x_s, w_q, w_s, BLOCK, x.dtype)


def row(name: str, x, w_q, w_s, w_bf, ok: bool) -> str:
    """One table row: each route timed on the same input and weights."""
    import triton.testing

    (m, k), n = x.shape, w_q.shape[0]
    calls = {
        "triton": lambda: triton_route(x, w_q, w_s),
        "bf16": lambda: torch.nn.functional.linear(x, w_bf),
    }
    err = ""
    if ok:
        calls["cublaslt"] = lambda: fp8_block.fp8_block_mm_torch(x, w_q, w_s)
        ref = calls["triton"]().float()
        rel = (calls["cublaslt"]().float() - ref).abs().max() / ref.abs().max()
        err = f" err {rel.item():.1e}"
    bench = triton.testing.do_bench
    us = {c: bench(calls[c], warmup=10, rep=50) * 1e3 for c in ORDER if c in calls}
    flop = 2 * m * n * k
    tflops = "/".join(f"{flop / t / 1e6:.0f}" for t in us.values())
    c = us.get("cublaslt", float("nan"))
    route = fp8_block.block_mm_route(m, n, k, BLOCK, x.device)
    return (
        f"| {name} | {m} | {us['triton']:.1f} | {c:.1f} | {us['bf16']:.1f} | {tflops} | "
        f"{us['triton'] / c:.2f} | {us['bf16'] / c:.2f} | {route} |{err}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[65, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = p.parse_args()
    dev = torch.device("cuda")
    ok = fp8_block.cublaslt_block_ready(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuBLASLt block recipe: {ok}")
    print(
        "| shape | M | triton µs | cuBLASLt µs | bf16 µs | TFLOP/s (triton / cuBLASLt / bf16) |"
        " triton / cuBLASLt | bf16 / cuBLASLt | route |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev) * 0.05
        w_q, w_s = fp8_block.quantize_block_ref(w, BLOCK)
        w_bf = w.to(torch.bfloat16)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            print(row(name, x, w_q, w_s, w_bf, ok), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
