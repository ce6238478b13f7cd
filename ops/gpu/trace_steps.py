"""Host time against device time per engine step, from a worker's profiler trace (POST
/start_profile, engine/profiler.py: one `step <id>` range per step on the host).

Each step's window runs from its range's start to the next step's; in it: the host's range (batch
building and launches), the device's busy time (the union of kernels and copies), their count.
The steady-state figures are medians over the steps but the last. Used by ops/gpu/served_trace.py;
by hand:

    python3 ops/gpu/trace_steps.py traces/<id>-TP-0.trace.json.gz [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from dataclasses import asdict, dataclass

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class StepTime:
    step: int
    period_us: float  # this step's start to the next one's
    host_us: float  # the step's range on the host
    device_busy_us: float  # kernels and copies inside the period (their union)
    kernels: int


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_times(events: list[dict]) -> list[StepTime]:
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and _is_step(e)),
        key=lambda e: e["ts"],
    )
    device = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"
    )
    kernels = sorted(float(e["ts"]) for e in events if e.get("cat") == "kernel")
    out = []
    for this, after in zip(steps, steps[1:]):
        lo, hi = float(this["ts"]), float(after["ts"])
        busy = _union_inside(device, lo, hi)
        count = sum(lo <= t < hi for t in kernels)
        out.append(StepTime(int(this["name"][5:]), hi - lo, float(this["dur"]), busy, count))
    return out


def summary(times: list[StepTime]) -> dict:
    """Medians of the steady state (every window but a warm-up first one when there are many)."""
    if not times:
        return {"steps": 0}
    steady = times[1:] if len(times) > 4 else times

    def med(key: str) -> float:
        return statistics.median(getattr(t, key) for t in steady)

    period, busy = med("period_us"), med("device_busy_us")
    return {
        "steps": len(steady),
        "period_ms": period / 1000,
        "host_ms": med("host_us") / 1000,
        "device_busy_ms": busy / 1000,
        "device_idle_share": 1 - busy / period if period else 0.0,
        "kernels": med("kernels"),
    }


def _is_step(event: dict) -> bool:
    name = str(event.get("name", ""))
    return name.startswith("step ") and name[5:].isdigit()


def _union_inside(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of sorted `intervals` clipped to [lo, hi)."""
    total, reach = 0.0, lo
    for start, end in intervals:
        if start >= hi:
            break
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json", default="")
    ap.add_argument("--every", action="store_true", help="print every step, not only medians")
    args = ap.parse_args()
    times = step_times(load_events(args.trace))
    if args.every:
        for t in times:
            print(
                f"step {t.step:>6}  period {t.period_us / 1000:8.3f} ms  host "
                f"{t.host_us / 1000:8.3f} ms  device busy {t.device_busy_us / 1000:8.3f} ms  "
                f"{t.kernels} kernels"
            )
    result = summary(times)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": result, "steps": [asdict(t) for t in times]}, f, indent=1)


if __name__ == "__main__":
    main()
