"""Colored/plain formatting, APPLIANCE_LOG_COLOR / NO_COLOR / APPLIANCE_LOG_LEVEL, access line."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import logging as alog

ROOT = Path(__file__).resolve().parents[2]


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch):
    for name in ("APPLIANCE_LOG_COLOR", "NO_COLOR", "APPLIANCE_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    yield
    monkeypatch.undo()
    alog.setup_logging()


def emit(stream: io.StringIO, level: int = logging.WARNING, text: str = "hello") -> str:
    alog.setup_logging(stream=stream)
    alog.get_logger("appliance.test").log(level, text)
    return stream.getvalue()


@pytest.mark.parametrize(
    ("env", "stream_cls", "colored"),
    [
        ({}, TTY, True),
        ({}, io.StringIO, False),
        ({"APPLIANCE_LOG_COLOR": "never"}, TTY, False),
        ({"APPLIANCE_LOG_COLOR": "always"}, io.StringIO, True),
        ({"NO_COLOR": "1"}, TTY, False),
        ({"NO_COLOR": "1", "APPLIANCE_LOG_COLOR": "always"}, io.StringIO, False),
    ],
)
def test_color_switches(monkeypatch, env, stream_cls, colored) -> None:
    for key, val in env.items():
        monkeypatch.setenv(key, val)
    out = emit(stream_cls())
    assert ("\033[33mWARNING\033[0m" in out) is colored
    assert ("\033[" in out) is colored
    assert out.rstrip().endswith("appliance.test: hello")
    if not colored:
        assert " WARNING [" in out


def test_bad_values_fall_back_and_are_left_to_the_launcher(monkeypatch) -> None:
    """Logging must come up even with invalid flags (modules log at import); the launcher's
    envs.validate() is what rejects them, naming flag, value and choices."""
    from appliance import envs

    monkeypatch.setenv("APPLIANCE_LOG_COLOR", "sometimes")
    monkeypatch.setenv("APPLIANCE_LOG_LEVEL", "loud")
    assert alog.use_color(TTY()) is True  # auto on a TTY
    stream = io.StringIO()
    alog.setup_logging(stream=stream)
    alog.get_logger("appliance.test").info("still logs at INFO")
    assert "still logs at INFO" in stream.getvalue()
    with pytest.raises(envs.EnvError) as info:
        envs.validate()
    message = str(info.value)
    assert "APPLIANCE_LOG_COLOR='sometimes': expected one of auto, always, never" in message
    assert "APPLIANCE_LOG_LEVEL='loud': expected one of DEBUG, INFO, WARNING, ERROR" in message
    assert "\n" not in message


def test_third_party_loggers_and_warnings_use_the_format() -> None:
    """uvicorn (log_config=None), asyncio and `warnings.warn` reach the root logger: the appliance
    format, WARNING and above only, one line each even after a reconfigure. A fresh interpreter,
    because pytest owns `warnings` inside a test."""
    script = (
        "import logging, warnings\n"
        "from appliance.logging import setup_logging\n"
        "setup_logging('INFO', color=False)\n"
        "setup_logging('INFO', color=False)\n"
        "logging.getLogger('uvicorn.error').error('[Errno 98] address already in use')\n"
        "logging.getLogger('uvicorn.error').info('Started server process')\n"
        "logging.getLogger('asyncio').error('Task exception was never retrieved')\n"
        "warnings.warn('a library warning', UserWarning)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert err.count("address already in use") == 1, err
    assert " ERROR [MainProcess] uvicorn.error: [Errno 98] address already in use" in err
    assert " ERROR [MainProcess] asyncio: Task exception was never retrieved" in err
    assert " WARNING [MainProcess] py.warnings: " in err and "a library warning" in err
    assert "Started server process" not in err


def test_log_level_from_env(monkeypatch) -> None:
    monkeypatch.setenv("APPLIANCE_LOG_LEVEL", "warning")
    stream = io.StringIO()
    alog.setup_logging(stream=stream)
    log = alog.get_logger("appliance.test")
    log.info("quiet")
    log.error("loud")
    assert "quiet" not in stream.getvalue() and "loud" in stream.getvalue()
    alog.setup_logging("DEBUG", stream=stream)
    log.debug("now visible")
    assert "now visible" in stream.getvalue()


def test_get_logger_names_under_appliance() -> None:
    assert alog.get_logger("server.app").name == "appliance.server.app"
    assert alog.get_logger("appliance.router").name == "appliance.router"


def test_access_line_fields_and_no_prompt_text() -> None:
    line = alog.access_line("post", "/v1/chat/completions", 200, 0.12345, "chatcmpl-7")
    assert line == "POST /v1/chat/completions 200 0.123s id=chatcmpl-7"
    prompt = "tell me a secret story"
    leaky = alog.access_line(
        "GET", f"/v1/models?prompt={prompt}#frag", 404, 0.001, "abc\nINJECTED line"
    )
    assert leaky == "GET /v1/models 404 0.001s id=abc?INJECTED?line"
    assert "secret" not in leaky and "\n" not in leaky
    long_id = alog.access_line("GET", "/health", 200, 0.0, "x" * 500)
    assert len(long_id) < 140


def test_access_log_levels() -> None:
    stream = io.StringIO()
    alog.setup_logging("INFO", stream=stream, color=False)
    alog.log_access("GET", "/health", 200, 0.001, "h1")
    alog.log_access("GET", "/metrics", 200, 0.001, "m1")
    alog.log_access("POST", "/v1/completions", 200, 0.5, "c1")
    alog.log_access("GET", "/health", 503, 0.001, "h2")
    out = stream.getvalue()
    assert "id=h1" not in out and "id=m1" not in out
    assert "INFO [MainProcess] appliance.access: POST /v1/completions 200 0.500s id=c1" in out
    assert "GET /health 503" in out
    alog.setup_logging("DEBUG", stream=stream, color=False)
    alog.log_access("GET", "/health", 200, 0.001, "h3")
    assert "DEBUG [MainProcess] appliance.access: GET /health 200 0.001s id=h3" in stream.getvalue()
