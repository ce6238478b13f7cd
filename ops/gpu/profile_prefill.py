"""Host vs GPU time of prefill steps and of a prefix-cache hit (issue 16): the model runner on dummy
weights from a real config. A request prefills PREFIX tokens in CHUNK-token chunks (a state
snapshot saved at the end), then three single-request steps are timed and profiled:

  hit    a new request shares the PREFIX tokens' KV, restores the snapshot, prefills NEW tokens
  short  a new request prefills NEW tokens from scratch (the same step without the context)
  decode a one-token decode, for the launch-bound floor

Printed per step: wall ms (launch to result), GPU kernel ms, kernels, GPU idle share; with CUDA
graphs on, each step once through the graphs (`hit` and `short` replay a prefill graph, `decode` a
decode graph) and once eagerly.

  python ops/gpu/profile_prefill.py --config ops/bench/configs/qwen3_5_27b.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from appliance.messages import NewRequest, ScheduledChunk, StepPlan  # noqa: E402
from ops.bench.bench_static import GREEDY, Bench, build_runner, sync  # noqa: E402


def timed(bench: Bench, plan: StepPlan) -> dict:
    """Wall time of one step (submit to result) and its kernels under torch.profiler."""
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        bench.runner.execute(plan)
        sync()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time for e in kernels) / 1e6
    return {"wall_ms": wall * 1e3, "gpu_ms": gpu * 1e3, "kernels": len(kernels)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    total = args.prefix + args.new
    graphs = torch.cuda.is_available()
    runner = build_runner(args.config, 3, total + 8, 4, [0], graphs, max_model_len=total + 64)
    captured = (runner.graphs, runner.prefill_graphs)
    bench = Bench(runner)
    vocab = runner.text_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (args.prefix,), generator=gen).tolist()
    print(f"{'step':>8} {'mode':>7} {'wall ms':>8} {'GPU ms':>8} {'kernels':>8} {'GPU idle':>8}")
    modes = ("graphs", "eager") if graphs and any(captured) else ("eager",)

    def show(name: str, mode: str, r: dict) -> None:
        idle = max(0.0, 1 - r["gpu_ms"] / r["wall_ms"])
        print(
            f"{name:>8} {mode:>7} {r['wall_ms']:>8.2f} {r['gpu_ms']:>8.2f} {r['kernels']:>8} "
            f"{idle:>8.1%}"
        )

    # the prefix in chunks, as the scheduler cuts it; the last chunk saves snapshot 0
    prefix_kv = bench.kv(args.prefix)
    new = [NewRequest(0, prefix, GREEDY)]
    for first in range(0, args.prefix, args.chunk):
        n = min(args.chunk, args.prefix - first)
        last = first + n == args.prefix
        kv = prefix_kv[first : first + n]
        chunk = ScheduledChunk(0, first, n, kv, last, 0, 0 if last else -1)
        elapsed = bench.run([chunk], new)
        new = []
        print(f"{'chunk':>8} {'':>7} {elapsed * 1e3:>8.2f}  (positions {first}..{first + n})")
    for mode in [m for _ in range(args.repeats) for m in modes]:
        runner.graphs, runner.prefill_graphs = captured if mode == "graphs" else (None, None)
        tail = torch.randint(0, vocab, (args.new,), generator=gen).tolist()
        kv = bench.kv(args.new)
        hit = NewRequest(1, prefix + tail, GREEDY, cached_kv_slots=prefix_kv, restore_snapshot=0)
        plan = StepPlan(bench.step, [hit], [ScheduledChunk(1, args.prefix, args.new, kv, True)], [])
        bench.step += 1
        show("hit", mode, timed(bench, plan))
        bench.run([], released=[1])
        short = NewRequest(2, tail, GREEDY)
        kv = bench.kv(args.new)
        plan = StepPlan(bench.step, [short], [ScheduledChunk(2, 0, args.new, kv, True)], [])
        bench.step += 1
        show("short", mode, timed(bench, plan))
        plan = StepPlan(bench.step, [], [ScheduledChunk(2, args.new, 1, bench.kv(1), True)], [])
        bench.step += 1
        show("decode", mode, timed(bench, plan))
        bench.run([], released=[2])


if __name__ == "__main__":
    main()
