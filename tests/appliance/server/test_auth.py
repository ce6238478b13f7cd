"""API keys (Bearer / x-api-key, several keys, env fallback), the open probes, CORS, and what
/v1/models shows of the model's folder."""

from __future__ import annotations

import pytest

from appliance import __version__
from appliance.server import auth
from tests.appliance.server.test_errors import MSG, assert_error

KEYS = "sk-first, sk-second"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_the_probes_needs_a_key(make_server):
    client, engine, _ = make_server(api_key=KEYS)
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/debug/status"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/flush_cache"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/nothing"),  # no probing for routes without a key
    ]:
        r = client.request(method, path, json={"messages": MSG, "prompt": "hi"})
        err = assert_error(r, 401, None, "invalid_api_key", "didn't provide an API key")
        assert err["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert engine.received == []
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    # HEAD (uptime checkers) answers as GET does, without a body; /version behind the key
    assert client.head("/health").status_code == 200
    assert client.head("/metrics").status_code == 200
    assert client.head("/v1/models").status_code == 401
    assert client.get("/version").status_code == 401
    keyed = bearer("sk-first")
    r = client.head("/v1/models", headers=keyed)
    assert r.status_code == 200 and r.content == b""
    assert client.get("/version", headers=keyed).json() == {"version": __version__}


@pytest.mark.parametrize(
    "headers",
    [
        bearer("sk-first"),
        bearer("sk-second"),
        {"Authorization": "bearer sk-second"},
        {"x-api-key": "sk-first"},
    ],
)
def test_each_key_is_accepted_in_either_header(make_server, headers):
    client, _, _ = make_server(api_key=KEYS)
    assert client.get("/v1/models", headers=headers).status_code == 200
    assert client.get("/debug/status", headers=headers).status_code == 200
    r = client.post(
        "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=headers
    )
    assert r.status_code == 200, r.text
    assert client.get("/v1/nothing", headers=headers).status_code == 404


@pytest.mark.parametrize(
    "headers",
    [
        bearer("sk-firs"),
        bearer("sk-first, sk-second"),
        {"Authorization": "Basic sk-first"},
        {"Authorization": "sk-first"},
        {"x-api-key": "wrong"},
    ],
)
def test_wrong_keys_are_401(make_server, headers):
    client, engine, _ = make_server(api_key=KEYS)
    r = client.post("/v1/chat/completions", json={"messages": MSG}, headers=headers)
    assert_error(r, 401, None, "invalid_api_key")
    assert engine.received == []


def test_metrics_behind_the_key_on_request(make_server):
    client, _, _ = make_server(api_key="sk-1", metrics_require_key=True)
    assert_error(client.get("/metrics"), 401, None, "invalid_api_key")
    assert client.get("/metrics", headers=bearer("sk-1")).status_code == 200
    assert client.get("/health").status_code == 200


def test_env_keys_apply_unless_the_flag_is_given(make_server, monkeypatch):
    monkeypatch.setenv("APPLIANCE_API_KEY", "sk-env1,sk-env2")
    client, _, _ = make_server()
    assert_error(client.get("/v1/models"), 401)
    assert client.get("/v1/models", headers=bearer("sk-env2")).status_code == 200
    client, _, _ = make_server(api_key="sk-flag")
    assert_error(client.get("/v1/models", headers=bearer("sk-env1")), 401)
    assert client.get("/v1/models", headers=bearer("sk-flag")).status_code == 200


def test_no_key_means_open(make_server, monkeypatch):
    monkeypatch.delenv("APPLIANCE_API_KEY", raising=False)
    client, _, _ = make_server()
    assert client.get("/v1/models").status_code == 200
    assert client.get("/debug/status").status_code == 200


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []

    def counting(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = (b"k1", b"k2", b"k3")
    assert auth.key_matches(b"k1", keys)
    assert len(calls) == 3  # no early exit after the first match
    assert not auth.key_matches(b"k4", keys)


def test_models_never_shows_the_folder_path(make_server):
    client, _, _ = make_server()
    r = client.get("/v1/models")
    assert "/models/tiny" not in r.text
    (card,) = r.json()["data"]
    assert card["id"] == "tiny" and card["root"] == "tiny"


def test_cors_off_by_default(make_server):
    client, _, _ = make_server()
    r = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = client.options(
        "/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_cors_for_the_allowed_origins(make_server):
    client, _, _ = make_server(api_key="sk-1", allowed_origins="https://ui.example")
    preflight = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        # the OpenAI JS SDK's own headers too
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    r = client.options("/v1/chat/completions", headers=preflight)  # preflights carry no key
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = client.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert r.status_code == 401  # the browser still needs the key, and can read the refusal
    assert r.headers["access-control-allow-origin"] == "https://ui.example"
    r = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://x.example"})
    assert "access-control-allow-origin" not in r.headers
