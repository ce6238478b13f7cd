"""The prefix-cache reset routes (vLLM's POST /reset_prefix_cache, SGLang's GET|POST /flush_cache)
against the scripted engine: the router's report as the body, 503 before the engine is ready, the
API key, the HTTP metric's route label."""

from __future__ import annotations

REPORT = {
    "prefix_caching": True,
    "freed_tokens": 40,
    "freed_snapshots": 3,
    "kept_tokens": 8,
    "kept_snapshots": 1,
}
ROUTES = [("POST", "/reset_prefix_cache"), ("GET", "/flush_cache"), ("POST", "/flush_cache")]


def test_each_route_asks_the_router_and_answers_its_report(make_server):
    client, engine, state = make_server()
    for count, (method, path) in enumerate(ROUTES, 1):
        r = client.request(method, path)
        assert r.status_code == 200 and r.json() == REPORT, (path, r.text)
        assert engine.resets == count
    assert client.get("/reset_prefix_cache").status_code == 405  # vLLM's is POST only
    engine.reset_counts = (0, 0, 0, 0)
    assert client.post("/flush_cache").json()["freed_tokens"] == 0
    metrics = state.metrics.render()[0].decode()
    assert 'route="/reset_prefix_cache",status="200"' in metrics
    assert 'route="/flush_cache",status="200"' in metrics


def test_not_ready_is_503_and_the_router_is_not_asked(make_server):
    client, engine, _ = make_server(ready=False)
    for method, path in ROUTES:
        r = client.request(method, path)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert engine.resets == 0


def test_the_routes_need_the_api_key(make_server):
    client, engine, _ = make_server(api_key="sk-reset")
    for method, path in ROUTES:
        assert client.request(method, path).status_code == 401
        wrong = client.request(method, path, headers={"Authorization": "Bearer sk-other"})
        assert wrong.status_code == 401
    assert engine.resets == 0
    keyed = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer sk-reset"})
    assert keyed.status_code == 200 and keyed.json() == REPORT and engine.resets == 1
