"""A fresh default start, as the README runs it (`appliance serve`, no model, empty APPLIANCE_HOME):
it builds the embedded model, prints one config block with the resolved kernel backends, logs
every line in the appliance format, warns about nothing, answers a request (and the SDK's defaults:
no max_tokens) and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.e2e.live import STARTUP_TIMEOUT_S, free_port

LOG_LINE = re.compile(r"\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[[^\]]+\] \S+: ")
BLOCK_LINE = re.compile(r"(  \S+ +=( .*)?|backends:)")  # continuation lines of the config block


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"not healthy in {STARTUP_TIMEOUT_S}s:\n{log.read_text()}")


def test_fresh_default_start_is_clean(tmp_path) -> None:
    script = Path(sys.executable).with_name("appliance")  # the console script the README runs
    assert script.is_file(), f"{script}: install the project (pip install -e .)"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "HF_"))}
    env["APPLIANCE_HOME"] = str(tmp_path / "home")  # fresh: the default model is built here
    env["APPLIANCE_DEFAULT_MODEL"] = "random"  # the build path, also once trained weights ship
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(script), "serve", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        _sdk_defaults_are_served(url, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text
    assert "building the embedded default model" in text
    lines = text.splitlines()
    noise = re.compile(r" (WARNING|ERROR|CRITICAL) \[|Traceback|Warning\b|warnings?\.warn")
    assert [x for x in lines if noise.search(x)] == []
    assert [x for x in lines if not (LOG_LINE.match(x) or BLOCK_LINE.fullmatch(x))] == []
    assert sum("resolved config:" in x for x in lines) == 1
    start = lines.index("backends:")
    backends = dict(x.split(" = ") for x in lines[start + 1 : start + 4])
    backends = {k.strip(): v.strip() for k, v in backends.items()}
    # what this machine resolves "auto" to, not the request: torch on a CPU-only box
    expected = "torch" if not _has_cuda() else None
    assert set(backends) == {"attention", "fp8_gemm", "gdn_prefill"}
    assert "auto" not in backends.values()
    if expected:
        assert set(backends.values()) == {expected}


def _sdk_defaults_are_served(url: str, log: Path) -> None:
    """The official SDK with its default request settings: /v1/models advertises the context the
    KV pool holds, and a chat without max_tokens (the rest of the context) is admitted (read a few
    chunks: the random default model may talk for minutes) as is a default completion."""
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    card = sdk.models.list().data[0]
    ready = re.search(r"max_model_len (\d+), (\d+) KV slots", log.read_text())
    assert card.model_extra["max_model_len"] == int(ready.group(1)) <= int(ready.group(2))
    messages = [{"role": "user", "content": "hi"}]
    with sdk.chat.completions.create(model=card.id, messages=messages, stream=True) as stream:
        chunks = [chunk for chunk, _ in zip(stream, range(4))]
    assert len(chunks) == 4 and chunks[0].choices[0].delta.role == "assistant"
    out = sdk.completions.create(model=card.id, prompt="hi")
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 16


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
