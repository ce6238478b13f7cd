"""StatsWindow arithmetic, the stats line, the ticker's quiet mode and the config block."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from appliance.stats import (
    StatsTicker,
    StatsWindow,
    WindowStats,
    format_config_block,
    format_stats_line,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_from_per_request_deltas_excludes_aborted() -> None:
    clock = Clock()
    w = StatsWindow(clock)
    w.on_prompt("a", 100)
    w.on_generation("a", 20)
    w.on_prompt("b", 300)
    w.on_generation("b", 7)
    w.on_finished("b", "abort")
    w.on_prompt("c", 50)
    w.on_generation("c", 5)
    w.on_finished("c", "stop")
    clock.now = 10.0
    stats = w.roll()
    assert stats.duration_s == 10.0
    assert stats.prompt_tokens == 150  # a (still running) + c; b aborted
    assert stats.generation_tokens == 25
    assert stats.prompt_throughput == pytest.approx(15.0)
    assert stats.generation_throughput == pytest.approx(2.5)
    assert (stats.finished, stats.aborted) == (2, 1)


def test_rollover_keeps_each_windows_own_deltas() -> None:
    clock = Clock()
    w = StatsWindow(clock)
    w.on_prompt("long", 40)
    w.on_generation("long", 10)
    clock.now = 5.0
    first = w.roll()
    assert (first.prompt_tokens, first.generation_tokens) == (40, 10)
    # Second window: the running request makes 6 more tokens, then is aborted.
    w.on_generation("long", 6)
    w.on_finished("long", "abort")
    w.on_generation("short", 4)
    w.on_finished("short", "length")
    clock.now = 7.0
    second = w.roll()
    assert second.duration_s == pytest.approx(2.0)
    assert (second.prompt_tokens, second.generation_tokens) == (0, 4)
    assert (second.finished, second.aborted) == (2, 1)
    clock.now = 8.0
    third = w.roll()
    assert (third.generation_tokens, third.finished) == (0, 0)
    assert third.idle


def test_router_counters_are_window_deltas_and_gauges_latest() -> None:
    w = StatsWindow(Clock())
    w.on_router_stats(
        {
            "num_running": 4,
            "num_waiting": 1,
            "kv_usage": 0.5,
            "state_usage": 0.25,
            "mtp_drafts": 100,
            "mtp_draft_tokens": 300,
            "mtp_accepted_tokens": 170,
            "num_preemptions": 2,
        }
    )
    first = w.roll(now=1.0)
    assert first.mtp_accept_length == pytest.approx(2.7)
    assert first.num_preemptions == 2
    w.on_router_stats(
        {
            "num_running": 2,
            "num_waiting": 0,
            "kv_usage": 0.3,
            "mtp_drafts": 110,
            "mtp_draft_tokens": 330,
            "mtp_accepted_tokens": 180,
            "num_preemptions": 2,
        }
    )
    second = w.roll(now=2.0)
    assert second.mtp_accept_length == pytest.approx(2.0)  # 1 + 10/10
    assert second.num_preemptions == 0
    assert (second.num_running, second.num_waiting) == (2, 0)
    assert second.kv_usage == pytest.approx(0.3)
    assert second.state_usage == pytest.approx(0.25)  # not in the last snapshot: kept


def test_format_stats_line() -> None:
    stats = WindowStats(
        duration_s=10.0,
        prompt_tokens=12345,
        generation_tokens=4567,
        finished=5,
        aborted=1,
        num_running=3,
        num_waiting=2,
        kv_usage=0.123,
        state_usage=0.04,
        mtp_drafts=100,
        mtp_accepted_tokens=171,
        mtp_paused_steps=40,
        num_preemptions=1,
        prefix_cache_queries=2000,
        prefix_cache_hits=1500,
    )
    assert format_stats_line(stats) == (
        "window 10.0s | running 3, waiting 2 | prompt 1234.5 tok/s, gen 456.7 tok/s | "
        "finished 5 (aborted 1) | KV 12.3%, state 4.0% | prefix cache hit 75.0% | "
        "MTP accept len 2.71 | MTP verify off 40 steps | preempted 1"
    )
    empty = WindowStats(duration_s=5.0, prompt_tokens=0, generation_tokens=0, finished=0, aborted=0)
    assert format_stats_line(empty) == (
        "window 5.0s | running -, waiting - | prompt 0.0 tok/s, gen 0.0 tok/s | "
        "finished 0 (aborted 0) | KV -, state - | preempted 0"
    )


def test_ticker_emits_on_interval_and_goes_quiet_when_idle() -> None:
    clock, lines = Clock(), []
    w = StatsWindow(clock)
    ticker = StatsTicker(w, interval_s=10.0, emit=lines.append, clock=clock)
    w.on_generation("a", 50)
    clock.now = 5.0
    assert ticker.tick() is None  # interval not reached
    clock.now = 10.0
    assert "gen 5.0 tok/s" in ticker.tick()
    w.on_finished("a", "stop")
    clock.now = 20.0
    assert ticker.tick() is not None  # a request finished
    clock.now = 30.0
    assert ticker.tick() is not None  # first idle window is still logged
    clock.now = 40.0
    assert ticker.tick() is None  # then quiet
    w.on_generation("b", 1)
    clock.now = 50.0
    assert ticker.tick() is not None
    assert len(lines) == 4
    off = StatsTicker(StatsWindow(clock), interval_s=0, emit=lines.append, clock=clock)
    clock.now = 1000.0
    assert off.tick() is None and off.start_thread() is None


def test_ticker_async_loop_emits_real_lines() -> None:
    lines: list[str] = []
    w = StatsWindow()
    w.on_generation("a", 3)
    ticker = StatsTicker(w, interval_s=0.02, emit=lines.append)

    async def main() -> None:
        task = asyncio.create_task(ticker.run_async())
        await asyncio.sleep(0.1)
        ticker.stop()
        await asyncio.wait_for(task, 1.0)

    asyncio.run(main())
    assert lines and lines[0].startswith("window ")
    assert sum("gen 0.0 tok/s" not in line for line in lines) == 1  # the 3 tokens, once


@dataclass(frozen=True)
class _Inner:
    tp: int = 2
    api_key: str = "sk-secret"


@dataclass(frozen=True)
class _Outer:
    model_dir: str = "/models/q"
    parallel: _Inner = field(default_factory=_Inner)


def test_config_block_flattens_masks_and_lists_backends() -> None:
    block = format_config_block(_Outer(), {"gdn_prefill": "triton", "attention": "torch"})
    lines = block.splitlines()
    assert lines[0] == "resolved config:"
    assert lines[1].split() == ["model_dir", "=", "'/models/q'"]
    assert lines[2].split() == ["parallel.tp", "=", "2"]
    assert lines[3].split() == ["parallel.api_key", "=", "***"]
    assert "sk-secret" not in block
    assert lines[4] == "backends:"
    assert lines[5].split() == ["attention", "=", "torch"]
    assert lines[6].split() == ["gdn_prefill", "=", "triton"]
