"""appliance.progress: a bar on a TTY, periodic log lines otherwise, silence for quick steps."""

from __future__ import annotations

import io
import time

import pytest

from appliance import logging as alog
from appliance.progress import Progress


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    alog.setup_logging("INFO", stream=stream, color=False)
    yield stream
    alog.setup_logging()


def test_quick_step_shows_nothing(log_stream) -> None:
    tty, clock = TTY(), Clock()
    with Progress("loading weights", total=3, unit="tensors", stream=tty, clock=clock) as bar:
        for _ in range(3):
            clock.now += 0.2  # 0.6 s in all: under the 1 s delay
            bar.update()
    assert tty.getvalue() == "" and "loading weights" not in log_stream.getvalue()


def test_tty_bar_redraws_in_place_and_ends_with_a_newline(log_stream) -> None:
    tty, clock = TTY(), Clock()
    with Progress("loading weights", total=4, unit="tensors", stream=tty, clock=clock) as bar:
        for _ in range(4):
            clock.now += 1.5
            bar.update()
    out = tty.getvalue().replace("\033[K", "")  # each redraw clears the rest of the line
    assert tty.getvalue().count("\033[K") == 5  # four redraws and the final one
    assert out.startswith("\rloading weights [")
    assert "1/4 tensors  25% 1.5s" in out and "3/4 tensors  75% 4.5s" in out
    assert out.endswith("] 4/4 tensors 100% 6.0s\n") and out.count("\n") == 1
    assert "#" * 24 in out.splitlines()[-1]
    assert "loading weights" not in log_stream.getvalue()  # the bar is not a log line


def test_pipe_gets_a_log_line_every_interval(log_stream) -> None:
    pipe, clock = io.StringIO(), Clock()
    with Progress("loading weights", total=10, stream=pipe, clock=clock, interval_s=5.0) as bar:
        for _ in range(10):
            clock.now += 2.0
            bar.update()
    assert pipe.getvalue() == ""  # no bar characters on a pipe
    lines = [x for x in log_stream.getvalue().splitlines() if "loading weights" in x]
    # shown at 2 s, then not before 7 s (at 8 s), then at 14 s, and the final line at 20 s
    assert [x.split("appliance.progress: ")[1] for x in lines] == [
        "loading weights: 1/10 (10%) after 2.0s",
        "loading weights: 4/10 (40%) after 8.0s",
        "loading weights: 7/10 (70%) after 14.0s",
        "loading weights: 10/10 (100%) in 20.0s",
    ]
    assert all(" INFO [MainProcess] appliance.progress: " in x for x in lines)


def test_one_slow_item_still_gets_its_final_line(log_stream) -> None:
    pipe, clock = io.StringIO(), Clock()
    with Progress("weights", total=1, stream=pipe, clock=clock) as bar:
        clock.now += 30.0
        bar.update()
    lines = [x for x in log_stream.getvalue().splitlines() if "appliance.progress" in x]
    assert len(lines) == 1 and lines[0].endswith("weights: 1/1 (100%) in 30.0s")


def test_disabled_progress_is_silent(log_stream) -> None:
    tty, clock = TTY(), Clock()
    with Progress("weights", total=2, enabled=False, stream=tty, clock=clock) as bar:
        clock.now += 10
        bar.update(2)
    assert tty.getvalue() == "" and "weights" not in log_stream.getvalue()


def test_step_without_a_count_ticks_elapsed_time(log_stream) -> None:
    tty = TTY()
    with Progress("building the embedded default model", stream=tty, delay_s=0.0):
        time.sleep(0.4)  # one long call: the tick thread draws meanwhile
    out = tty.getvalue().replace("\033[K", "")
    assert out.startswith("\rbuilding the embedded default model: ")
    assert "building the embedded default model: done in " in out and out.endswith("s\n")


def test_weight_loading_reports_every_tensor(tiny_dense, monkeypatch, log_stream) -> None:
    from functools import partial

    from appliance.models import loader

    tty = TTY()
    monkeypatch.setattr(loader, "Progress", partial(Progress, stream=tty, delay_s=0.0))
    names = [name for name, _ in loader.iter_tensors(tiny_dense)]
    mtp = [name for name, _ in loader.iter_tensors(tiny_dense, prefix="mtp.")]
    final = [x for x in tty.getvalue().replace("\033[K", "").split("\r") if x.endswith("\n")]
    assert len(final) == 2 and mtp and set(mtp) < set(names)
    assert final[0].startswith("loading weights [" + "#" * 24 + "]")
    assert f"] {len(names)}/{len(names)} tensors 100% " in final[0]
    assert final[1].startswith("loading mtp.* weights [")
    assert f"] {len(mtp)}/{len(mtp)} tensors 100% " in final[1]
