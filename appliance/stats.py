"""The windowed stats log line and the startup config block.

The server process feeds a `StatsWindow` (through `MetricsRecorder`, or directly) with per-request
token deltas and the router's snapshots; a `StatsTicker` rolls the window every
APPLIANCE_LOG_STATS_INTERVAL seconds and logs `format_stats_line(...)`.
`format_config_block` renders the resolved config at startup.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.logging import get_logger

logger = get_logger(__name__)

# Finish reasons whose tokens do not count toward the window's throughput.
EXCLUDED_REASONS = ("abort", "rejected", "error")
_WINDOW_COUNTERS = (
    "mtp_drafts",
    "mtp_draft_tokens",
    "mtp_accepted_tokens",
    "mtp_paused_steps",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
_SECRET_WORDS = ("key", "token", "secret", "password")


class CumulativeTracker:
    """Turns cumulative values from one sender into non-negative increments (a drop = a restart)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}

    def delta(self, source: str, key: str, value: float) -> float:
        last = self._last.get((source, key), 0.0)
        self._last[(source, key)] = value
        return value if value < last else value - last


@dataclass(frozen=True)
class WindowStats:
    """One closed window; router gauges are the latest snapshot (None: none yet)."""

    duration_s: float
    prompt_tokens: int  # prompt tokens computed in the window, aborted/failed requests excluded
    generation_tokens: int  # tokens generated in the window, aborted/failed requests excluded
    finished: int  # requests that ended in the window (any reason)
    aborted: int  # of which aborted or failed
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # 0-1
    state_usage: float | None = None  # 0-1
    mtp_drafts: int = 0
    mtp_draft_tokens: int = 0
    mtp_accepted_tokens: int = 0
    mtp_paused_steps: int = 0  # steps the MTP verify policy paused: no drafts verified
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache in the window
    prefix_cache_hits: int = 0  # of those, found cached

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def prompt_throughput(self) -> float:
        return self.prompt_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def generation_throughput(self) -> float:
        return self.generation_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mtp_accept_length(self) -> float | None:
        """Mean tokens committed per verify step: 1 (bonus token) + accepted drafts per draft."""
        if self.mtp_drafts <= 0:
            return None
        return 1.0 + self.mtp_accepted_tokens / self.mtp_drafts

    @property
    def idle(self) -> bool:
        return (
            self.prompt_tokens == 0
            and self.generation_tokens == 0
            and self.finished == 0
            and not self.num_running
            and not self.num_waiting
            and self.num_preemptions == 0
        )


class StatsWindow:
    """Accumulates one window of per-request deltas and router counters; `roll()` closes it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._cumulative = CumulativeTracker()
        self._gauges: dict[str, dict[str, float]] = {}  # source -> latest router gauges
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._start = now
        self._pending: dict[str, list[int]] = {}  # request id -> [prompt, generation] this window
        self._prompt = 0
        self._generation = 0
        self._finished = 0
        self._aborted = 0
        self._counters = dict.fromkeys(_WINDOW_COUNTERS, 0.0)

    def on_prompt(self, request_id: str, num_tokens: int) -> None:
        with self._lock:
            self._pending.setdefault(request_id, [0, 0])[0] += num_tokens

    def on_generation(self, request_id: str, num_tokens: int) -> None:
        with self._lock:
            self._pending.setdefault(request_id, [0, 0])[1] += num_tokens

    def on_finished(self, request_id: str, finish_reason: str) -> None:
        """An aborted/failed request's deltas in this window are dropped; others are kept."""
        with self._lock:
            prompt, generation = self._pending.pop(request_id, (0, 0))
            self._finished += 1
            if finish_reason in EXCLUDED_REASONS:
                self._aborted += 1
            else:
                self._prompt += prompt
                self._generation += generation

    def on_router_stats(self, stats: Mapping[str, Any], source: str = "router") -> None:
        """Latest gauges, and increments of the cumulative counters (same keys as RouterStats)."""
        with self._lock:
            gauges = self._gauges.setdefault(source, {})
            for key in ("num_running", "num_waiting", "kv_usage", "state_usage"):
                if stats.get(key) is not None:
                    gauges[key] = float(stats[key])
            for key in _WINDOW_COUNTERS:
                if stats.get(key) is not None:
                    self._counters[key] += self._cumulative.delta(source, key, float(stats[key]))

    def roll(self, now: float | None = None) -> WindowStats:
        """Close the window: requests still running keep the tokens they made in it."""
        now = self._clock() if now is None else now
        with self._lock:
            for prompt, generation in self._pending.values():
                self._prompt += prompt
                self._generation += generation
            sources = list(self._gauges.values())

            def summed(key: str) -> int | None:
                values = [g[key] for g in sources if key in g]
                return int(sum(values)) if values else None

            def maxed(key: str) -> float | None:
                values = [g[key] for g in sources if key in g]
                return max(values) if values else None

            c = {k: int(round(v)) for k, v in self._counters.items()}
            stats = WindowStats(
                duration_s=now - self._start,
                prompt_tokens=self._prompt,
                generation_tokens=self._generation,
                finished=self._finished,
                aborted=self._aborted,
                num_running=summed("num_running"),
                num_waiting=summed("num_waiting"),
                kv_usage=maxed("kv_usage"),
                state_usage=maxed("state_usage"),
                **c,
            )
            self._reset(now)
        return stats


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def format_stats_line(stats: WindowStats) -> str:
    """One log line for a closed window (pure)."""
    running = "-" if stats.num_running is None else str(stats.num_running)
    waiting = "-" if stats.num_waiting is None else str(stats.num_waiting)
    parts = [
        f"window {stats.duration_s:.1f}s",
        f"running {running}, waiting {waiting}",
        f"prompt {stats.prompt_throughput:.1f} tok/s, gen {stats.generation_throughput:.1f} tok/s",
        f"finished {stats.finished} (aborted {stats.aborted})",
        f"KV {_percent(stats.kv_usage)}, state {_percent(stats.state_usage)}",
    ]
    if stats.prefix_cache_hit_rate is not None:
        parts.append(f"prefix cache hit {_percent(stats.prefix_cache_hit_rate)}")
    if stats.mtp_accept_length is not None:
        parts.append(f"MTP accept len {stats.mtp_accept_length:.2f}")
    if stats.mtp_paused_steps:
        parts.append(f"MTP verify off {stats.mtp_paused_steps} steps")
    parts.append(f"preempted {stats.num_preemptions}")
    return " | ".join(parts)


