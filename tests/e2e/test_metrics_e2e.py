"""/metrics, the windowed stats line, /debug/status and the access log after a scripted load
against a live appliance (issue 7).

The load: two requests that stop (one non-stream, one stream), one cut by max_tokens and one stream
the client abandons mid-way. Outputs are forced (appliance.testing.forced) so the token counts are
known; the stats interval is 1 s so the launcher log carries stats lines.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from appliance.testing.forced import forced_copy
from tests.e2e.live import start_appliance

MODEL = "tiny-metrics"
SECRET = "zebracorn"  # in every prompt; must never reach a log line or /debug/status
SCRIPTS = {"[m:short]": "Hello there, operator.", "[m:long]": "One two three four five six seven."}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
STATS_LINE = re.compile(
    r"appliance\.stats: window (?P<dur>[\d.]+)s"
    r" \| running (?P<running>\S+), waiting (?P<waiting>\S+)"
    r" \| prompt (?P<prompt>[\d.]+) tok/s, gen (?P<gen>[\d.]+) tok/s"
    r" \| finished (?P<finished>\d+) \(aborted (?P<aborted>\d+)\) \| KV (?P<kv>\S+),"
)


def _messages(trigger: str) -> list[dict]:
    return [{"role": "user", "content": f"Say something, {SECRET}. {trigger}"}]


@pytest.fixture(scope="module")
def model_dir(tiny_dense, tmp_path_factory):
    return forced_copy(tiny_dense, tmp_path_factory.mktemp("metrics") / MODEL, SCRIPTS)


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("live_metrics") / "appliance.log"
    app = start_appliance(
        model_dir,
        log,
        "--runner",
        "appliance.testing.forced:ForcedRunner",
        env={"APPLIANCE_LOG_STATS_INTERVAL": "1", "APPLIANCE_LOG_COLOR": "never"},
    )
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels without model_name): value}; checks model_name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return out


def _reason(metrics, reason: str) -> float:
    return metrics[("appliance_requests_finished_total", (("finish_reason", reason),))]


def _one(metrics, name: str) -> float:
    return metrics[(name, ())]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def _prompt_len(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def load(live, tokenizer):
    """Runs the scripted load once; returns what the client saw."""
    sdk = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    kw = dict(model=MODEL, temperature=0, extra_body=NO_THINK)
    usages = []
    out = sdk.chat.completions.create(
        messages=_messages("[m:short]"), extra_headers={"X-Request-Id": "load-1"}, **kw
    )
    assert (out.choices[0].finish_reason, out.choices[0].message.content) == (
        "stop",
        SCRIPTS["[m:short]"],
    )
    usages.append(out.usage)
    stream = sdk.chat.completions.create(
        messages=_messages("[m:short]"),
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "load-2"},
        **kw,
    )
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usages.append(chunks[-1].usage)
    out = sdk.chat.completions.create(
        messages=_messages("[m:long]"),
        max_tokens=5,
        extra_headers={"X-Request-Id": "load-3"},
        **kw,
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    usages.append(out.usage)
    seen, status = _abandoned_stream(live)
    metrics = _wait_gauges_idle(live.url)  # before any /debug/status call refreshes the gauges
    generated = _one(metrics, "appliance_generation_tokens_total")
    prompt_total = sum(u.prompt_tokens for u in usages)
    prompt_total += _prompt_len(tokenizer, _messages("no script here"))
    return {
        "usages": usages,
        "abandoned_seen": seen,
        "status_while_running": status,
        "metrics": metrics,
        "generated": generated,
        "prompt_total": prompt_total,
    }


def _abandoned_stream(live) -> tuple[int, dict]:
    """A long stream (no script: the model samples freely) the client closes after a few chunks;
    returns the content chunks seen and a /debug/status snapshot taken while it ran."""
    body = {
        "model": MODEL,
        "messages": _messages("no script here"),
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        **NO_THINK,
    }
    headers = {"X-Request-Id": "load-4"}
    url = f"{live.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url, json=body, headers=headers) as response:
            lines = response.iter_lines()
            first = [next(lines) for _ in range(8)]
            # token chunks only: the opening role chunk carries an empty "content" too
            seen = [line for line in first if '"content"' in line and '"role"' not in line]
            status = live.status()
        # leaving the block closes the connection mid-stream: the server aborts the request
    return len(seen), status


def test_debug_status_has_progress_but_no_prompt_text(load):
    status = load["status_while_running"]
    assert SECRET not in json.dumps(status)
    (req,) = status["requests"]
    assert set(req) == {
        "req_id",
        "status",
        "prompt_tokens",
        "output_tokens",
        "computed_tokens",
        "kv_slots",
        "preemptions",
        "cached_tokens",
    }
    assert req["status"] == "running" and req["prompt_tokens"] > 0 and req["output_tokens"] >= 1
    assert status["router"]["num_running"] == 1 and status["router"]["kv_used"] > 0


def _wait_gauges_idle(url: str, timeout_s: float = 10.0) -> dict:
    """/metrics once the router's idle snapshot has arrived (no /debug/status call in between)."""
    gauges = (
        "appliance_num_requests_running",
        "appliance_num_requests_waiting",
        "appliance_kv_cache_usage_ratio",
        "appliance_linear_state_usage_ratio",
    )
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        if all(_one(metrics, g) == 0 for g in gauges) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_metrics_equal_the_load(load):
    metrics = load["metrics"]
    for gauge in (
        "appliance_num_requests_running",
        "appliance_num_requests_waiting",
        "appliance_kv_cache_usage_ratio",
        "appliance_linear_state_usage_ratio",
        "appliance_num_requests_frontend",
    ):
        assert _one(metrics, gauge) == 0, gauge
    reasons = {r: _reason(metrics, r) for r in ("stop", "length", "abort", "error", "tool_calls")}
    assert reasons == {"stop": 2, "length": 1, "abort": 1, "error": 0, "tool_calls": 0}
    usages, prompt_total, generated = load["usages"], load["prompt_total"], load["generated"]
    assert _one(metrics, "appliance_prompt_tokens_total") == prompt_total
    assert _one(metrics, "appliance_request_prompt_tokens_sum") == prompt_total
    assert _one(metrics, "appliance_request_generation_tokens_sum") == generated
    abandoned_generated = generated - sum(u.completion_tokens for u in usages)
    assert load["abandoned_seen"] <= abandoned_generated < 400
    for histogram in (
        "appliance_time_to_first_token_seconds",
        "appliance_e2e_request_latency_seconds",
        "appliance_request_queue_time_seconds",
        "appliance_request_time_per_output_token_seconds",
        "appliance_request_prompt_tokens",
        "appliance_request_generation_tokens",
    ):
        assert _one(metrics, f"{histogram}_count") == 4, histogram
        inf = metrics[(f"{histogram}_bucket", (("le", "+Inf"),))]
        assert inf == 4, histogram
    # one token per delivery without MTP: every token after a request's first is one ITL sample
    assert _one(metrics, "appliance_inter_token_latency_seconds_count") == generated - 4
    chat = (("route", "/v1/chat/completions"), ("status", "200"))
    assert metrics[("appliance_http_requests_total", chat)] == 4


