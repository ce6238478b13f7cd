"""Logging for every process: `get_logger(__name__)`, colored level names on a TTY, the access line.

Called by every module; configured once per process by `setup_logging()` (launch, role entries).
The server calls `log_access(...)` once per HTTP request; the line never carries request bodies.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from appliance import envs

_COLORS = {
    "DEBUG": "\033[36m",
    "INFO": "\033[32m",
    "WARNING": "\033[33m",
    "ERROR": "\033[31m",
    "CRITICAL": "\033[1;31m",
}
_RESET = "\033[0m"
_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s [%(processName)s] %(name)s: %(message)s"
# Liveness/scrape endpoints: logged at DEBUG when they succeed, so INFO is not flooded by probes.
PROBE_PATHS = ("/health", "/metrics", "/ping")
_MAX_PATH = 200
_MAX_REQUEST_ID = 80
_configured = False
LOGGER_TREES = ("appliance", "visual", "appliance_kernels")  # configured together by setup_logging
# Other libraries (uvicorn, asyncio, huggingface_hub, `warnings`) reach the root logger: the same
# format there, WARNING and above only. One handler of ours, so a reconfigure never doubles lines.
_root_handler: logging.Handler | None = None


def use_color(stream: TextIO | None = None) -> bool:
    """APPLIANCE_LOG_COLOR=never or NO_COLOR set: no; always: yes; auto: when stream is a TTY."""
    mode = envs.get_or_default("APPLIANCE_LOG_COLOR")
    if mode == "never" or envs.get_or_default("NO_COLOR"):
        return False
    if mode == "always":
        return True
    stream = stream or sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ColorFormatter(logging.Formatter):
    """The one log format; with color=True the level name is wrapped in an ANSI color."""

    def __init__(self, color: bool) -> None:
        super().__init__(_FORMAT, datefmt="%H:%M:%S")
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        if self.color and record.levelname in _COLORS:
            record = logging.makeLogRecord(record.__dict__)
            record.levelname = f"{_COLORS[record.levelname]}{record.levelname}{_RESET}"
        return super().format(record)


def setup_logging(
    level: str | None = None, stream: TextIO | None = None, color: bool | None = None
) -> None:
    """(Re)configure the logger trees of the project's packages (`appliance`, and the libraries
    `visual` and `kernels`, which log on stdlib loggers): one handler on `stream` (default stderr).
    Third-party loggers and `warnings.warn` reach the root logger, which gets the same format at
    WARNING (uvicorn runs with log_config=None, so its error logger propagates there).

    level defaults to APPLIANCE_LOG_LEVEL (INFO when invalid: the launcher reports that), color to
    `use_color(stream)`."""
    global _configured, _root_handler
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ColorFormatter(use_color(stream) if color is None else color))
    level = (level or envs.get_or_default("APPLIANCE_LOG_LEVEL")).upper()
    for name in LOGGER_TREES:
        root = logging.getLogger(name)
        root.handlers[:] = [handler]
        root.setLevel(level)
        root.propagate = False
    stdlib_root = logging.getLogger()
    if _root_handler is not None:
        stdlib_root.removeHandler(_root_handler)
    _root_handler = logging.StreamHandler(stream)
    _root_handler.setFormatter(handler.formatter)
    _root_handler.setLevel(max(logging.WARNING, logging.getLevelName(level)))
    stdlib_root.addHandler(_root_handler)
    logging.captureWarnings(True)
    _configured = True


def get_logger(name: str) -> logging.Logger:
    if not _configured:
        setup_logging()
    if not name.startswith("appliance"):
        name = f"appliance.{name}"
    return logging.getLogger(name)


def _printable(text: str, limit: int) -> str:
    """Control characters become '?', so one request can never write extra log lines."""
    clean = "".join(ch if ch.isprintable() and ch != " " else "?" for ch in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def access_line(
    method: str, path: str, status: int, latency_s: float, request_id: str, **fields: str
) -> str:
    """`POST /v1/chat/completions 200 0.123s id=req-1 completion=chatcmpl-2 aborted=client_gone`:
    `fields` follow as key=value, the empty ones left out. The query string is dropped and nothing
    from the body is accepted, so no prompt text can reach the log."""
    bare_path = path.split("?", 1)[0].split("#", 1)[0]
    line = (
        f"{_printable(method.upper(), 16)} {_printable(bare_path, _MAX_PATH)} {int(status)} "
        f"{latency_s:.3f}s id={_printable(request_id or '-', _MAX_REQUEST_ID)}"
    )
    for key, value in fields.items():
        if value:
            line += f" {key}={_printable(value, _MAX_REQUEST_ID)}"
    return line


def access_level(path: str, status: int) -> int:
    """DEBUG for successful probes (/health, /metrics), INFO for everything else."""
    bare_path = path.split("?", 1)[0]
    return logging.DEBUG if bare_path in PROBE_PATHS and int(status) < 400 else logging.INFO


def log_access(
    method: str, path: str, status: int, latency_s: float, request_id: str, **fields: str
) -> None:
    """One access-log line on the `appliance.access` logger (the caller decides whether to log)."""
    logger = get_logger("appliance.access")
    level = access_level(path, status)
    if logger.isEnabledFor(level):
        line = access_line(method, path, status, latency_s, request_id, **fields)
        logger.log(level, "%s", line)
