"""Colored/plain formatting, APPLIANCE_LOG_COLOR / NO_COLOR / APPLIANCE_LOG_LEVEL, access line."""

from __future__ import annotations

import io
import logging

import pytest

from appliance import logging as alog


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


def test_bad_color_value_is_rejected(monkeypatch) -> None:
    monkeypatch.setenv("APPLIANCE_LOG_COLOR", "sometimes")
    with pytest.raises(ValueError, match="APPLIANCE_LOG_COLOR"):
        alog.use_color(TTY())


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