class StatsTicker:
    """Rolls a window every `interval_s` and emits its line; after one idle line it stays quiet
    until something happens. interval_s <= 0 turns it off."""

    def __init__(
        self,
        window: StatsWindow,
        interval_s: float,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_window: Callable[[WindowStats], None] | None = None,
    ) -> None:
        self.window = window
        self.interval_s = interval_s
        self._emit = emit or logger.info
        self._on_window = on_window  # sees every closed window, quiet ones included
        self._clock = clock
        self._last_roll = clock()
        self._last_idle = False
        self._stop = threading.Event()

    def tick(self, now: float | None = None) -> str | None:
        """Roll and emit if the interval has passed; returns the line emitted, if any."""
        now = self._clock() if now is None else now
        if self.interval_s <= 0 or now - self._last_roll < self.interval_s:
            return None
        self._last_roll = now
        stats = self.window.roll(now)
        if self._on_window is not None:
            self._on_window(stats)
        quiet = stats.idle and self._last_idle
        self._last_idle = stats.idle
        if quiet:
            return None
        line = format_stats_line(stats)
        self._emit(line)
        return line

    async def run_async(self) -> None:
        """For an asyncio process (the server): `asyncio.create_task(ticker.run_async())`."""
        while self.interval_s > 0 and not self._stop.is_set():
            await asyncio.sleep(self.interval_s)
            self.tick()

    def start_thread(self) -> threading.Thread | None:
        """For a synchronous process: a daemon thread; `stop()` ends it."""
        if self.interval_s <= 0:
            return None

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.tick()

        thread = threading.Thread(target=loop, name="stats-ticker", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()


def _flatten(prefix: str, value: Any, out: list[tuple[str, str]]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
        return
    leaf = prefix.rsplit(".", 1)[-1].lower()
    secret = any(word in leaf for word in _SECRET_WORDS) and value not in (None, "")
    out.append((prefix, "***" if secret and isinstance(value, str) else repr(value)))


def format_config_block(config: Any, backends: Mapping[str, Any] | None = None) -> str:
    """Multi-line INFO block: every resolved config field (nested dataclasses/dicts flattened with
    dots; string fields named like keys/tokens/passwords masked) and the resolved backends."""
    rows: list[tuple[str, str]] = []
    _flatten("", config, rows)
    backend_rows = [(str(op), str(name)) for op, name in sorted((backends or {}).items())]
    width = max((len(k) for k, _ in rows + backend_rows), default=0)
    lines = ["resolved config:"]
    lines += [f"  {key.ljust(width)} = {value}" for key, value in rows]
    if backend_rows:
        lines.append("backends:")
        lines += [f"  {op.ljust(width)} = {name}" for op, name in backend_rows]
    return "\n".join(lines)