def _stats_lines(log: str) -> list[dict]:
    return [m.groupdict() for m in STATS_LINE.finditer(log)]


def test_stats_line_agrees_with_the_load(live, load):
    usages = load["usages"]
    deadline = time.monotonic() + 10
    while True:  # the idle line after the load closes the last busy window
        lines = _stats_lines(live.log())
        finished = sum(int(line["finished"]) for line in lines)
        if (finished == 4 and lines[-1]["running"] == "0") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert finished == 4 and sum(int(line["aborted"]) for line in lines) == 1, lines
    last = lines[-1]
    assert (last["running"], last["waiting"], last["kv"]) == ("0", "0", "0.0%")

    def window_tokens(key: str) -> tuple[float, float]:
        """Tokens the lines imply, and the rounding slack of their one-decimal numbers."""
        total = sum(float(line[key]) * float(line["dur"]) for line in lines)
        slack = sum(0.05 * float(line[key]) + 0.05 * float(line["dur"]) + 0.0025 for line in lines)
        return total, slack

    # Tokens of the abandoned request count in windows closed while it ran, not in the window
    # where it was aborted: the lines fall between "completed requests only" and "everything".
    gen, slack = window_tokens("gen")
    completed_gen = sum(u.completion_tokens for u in usages)
    assert completed_gen - slack <= gen <= load["generated"] + slack
    assert any(float(line["gen"]) > 0 for line in lines)
    prompt, slack = window_tokens("prompt")
    completed_prompt = sum(u.prompt_tokens for u in usages)
    assert completed_prompt - slack <= prompt <= load["prompt_total"] + slack


def test_server_info_has_the_last_generating_windows_rate(live, load):
    """SGLang's /get_server_info: last_gen_throughput is the gen rate of the last stats line that
    generated (later idle windows leave it); no MTP here, so no accept length."""
    deadline = time.monotonic() + 10
    while not (lines := _stats_lines(live.log())) or lines[-1]["running"] != "0":
        assert time.monotonic() < deadline, lines
        time.sleep(0.2)
    last_gen = [float(line["gen"]) for line in lines if float(line["gen"]) > 0][-1]
    info = httpx.get(f"{live.url}/get_server_info", timeout=10).json()
    [state] = info["internal_states"]
    assert abs(state["last_gen_throughput"] - last_gen) <= 0.05 + 1e-9
    assert state["avg_spec_accept_length"] is None and info["speculative_algorithm"] is None
    models = httpx.get(f"{live.url}/v1/models", timeout=10).json()["data"]
    assert info["model_path"] == info["served_model_name"] == MODEL
    assert info["context_length"] == models[0]["max_model_len"] and info["tp_size"] == 1
    assert not any("key" in name for name in info)  # nothing secret
    newer = httpx.get(f"{live.url}/server_info", timeout=10).json()
    assert newer.keys() == info.keys() and newer["model_path"] == MODEL


def test_access_log_one_line_per_request_and_no_prompt_text(live, load):
    log = live.log()
    assert SECRET not in log
    for request_id in ("load-1", "load-2", "load-3", "load-4"):
        # the request id, then the completion id the client got (issue 17, item 5)
        lines = [line for line in log.splitlines() if f" id={request_id} completion=" in line]
        assert len(lines) == 1, (request_id, lines)
        assert "appliance.access: POST /v1/chat/completions 200 " in lines[0]
        assert re.search(r" completion=chatcmpl-[0-9a-f]+( aborted=client_gone)?$", lines[0])
    posts = [line for line in log.splitlines() if "appliance.access: POST " in line]
    assert len(posts) == 4
    assert sum(line.endswith(" aborted=client_gone") for line in posts) == 1  # the abandoned one
    # successful probes (/health polls, /metrics scrapes) stay at DEBUG: not in an INFO log
    assert "appliance.access: GET /health 200" not in log
    assert "appliance.access: GET /metrics" not in log
    assert "appliance.access: GET /debug/status 200" in log
