"""Process lifecycle of a live appliance: TP=2 over gloo equals TP=1 (prompt logprobs included),
both ranks write a trace between POST /start_profile and /stop_profile, SIGTERM drains in-flight
work and exits 0, and a SIGKILLed worker fails open streams fast, fails /health, and makes the
launcher exit non-zero naming the worker."""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.live import start_appliance
from tests.e2e.scoring import assert_scored_like_transformers

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "user", "content": "count to ten"}]


def test_tp2_matches_tp1_and_sigterm_drains(tiny_dense, tmp_path):
    from appliance import LLM, SamplingParams

    prompts = [[5, 17, 300, 4, 250], list(range(60, 90))]
    ref = LLM(str(tiny_dense), max_model_len=512).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    )
    app = start_appliance(tiny_dense, tmp_path / "tp2.log", "--tp", "2")
    try:
        assert "worker 1 ready" in app.log()
        sdk = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)
        for prompt, expected in zip(prompts, ref, strict=True):
            out = sdk.completions.create(
                model=tiny_dense.name,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == expected.text
            want = [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)]
            assert out.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        # prompt logprobs from the logits gathered over both ranks
        scored = sdk.completions.create(
            model=tiny_dense.name, prompt=prompts[1], echo=True, logprobs=2, max_tokens=0
        )
        assert_scored_like_transformers(tiny_dense, prompts[1], scored.choices[0].logprobs, 2)
        check_profiler_on_both_ranks(app, sdk, tiny_dense.name, tmp_path / "traces")
        # SIGTERM while a request is in flight: it completes, new work is refused, exit 0.
        result: dict = {}

        def long_request() -> None:
            result["out"] = sdk.chat.completions.create(
                model=tiny_dense.name,
                messages=MSGS,
                max_tokens=40,
                extra_body={**NO_THINK, "ignore_eos": True},
            )

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 60
        while app.status()["router"]["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        app.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(f"{app.url}/v1/chat/completions", json={"messages": MSGS}, timeout=10)
        assert refused.status_code == 503
        worker.join(120)
        out = result["out"]
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 40
        assert app.proc.wait(60) == 0
        assert "drained (0 requests aborted)" in app.log()
    finally:
        app.stop()


def post_raw(app, body: str) -> httpx.Response:
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    return httpx.post(f"{app.url}/start_profile", content=body, headers=form, timeout=60)


def check_profiler_on_both_ranks(app, sdk, model: str, folder) -> None:
    """SGLang's / vLLM's POST /start_profile and /stop_profile: every rank writes its trace of
    the steps between them; the switches the router cannot apply are refused with 400s."""

    def post(path: str, body=None) -> httpx.Response:
        return httpx.post(f"{app.url}{path}", json=body, timeout=60)

    refused = post("/stop_profile")
    assert refused.status_code == 400 and "not running" in refused.json()["error"]["message"]
    bad = post("/start_profile", {"activities": ["RPD"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "activities"
    for field, value in (("num_steps", 0), ("start_step", 5), ("profile_by_stage", True)):
        bad = post("/start_profile", {field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    assert "Malformed JSON" in post_raw(app, "{num_steps").json()["error"]["message"]
    # as `curl -d '{...}'` sends it: a form's Content-Type, a JSON body
    started = post_raw(app, json.dumps({"output_dir": str(folder), "profile_id": "run1"}))
    assert started.status_code == 200, started.text
    assert started.json()["output_dir"] == str(folder)
    again = post("/start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    sdk.completions.create(model=model, prompt=[5, 17, 300], max_tokens=4, temperature=0)
    stopped = post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    files = stopped.json()["files"]
    assert files == [str(folder / f"run1-TP-{rank}.trace.json.gz") for rank in (0, 1)]
    for path in files:  # rank 1 writes its own while rank 0 answers: wait for it
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        events = json.loads(gzip.open(path).read())["traceEvents"]
        steps = {e["name"] for e in events if str(e.get("name", "")).startswith("step ")}
        assert len(steps) >= 4, (path, steps)  # the prefill and the decodes, at least
    assert post("/stop_profile").status_code == 400


def _long_stream(app, model: str):
    """An open streamed chat request of 400 tokens: its chunks."""
    sdk = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)
    stream = sdk.chat.completions.create(
        model=model,
        messages=MSGS,
        max_tokens=400,
        stream=True,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    return iter(stream)


def test_killed_worker_fails_streams_health_and_launcher(tiny_dense, tmp_path):
    app = start_appliance(tiny_dense, tmp_path / "kill.log")
    try:
        chunks = _long_stream(app, tiny_dense.name)
        for _ in range(3):
            next(chunks)
        os.kill(app.role_pid("worker 0"), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        assert time.monotonic() - killed < 10
        assert "worker 0" in str(info.value)
        healthy = True
        while healthy and time.monotonic() - killed < 10:
            try:
                healthy = httpx.get(f"{app.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
        assert not healthy
        code = app.proc.wait(30)
        assert code != 0
        assert "worker 0 (pid" in app.log() and "exited with code -9" in app.log()
    finally:
        app.stop()


def test_port_0_logs_the_port_it_got_and_a_dot_folder_keeps_its_name(tiny_dense, tmp_path):
    """`appliance serve . --port 0` run inside the checkpoint: the ready line names the port the
    server was given, and the model id is the folder's own name (not "")."""
    import re
    import subprocess
    import sys

    from tests.e2e.live import ROOT, STARTUP_TIMEOUT_S

    log_path = tmp_path / "port0.log"
    cmd = [sys.executable, "-m", "appliance.cli", "serve", ".", "--port", "0", "--device", "cpu"]
    env = {**os.environ, "APPLIANCE_LOG_STATS_INTERVAL": "0", "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=tiny_dense, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (
            found := re.search(r"ready in .*: http://127\.0\.0\.1:(\d+) ", log_path.read_text())
        ):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.25)
        port = int(found.group(1))
        assert port != 0
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [tiny_dense.name]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_second_sigterm_stops_at_once_and_leaves_no_run_folder(tiny_dense, tmp_path):
    """A JSON answer whose client left is a 499 in the access log. SIGTERM drains; a second one
    while a request is still open stops everything at once (exit 1), and still removes the
    launcher's run folder (its ipc sockets)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    app = start_appliance(tiny_dense, tmp_path / "twice.log", env={"TMPDIR": str(temp)})
    try:
        assert [p.name for p in temp.iterdir() if p.name.startswith("appliance-")]
        # a JSON (not streamed) answer whose client left is logged 499, not 200
        body = {"messages": MSGS, "max_tokens": 400, **NO_THINK, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 30
        while "POST /v1/chat/completions 499" not in app.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "POST /v1/chat/completions 499" in app.log(), app.log()[-2000:]
        chunks = _long_stream(app, tiny_dense.name)
        next(chunks)
        app.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "draining" not in app.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        app.proc.send_signal(signal.SIGTERM)
        assert app.proc.wait(30) == 1
        assert "second signal: stopping now without draining" in app.log()
        assert not [p.name for p in temp.iterdir() if p.name.startswith("appliance-")]
    finally:
        app.stop()
