"""Request-body limits: bytes (413, from Content-Length or while a chunked body streams in), JSON
nesting and NaN (400); the OpenAPI schema describes the request and error bodies."""

from __future__ import annotations

import asyncio
import json

import pytest

from appliance.server.limits import MAX_JSON_DEPTH, json_depth_exceeds
from tests.appliance.server.conftest import asgi_scope
from tests.appliance.server.test_errors import MSG, assert_error, assert_serving

LIMIT = 4096


def nested(depth: int) -> object:
    """A value with `depth` levels of arrays and objects."""
    value: object = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_a_declared_length_over_the_limit_is_413_before_reading(make_server):
    client, engine, state = make_server(max_request_bytes=LIMIT)
    body = {"messages": [{"role": "user", "content": "x" * LIMIT}]}
    err = assert_error(
        client.post("/v1/chat/completions", json=body), 413, None, "request_too_large"
    )
    assert str(LIMIT) in err["message"]
    assert engine.received == [] and state.client.num_open == 0
    assert_serving(client)


def test_a_chunked_body_is_cut_off_at_the_limit(make_server):
    """No Content-Length: the body is counted as it streams in, and reading stops at the limit
    (driven through the app's ASGI interface to count the chunks it pulled)."""
    client, engine, _ = make_server(max_request_bytes=LIMIT)
    chunks = [b'{"prompt": "'] + [b"a" * 1024] * 100 + [b'"}']
    pulled: list[int] = []
    sent: list[dict] = []

    async def receive():
        pulled.append(len(pulled))
        body = chunks[len(pulled) - 1]
        return {"type": "http.request", "body": body, "more_body": len(pulled) < len(chunks)}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
    scope = asgi_scope("POST", "/v1/completions", headers)
    asyncio.run(client.app(scope, receive, send))
    assert sent[0]["status"] == 413
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "request_too_large"
    assert len(pulled) <= LIMIT // 1024 + 2  # the rest was never read
    assert engine.received == []
    assert_serving(client)


def test_a_body_under_the_limit_passes(make_server):
    client, _, _ = make_server(max_request_bytes=LIMIT)
    r = client.post("/v1/completions", json={"prompt": "x" * (LIMIT - 200), "max_tokens": 1})
    assert r.status_code != 413


def test_json_depth():
    assert not json_depth_exceeds(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert not json_depth_exceeds("scalar", 0)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200, 100_000])
def test_deep_nesting_is_400(make_server, depth):
    client, engine, _ = make_server()
    if depth > 1000:  # past what json.dumps itself can nest
        body = '{"messages": ' + "[" * depth + "]" * depth + "}"
    else:
        body = json.dumps({"messages": MSG, "metadata": nested(depth - 1)})
    r = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(r, 400, None, contains=f"deeper than {MAX_JSON_DEPTH}")
    assert engine.received == []
    assert_serving(client)


def test_nesting_up_to_the_limit_is_served(make_server):
    client, _, _ = make_server()
    body = {"messages": MSG, "max_tokens": 2, "metadata": nested(MAX_JSON_DEPTH - 1)}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(make_server, constant):
    client, engine, _ = make_server()
    body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + constant + "}"
    r = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(r, 400, None, contains="Malformed JSON")
    assert engine.received == []


def test_openapi_describes_request_and_error_bodies(make_server):
    client, _, _ = make_server()
    schema = client.get("/openapi.json").json()
    for path, body_model in [
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ]:
        post = schema["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(body_model)
        for status in ("400", "401", "404", "413", "429"):
            content = post["responses"][status]["content"]["application/json"]
            assert content["schema"]["$ref"].endswith("ErrorResponse"), status
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schema["components"]["schemas"][name]["properties"]
        assert properties["n"]["maximum"] == 16  # this server's --max-n
        assert properties["top_p"]["maximum"] == 1  # SamplingParams' ranges, documented
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
