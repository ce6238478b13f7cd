"""How busy the device is while the worker serves: CUDA events around every submitted step give its
device time; the share of wall time the device spent on steps is logged once per interval
(`APPLIANCE_GPU_BUSY_LOG` seconds, 0 = off). The complement is the GPU idle time between steps that
the host (batch building, the router round trip, result handling) leaves."""

from __future__ import annotations

import time

import torch

from appliance.logging import get_logger

log = get_logger(__name__)


class BusyMeter:
    def __init__(self, interval_s: float, device: torch.device) -> None:
        self.enabled = interval_s > 0 and device.type == "cuda"
        self.interval_s = interval_s
        self._open: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # per step in flight
        self._busy_ms = 0.0
        self._steps = 0
        self._since = time.perf_counter()

    def begin(self) -> None:
        """Before a step's first kernel is enqueued."""
        if self.enabled:
            if not self._open and not self._steps:  # a window starts with its first step
                self._since = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open.append((start, torch.cuda.Event(enable_timing=True)))

    def end(self) -> None:
        """After the step's last kernel (and its result copy) is enqueued."""
        if self.enabled:
            self._open[-1][1].record()

    def collected(self) -> None:
        """The oldest step's result was read: its events have completed."""
        if not self.enabled or not self._open:
            return
        start, end = self._open.pop(0)
        end.synchronize()
        self._busy_ms += start.elapsed_time(end)
        self._steps += 1
        now = time.perf_counter()
        wall_ms = (now - self._since) * 1e3
        if wall_ms >= self.interval_s * 1e3:
            log.info(
                "device busy %.1f%% of %.1f s (%d steps, %.2f ms each); idle between steps %.1f%%",
                100 * self._busy_ms / wall_ms,
                wall_ms / 1e3,
                self._steps,
                self._busy_ms / max(1, self._steps),
                100 - 100 * self._busy_ms / wall_ms,
            )
            self._busy_ms, self._steps, self._since = 0.0, 0, now
