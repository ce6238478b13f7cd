"""The shipped default model (appliance/assets/default, trained by ops/train/) served as the README
starts it (`appliance serve`, no model): the README's request answers `Paris` right after startup,
held-out questions of every family are answered through the openai SDK with thinking on and off,
tool calls come back parsed, MTP k = 2 accepts drafts and changes no reply."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from appliance.assets import default_model
from ops.train import data, evaluate
from tests.e2e.live import start_appliance

PER_FAMILY = 3  # held-out questions per family, each asked with thinking on and off


@pytest.fixture(scope="module")
def mtp_replies(tmp_path_factory) -> tuple[Path, float, str]:
    """Serves the default with MTP k = 2; -> (the evaluator's dump, README request seconds, its
    content)."""
    assert default_model.shipped_model_dir() is not None, "appliance/assets/default is incomplete"
    root = tmp_path_factory.mktemp("default-model")
    app = start_appliance(None, root / "serve.log", "--mtp-step", "2", max_model_len=2048)
    try:
        t0 = time.monotonic()
        reply = httpx.post(
            f"{app.url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            timeout=60,
        )
        seconds = time.monotonic() - t0
        assert "assets/default" in app.log()  # the trained model, not the random fallback
        dump = root / "mtp.json"
        argv = ["--base-url", app.url, "--per-family", str(PER_FAMILY), "--dump", str(dump)]
        assert evaluate.main([*argv, "--min-accept", "1.8"]) == 0  # MTP mean accept length
    finally:
        app.stop()
    return dump, seconds, reply.json()["choices"][0]["message"]["content"]


def test_the_readme_request_answers_paris(mtp_replies) -> None:
    """Right after /health turns 200 (0.3-0.5 s on a quiet 2-core box; the issue's 2 s is checked
    there, not here: a loaded CI box took 5.2 s once, so this only guards against a hang)."""
    _, seconds, content = mtp_replies
    print(f"README request answered {content!r} in {seconds:.2f} s after startup")
    assert content == "Paris"
    assert seconds < 60.0


def test_held_out_questions_are_answered(mtp_replies) -> None:
    replies = json.loads(mtp_replies[0].read_text())
    assert len(replies) == len(data.FAMILIES) * PER_FAMILY * 2
    accuracy = sum(r["ok"] for r in replies) / len(replies)
    assert accuracy >= 0.9, [r for r in replies if not r["ok"]]  # 0.97 on 1040 (see its README)
    tools = [r for r in replies if r["family"] == "tool"]
    assert all(r["tool_calls"] and r["tool_calls"][0][0].startswith("get_") for r in tools)
    assert sum(r["ok"] for r in tools) >= len(tools) - 1


def test_mtp_changes_no_reply(mtp_replies, tmp_path: Path) -> None:
    app = start_appliance(None, tmp_path / "serve.log", max_model_len=2048)
    try:
        argv = ["--base-url", app.url, "--per-family", str(PER_FAMILY)]
        assert evaluate.main([*argv, "--compare", str(mtp_replies[0])]) == 0
    finally:
        app.stop()
