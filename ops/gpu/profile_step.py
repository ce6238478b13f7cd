"""Host vs GPU time of a decode step: torch.profiler over N plain decode steps of the model runner
(dummy weights from a real config), CUDA graphs on and off. Prints per step: wall time, GPU kernel
time (sum of kernel durations), kernel launches, and GPU idle share; writes a Chrome trace;
`--top N`: the N kernels with the most time per step (name, launches, µs).

  python ops/gpu/profile_step.py --config ops/bench/configs/qwen3_5_27b.json --batch 1 16 --out .
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.bench_static import Bench, build_runner, fused_step, sync  # noqa: E402


def profile_decode(
    runner, batch: int, prompt_len: int, steps: int, overlap: bool, trace: Path | None, k: int = 0
) -> dict:
    """k > 0: the fused MTP step (runner.mtp_graphs set by the caller) with k drafts a step."""
    bench = Bench(runner)
    _, starts = bench.prefill(batch, prompt_len, num_draft=k)
    for _ in range(3):  # warm-up (allocator, autotune)
        bench.decode(starts, k)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        if overlap:
            bench.decode_pipelined(starts, steps)
        else:
            for _ in range(steps):
                bench.decode(starts, k)
        sync()
        wall = (time.perf_counter() - start) / steps
    bench.run([], released=list(range(batch)))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time for e in kernels) / 1e6 / steps  # device_time is in us
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "top": [(name[:90], n / steps, us / steps) for name, (n, us) in top],
        "wall_ms": wall * 1e3,
        "gpu_ms": gpu * 1e3,
        "kernels": len(kernels) / steps,
        "idle": max(0.0, 1 - gpu / wall),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--top", type=int, default=0, help="print the N costliest kernels per step")
    ap.add_argument(
        "--modes", nargs="+", default=["graphs+overlap", "graphs", "eager"], help="and mtp"
    )
    ap.add_argument("--mtp", type=int, default=3, help="drafts of the mtp mode")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="mtp mode; 0: all ids")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8", "block"])
    args = ap.parse_args()
    mtp = [0, args.mtp] if "mtp" in args.modes else [0]
    runner = build_runner(
        args.config,
        max(args.batch),
        args.prompt_len,
        args.steps,
        mtp,
        True,
        quantization=args.quantization,
        mtp_fused=False,  # built per batch below instead
    )
    captured = runner.graphs
    print(f"{'mode':>15} {'batch':>5} {'wall ms':>8} {'GPU ms':>8} {'kernels':>8} {'GPU idle':>8}")
    for mode in args.modes:
        runner.graphs = None if mode == "eager" else captured
        for batch in args.batch:
            first = batch == args.batch[0]  # one trace per mode: the files come back from the GPU
            name = f"trace_{mode.replace('+', '_')}_b{batch}.json"
            trace = Path(args.out) / name if args.out and first and mode != "eager" else None
            overlap = mode == "graphs+overlap"
            k = args.mtp if mode == "mtp" else 0
            runner.mtp_graphs = None
            if runner.drafter is not None:
                runner.drafter.k = max(k, 1)  # as bench_static.measure
            if k:
                runner.drafter.draft_vocab = args.draft_vocab
                runner.mtp_graphs = fused_step(runner, k, batch, graphs=True)
            r = profile_decode(runner, batch, args.prompt_len, args.steps, overlap, trace, k)
            runner.mtp_graphs = None
            print(
                f"{mode:>15} {batch:>5} {r['wall_ms']:>8.2f} {r['gpu_ms']:>8.2f} "
                f"{r['kernels']:>8.0f} {100 * r['idle']:>7.1f}%"
            )
            for name, n, us in r["top"][: args.top]:
                print(f"    {us:8.1f} µs {n:5.0f}x  {name}")


if __name__ == "__main__":
    main()
