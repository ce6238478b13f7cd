"""ops/gpu/trace_steps.py: each step's window runs to the next step's start; the device's busy time
in it is the union of its kernels and copies clipped to the window (overlaps counted once); the
summary drops a warm-up window."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "gpu"))

import trace_steps  # noqa: E402


def step(i: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"step {i}", "ts": ts, "dur": dur}


def kernel(ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def test_windows_and_the_union_of_device_work():
    events = [
        step(7, 0, 3),
        step(8, 10, 2),
        step(9, 30, 1),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step 8", "ts": 11, "dur": 9},  # not host
        kernel(1, 4),  # 1-5
        kernel(4, 4),  # 4-8: overlaps, union 1-8 = 7
        kernel(9, 3),  # 9-12: 1 in step 7's window, 2 in step 8's
        kernel(25, 10, "gpu_memcpy"),  # 25-35: 5 in step 8's window (step 9 has no window)
    ]
    times = trace_steps.step_times(events)
    assert [(t.step, t.period_us, t.host_us) for t in times] == [(7, 10, 3), (8, 20, 2)]
    assert [t.device_busy_us for t in times] == [8, 7]
    assert [t.kernels for t in times] == [3, 0]
    summary = trace_steps.summary(times)
    assert summary["steps"] == 2 and summary["device_busy_ms"] == 0.0075
