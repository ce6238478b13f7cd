"""Fuzzing the live appliance from its own OpenAPI schema (hypothesis): bodies that fit the schema
and bodies that break it, with and without the API key. Every answer is a 2xx or a 4xx in the
OpenAI error shape, never a 5xx or a hang; afterwards the router's pools are empty and the server
still serves. Bounded: about 40 s of requests on a 2-core CPU box (FUZZ_EXAMPLES per case)."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.live import start_appliance
from tests.e2e.schema_strategies import SchemaStrategies

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ_EXAMPLES = 40  # per (route, fitting | breaking): 4 cases
SERVER_TIMEOUT_S = 5  # --request-timeout: a long generation is cut short (408)
REQUEST_TIMEOUT_S = 20  # past this a request counts as hung
SCHEMA_CODES = {"invalid_type", "invalid_value", "missing_required_parameter"}  # validation's
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
POST_ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture(scope="module")
def live(tiny_dense, tmp_path_factory):
    app = start_appliance(
        tiny_dense,
        tmp_path_factory.mktemp("fuzz") / "appliance.log",
        "--max-num-seqs",
        "8",
        "--max-n",
        "4",
        "--request-timeout",
        str(SERVER_TIMEOUT_S),
        max_model_len=64,  # bounds every generation: a fuzzed max_tokens cannot run long
        env={"APPLIANCE_API_KEY": KEY},
    )
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def openapi(http) -> dict:
    r = http.get("/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def body_schema(openapi: dict, path: str) -> dict:
    return openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def check_answer(r: httpx.Response, sent: object) -> None:
    """2xx, or a 4xx whose body is {"error": {"message", "type", "param", "code"}}."""
    assert r.status_code < 500, (r.status_code, r.text[:500], sent)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (r.text, sent)
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        assert err["code"] is None or isinstance(err["code"], str), r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", (r.text[-300:], sent)
        for event in events[:-1]:
            assert "server_error" not in event, (event, sent)
    else:
        assert r.json()["choices"], (r.text, sent)


def send(http: httpx.Client, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json", **headers})


HEADERS = st.sampled_from([AUTH] * 8 + [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY}])


@pytest.mark.parametrize("path", POST_ROUTES)
def test_bodies_that_fit_the_schema(http, openapi, path):
    strategies = SchemaStrategies(openapi)
    statuses: list[int] = []

    @FUZZ_SETTINGS
    @given(body=strategies.fitting(body_schema(openapi, path)), headers=HEADERS)
    def fuzz(body, headers):
        r = send(http, path, body, headers)
        check_answer(r, body)
        if headers != AUTH and "x-api-key" not in headers:
            assert r.status_code == 401, r.text
        elif r.status_code >= 400:
            # The schema describes the real bodies: what fits it passes the server's own schema
            # validation and is refused, if at all, by a handler's check (a value's meaning).
            assert r.json()["error"]["code"] not in SCHEMA_CODES, (r.text, body)
        statuses.append(r.status_code)

    fuzz()
    assert 200 in statuses, sorted(statuses)
    print(f"{path}: {len(statuses)} fitting bodies, statuses {sorted(Counter(statuses).items())}")


@pytest.mark.parametrize("path", POST_ROUTES)
def test_bodies_that_break_the_schema(http, openapi, path):
    strategies = SchemaStrategies(openapi)

    statuses: list[int] = []

    @FUZZ_SETTINGS
    @given(body=strategies.breaking(body_schema(openapi, path)))
    def fuzz(body):
        r = send(http, path, body, AUTH)
        check_answer(r, body)
        statuses.append(r.status_code)

    fuzz()
    print(f"{path}: {len(statuses)} breaking bodies, statuses {sorted(Counter(statuses).items())}")


def test_afterwards_the_pools_are_empty_and_the_server_serves(http, live):
    # Runs after the fuzz tests (file order): every fuzzed request has ended or was aborted.
    deadline = time.monotonic() + 15
    while True:
        status = http.get("/debug/status", headers=AUTH).json()
        router = status["router"]
        idle = {k: router[k] for k in ("kv_used", "state_used", "num_running", "num_waiting")}
        if not any(idle.values()) and status["server"]["open_sequences"] == 0:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    assert router["mm_cache_pinned"] == 0
    assert http.get("/health").status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = http.post("/v1/completions", json={"prompt": "", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text
    for path in ("/v1/models", "/debug/status", "/openapi.json"):
        assert http.get(path).status_code == 401
        assert http.get(path, headers=AUTH).status_code == 200
    assert http.get("/metrics").status_code == 200
