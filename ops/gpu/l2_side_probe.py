"""Whether a side-stream L2 prefetch (appliance_kernels/l2_prefetch.py) shortens a one-row fp8
GEMV that follows a few µs of small kernels: [gap] -> GEMV over a 27B projection, 40 times in a
CUDA graph over weight copies larger than L2, with the weight's first MiB asked of L2 on a side
stream forked as the gap starts (joined after the GEMV), against none. The gap is a spin of the
given µs (`torch.cuda._sleep`), optionally with a 6 MB copy (the GDN recurrence's fp32 state read
and written), so the prefetch's HBM traffic meets a small memory-bound kernel too.

  python3 ops/gpu/l2_side_probe.py [--shapes out_proj down] [--gaps 0 4 8] [--mib 0 8 16 32]
      [--chunks 65536] [--copy off on]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from bench_fp8_gemv import L2_BYTES, SHAPES, copy_bandwidth, graph_time_us  # noqa: E402

from appliance_kernels import fp8  # noqa: E402
from appliance_kernels import l2_prefetch as l2  # noqa: E402
from appliance_kernels import triton_utils as tu  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv, gemv_config  # noqa: E402

STATE_BYTES = 3 << 20  # 48 value heads x 128 x 128 fp32: the GDN state one layer reads / writes


def cycles_per_us() -> float:
    """The spin kernel's clock: time a long _sleep once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def case(shape: str, gap_us: float, mib: float, copy: bool, clock: float):
    n, k = SHAPES[shape]
    copies = max(2, -(-L2_BYTES // (n * k)))
    w = torch.randn(n, k, device="cuda") * 0.05
    w_q, w_s = fp8.per_token_quant_ref(w)
    ws = [w_q.clone() for _ in range(copies)]
    s = w_s.reshape(n).float()
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(STATE_BYTES // 4, device="cuda")
    state_out = torch.empty_like(state)
    cfg = gemv_config(n, k)
    cycles = int(gap_us * clock)

    def step(i: int):
        def run():
            side = None
            if mib > 0:
                side = l2.side_prefetch(ws[i], mib, 1)
            if cycles:
                torch.cuda._sleep(cycles)
            if copy:
                state_out.copy_(state)
            fp8_gemv(x, ws[i], s, None, cfg)
            l2.join(side)

        return run

    return graph_time_us([step(i) for i in range(copies)]), n * k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["out_proj", "down"])
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 4.0, 8.0])
    p.add_argument("--mib", type=float, nargs="+", default=[0.0, 8.0, 16.0, 32.0])
    p.add_argument("--chunks", type=int, nargs="+", default=[l2.CHUNK])
    p.add_argument("--copy", nargs="+", default=["off", "on"], choices=["off", "on"])
    args = p.parse_args()
    tu.USE_PDL = True  # as the decode step runs
    bandwidth = copy_bandwidth()
    clock = cycles_per_us()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; spin clock {clock:.0f} cycles/µs")
    head = f"{'shape':>24} {'gap µs':>6} {'copy':>4} {'chunk':>7} {'MiB':>5}"
    print(f"{head} {'µs':>7} {'- none':>7}")
    for name in args.shapes:
        shape = next(s for s in SHAPES if name in s)
        for copy in args.copy:
            for gap in args.gaps:
                base = None
                for chunk in args.chunks:
                    l2.CHUNK = chunk
                    for mib in args.mib:
                        if mib == 0 and base is not None:
                            continue
                        us, _ = case(shape, gap, mib, copy == "on", clock)
                        base = us if mib == 0 else base
                        delta = us - base if base is not None else float("nan")
                        print(
                            f"{shape:>24} {gap:>6.1f} {copy:>4} {chunk:>7} {mib:>5.0f} "
                            f"{us:>7.2f} {delta:>+7.2f}",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
