"""The prefix-cache reset through a live appliance (tiny dense Qwen3.5: KV plus GDN snapshots,
the visual server relaying the reset): a prompt sent twice hits the cache, vLLM's
POST /reset_prefix_cache frees it and the same prompt then misses; SGLang's /flush_cache (GET and
POST) does the same; the routes need the API key; the router logs what it freed. One start, about
30 s on a quiet 2-core box."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from tests.e2e.live import start_appliance

KEY = "sk-reset-e2e"
AUTH = {"Authorization": f"Bearer {KEY}"}
INTERVAL = 16
PROMPT = [random.Random(7).randrange(100, 1900) for _ in range(3 * INTERVAL + 5)]


@pytest.fixture(scope="module")
def app(tiny_dense, tmp_path_factory):
    log = tmp_path_factory.mktemp("reset") / "appliance.log"
    flags = ("--snapshot-slots", "8", "--snapshot-interval", str(INTERVAL))
    live = start_appliance(tiny_dense, log, *flags, env={"APPLIANCE_API_KEY": KEY})
    yield live
    assert live.stop() == 0, live.log()[-4000:]


def cached_tokens(app) -> int:
    """Sends PROMPT; the prompt tokens its answer found in the prefix cache."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{app.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)
    return usage["prompt_tokens_details"]["cached_tokens"]


def reset(app, method: str, path: str) -> dict:
    r = httpx.request(method, f"{app.url}{path}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["prefix_caching"] is True
    assert report["kept_tokens"] == report["kept_snapshots"] == 0  # nothing was running
    return report


def test_a_reset_empties_the_cache_and_the_same_prompt_misses(app):
    admin = ("/reset_prefix_cache", "/start_profile", "/stop_profile")
    for method, path in (*(("POST", p) for p in admin), ("GET", "/flush_cache")):
        r = httpx.request(method, f"{app.url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    cached_tokens(app)
    assert cached_tokens(app) == 3 * INTERVAL  # the periodic snapshot below the prompt's end
    report = reset(app, "POST", "/reset_prefix_cache")
    assert report["freed_tokens"] >= len(PROMPT) and report["freed_snapshots"] > 0
    # the router's new gauges reach the server before its answer (/debug/status would refresh them)
    metrics = httpx.get(f"{app.url}/metrics", timeout=10).text
    assert re.search(r"^appliance_prefix_cache_tokens(\{[^}]*\})? 0\.0$", metrics, re.MULTILINE)
    status = httpx.get(f"{app.url}/debug/status", headers=AUTH, timeout=10).json()["router"]
    assert status["prefix_cache_tokens"] == status["prefix_cache_nodes"] == 0
    assert status["snapshots_used"] == 0
    assert cached_tokens(app) == 0
    for method in ("GET", "POST"):  # SGLang's route, as its clients call it
        assert cached_tokens(app) == 3 * INTERVAL
        assert reset(app, method, "/flush_cache")["freed_tokens"] >= len(PROMPT)
        assert cached_tokens(app) == 0
    assert reset(app, "POST", "/flush_cache")["freed_tokens"] >= len(PROMPT)  # the last miss's
    assert reset(app, "POST", "/reset_prefix_cache")["freed_tokens"] == 0  # empty already
    log = app.log()
    assert log.count("prefix cache reset: freed") == 5
    assert "visual ready" in log  # the resets went through the visual server's relay
