"""Per-op GPU benchmark: each appliance_kernels/ op at Qwen3.5 shapes, its achieved GB/s or TFLOP/s,
and the ratio to the best peer present in the same run (torch reference, torch.compile'd reference,
torch SDPA, torch._scaled_mm, fla-core, flashinfer, sgl_kernel when importable).

Run on the GPU machine: `PYTHONPATH=. python ops/bench/bench_ops.py [--ops gdn,fp8] [--out F]`.
ratio = best peer time / our time (> 1: ours is faster). Results go to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from appliance import envs
from appliance_kernels import backends
from ops.bench import bench_cases

Fn = Callable[[], object]


@dataclass
class Row:
    op: str  # op name
    shape: str  # human-readable case
    ours_us: float  # median time of our kernel
    work: float  # bytes moved (unit "GB/s") or flops (unit "TFLOP/s") per call
    unit: str  # "GB/s" or "TFLOP/s"
    peers: dict[str, float] = field(default_factory=dict)  # peer name -> median µs (nan: failed)

    def achieved(self) -> float:
        scale = 1e3 if self.unit == "GB/s" else 1e6
        return self.work / (self.ours_us * scale)

    def best_peer(self) -> tuple[str, float]:
        ok = {k: v for k, v in self.peers.items() if v == v}
        if not ok:
            return "-", float("nan")
        name = min(ok, key=ok.get)
        return name, ok[name]


def time_us(fn: Fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def measure(op: str, shape: str, ours: Fn, work: float, unit: str, peers: dict[str, Fn]) -> Row:
    row = Row(op, shape, time_us(ours), work, unit)
    for name, fn in peers.items():
        try:
            row.peers[name] = time_us(fn)
        except Exception as exc:  # a peer that cannot run is reported, not fatal
            row.peers[name] = float("nan")
            print(
                f"  peer {name} failed on {op} {shape}: {type(exc).__name__}: {exc}"[:300],
                file=sys.stderr,
            )
    name, peer_us = row.best_peer()
    print(
        f"{op:14s} {shape:34s} {row.ours_us:10.1f} us {row.achieved():9.1f} {unit:7s} "
        f"best peer {name} {peer_us:.1f} us ratio {peer_us / row.ours_us:.2f}",
        flush=True,
    )
    return row


def table(rows: list[Row]) -> str:
    lines = [
        "| op | case | ours µs | achieved | best peer | peer µs | ratio | all peers µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name, peer_us = r.best_peer()
        others = ", ".join(f"{k} {v:.1f}" for k, v in r.peers.items())
        lines.append(
            f"| {r.op} | {r.shape} | {r.ours_us:.1f} | {r.achieved():.1f} {r.unit} "
            f"| {name} | {peer_us:.1f} | {peer_us / r.ours_us:.2f} | {others} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", default=",".join(bench_cases.OPS), help="comma-separated op names")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile peers")
    args = parser.parse_args()
    backends.configure(**envs.kernel_backends())  # the env flags, as the workers pass them
    if not torch.cuda.is_available():
        print("bench_ops needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(
        f"device {torch.cuda.get_device_name()} torch {torch.__version__} "
        f"peers: {[m for m in ('fla', 'flashinfer', 'sgl_kernel', 'flash_qla') if has(m)]}",
        flush=True,
    )
    rows: list[Row] = []
    for op in args.ops.split(","):
        start = time.time()
        try:
            for case in bench_cases.OPS[op](compile_peers=not args.no_compile):
                rows.append(measure(*case))
                torch.cuda.empty_cache()
        except Exception:
            traceback.print_exc()
        print(f"# {op} done in {time.time() - start:.0f} s", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
