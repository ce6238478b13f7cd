"""Progress of a long startup step: a bar redrawn in place on a TTY, a log line every few seconds
otherwise, nothing at all for a step that ends quickly.

Used by the embedded default model build (appliance/assets), weight loading (models/loader.py),
and open to any other startup loop (e.g. CUDA-graph capture):

    with Progress("loading weights", total=len(names), unit="tensors") as bar:
        for name in names:
            ...
            bar.update()

`total=None` is a step without a count (one long call): a background tick shows the elapsed time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from appliance.logging import get_logger

logger = get_logger(__name__)

_BAR_WIDTH = 24
_CLEAR_LINE = "\033[K"  # erase what a longer earlier redraw left to the right


class Progress:
    """One step's progress; a context manager. Thread-safe `update`."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "",
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        delay_s: float = 1.0,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.done = 0
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._tty = _isatty(self._stream)
        self._delay_s = delay_s  # nothing is shown for a step shorter than this
        self._interval_s = interval_s if not self._tty else 0.1  # between lines / redraws
        self._clock = clock
        self._t0 = clock()
        self._last_shown: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # ------------------------------------------------------------------ use
    def __enter__(self) -> Progress:
        if self.enabled and self.total is None:
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self._maybe_show()

    def close(self) -> None:
        """Stops the tick; a step that took longer than the delay ends with a final line."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            quick = self._clock() - self._t0 < self._delay_s
            if not self.enabled or (self._last_shown is None and quick):
                return
            if self._tty:
                self._stream.write("\r" + self.render(final=True) + _CLEAR_LINE + "\n")
                self._stream.flush()
            else:
                logger.info("%s", self.render(final=True))
            self._last_shown = None

    # ------------------------------------------------------------------ display
    def render(self, final: bool = False) -> str:
        """`loading weights [######......]  120/480 tensors  25%  3.2s` (bar on a TTY only)."""
        elapsed = f"{self._clock() - self._t0:.1f}s"
        if self.total is None:
            return f"{self.desc}: {'done in ' if final else ''}{elapsed}"
        count = f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''}"
        share = self.done / self.total if self.total else 1.0
        if self._tty:
            filled = int(round(share * _BAR_WIDTH))
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            return f"{self.desc} [{bar}] {count} {share:4.0%} {elapsed}"
        return f"{self.desc}: {count} ({share:.0%}) {'in' if final else 'after'} {elapsed}"

    def _maybe_show(self) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if now - self._t0 < self._delay_s:
            return
        if self._last_shown is not None and now - self._last_shown < self._interval_s:
            return
        if not self._tty and self.total is not None and self.done >= self.total:
            return  # the final line follows at close
        self._last_shown = now
        if self._tty:
            self._stream.write("\r" + self.render() + _CLEAR_LINE)
            self._stream.flush()
        else:
            logger.info("%s", self.render())

    def _tick(self) -> None:
        while not self._stop.wait(min(self._interval_s, 0.5)):
            with self._lock:
                self._maybe_show()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
