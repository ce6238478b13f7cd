"""Load with aborts (issue 20, item 7): rounds of 64 concurrent streaming clients, a third of them
disconnecting mid-stream and every 16th sending an image; then a full queue (--max-waiting 64)
answers 429 with Retry-After and a request that can never fit answers 400. Afterwards nothing is
held: 0 running, 0 waiting, 0 KV and state slots, 0 pinned image-cache entries, 0 open sequences
in the server and 0 live requests in the detokenizer (/debug/status). Live appliance on the tiny
dense model with its visual server.
Wall time: 70-120 s on a 2-core box shared with other jobs (2 rounds 48-99 s, start-up 22 s).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.live import start_appliance

CLIENTS = 64
ROUNDS = 2
MAX_NUM_SEQS = 16
MAX_WAITING = CLIENTS  # room for every client: preempted requests queue again
MAX_TOKENS = 16
MAX_MODEL_LEN = 4096  # the overflow test's streams must outlive 80 requests' tokenizing
ERRORS: list[str] = []  # why a stream counted as errored


def _image_uri(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _body(client: int, max_tokens: int = MAX_TOKENS) -> dict:
    content: list[dict] = [{"type": "text", "text": f"client {client}: count to ten"}]
    if client % 16 == 0:
        content.append({"type": "image_url", "image_url": {"url": _image_uri(client)}})
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }


async def _client(http: httpx.AsyncClient, client: int, rnd: int) -> str:
    """One streaming request: "completed" (all tokens, then [DONE]), "aborted" (this client
    disconnected after a few chunks) or "errored" (anything else)."""
    leave_after = 1 + (client + rnd) % 4 if client % 3 == 0 else None
    chunks, finish = 0, None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=_body(client)) as resp:
            if resp.status_code != 200:
                ERRORS.append(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                return "errored"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if finish == "length":
                        return "completed"
                    ERRORS.append(f"[DONE] after {chunks} chunks, finish {finish}")
                    return "errored"
                event = json.loads(line[6:])
                if "error" in event:
                    ERRORS.append(line[:300])
                    return "errored"
                if event["choices"]:
                    finish = event["choices"][0].get("finish_reason") or finish
                    chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "aborted"  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        ERRORS.append(repr(exc))
        return "errored"
    ERRORS.append(f"stream ended after {chunks} chunks without [DONE]")
    return "errored"


@pytest.fixture(scope="module")
def app(tiny_dense, tmp_path_factory):
    app = start_appliance(
        tiny_dense,
        tmp_path_factory.mktemp("load") / "appliance.log",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-waiting",
        str(MAX_WAITING),
        max_model_len=MAX_MODEL_LEN,
    )
    yield app
    assert app.stop() == 0, app.log()[-3000:]


def _assert_nothing_held(app) -> dict:
    status = app.wait_idle(timeout_s=15)
    deadline = time.monotonic() + 15
    while (
        status["router"]["mm_cache_pinned"]
        or status["server"]["open_sequences"]
        or status["detokenizer"]["live_requests"]
    ):
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
        status = app.status()
    router = status["router"]
    held = {k: router[k] for k in ("num_running", "num_waiting", "kv_used", "state_used")}
    held["mm_cache_pinned"] = router["mm_cache_pinned"]
    held["open_sequences"] = status["server"]["open_sequences"]
    held["detokenizer_live"] = status["detokenizer"]["live_requests"]
    assert held == dict.fromkeys(held, 0), status
    assert status["requests"] == [], status
    return router


def test_rounds_of_64_streams_with_disconnects_then_nothing_is_held(app):
    limits = httpx.Limits(
        max_connections=MAX_NUM_SEQS + MAX_WAITING + 16, max_keepalive_connections=0
    )

    async def rounds() -> list[dict[str, int]]:
        out = []
        async with httpx.AsyncClient(base_url=app.url, timeout=120, limits=limits) as http:
            for rnd in range(ROUNDS):
                kinds = await asyncio.gather(*(_client(http, c, rnd) for c in range(CLIENTS)))
                out.append({k: kinds.count(k) for k in ("completed", "aborted", "errored")})
        return out

    t0 = time.monotonic()
    per_round = asyncio.run(rounds())
    total = {k: sum(r[k] for r in per_round) for k in ("completed", "aborted", "errored")}
    print(f"{ROUNDS} rounds x {CLIENTS} clients in {time.monotonic() - t0:.1f}s: {total}")
    disconnecting = len([c for c in range(CLIENTS) if c % 3 == 0])
    assert total == {
        "completed": ROUNDS * (CLIENTS - disconnecting),
        "aborted": ROUNDS * disconnecting,
        "errored": 0,
    }, (per_round, ERRORS[:5])
    router = _assert_nothing_held(app)
    assert router["mm_cache_entries"] > 0  # the images went through the visual server


def test_full_queue_gets_429_and_unfittable_request_400_then_nothing_is_held(app):
    """80 long streams fill the 16 running slots and the 64 waiting places; more requests get
    429 with Retry-After until the streams are dropped."""

    async def overflow() -> tuple[list[httpx.Response], httpx.Response]:
        limits = httpx.Limits(
            max_connections=MAX_NUM_SEQS + MAX_WAITING + 16, max_keepalive_connections=0
        )
        async with httpx.AsyncClient(base_url=app.url, timeout=300, limits=limits) as http:
            body = _body(1, max_tokens=MAX_MODEL_LEN - 64)

            def stream() -> asyncio.Task:
                request = http.build_request("POST", "/v1/chat/completions", json=body)
                return asyncio.create_task(http.send(request, stream=True))

            streams = [stream() for _ in range(MAX_NUM_SEQS + MAX_WAITING)]

            async def fill() -> None:
                """Wait until the waiting places are full. A waiting stream has no headers yet;
                keep MAX_WAITING of them in flight: a burst reaches the router before it admits
                the first 16, so some are refused (429) before the running ones leave the
                waiting places, and on a slow box a long stream can finish and let one in."""
                deadline = time.monotonic() + 180  # a loaded 2-core CI box admits them slowly
                while True:
                    router = (await http.get("/debug/status")).json()["router"]
                    if router["num_waiting"] >= MAX_WAITING:
                        return
                    done = [t for t in streams if t.done()]
                    assert not [t.exception() for t in done if t.exception()], done
                    early = [t.result() for t in done if t.result().status_code not in (200, 429)]
                    assert not early, [(r.status_code, (await r.aread())[:200]) for r in early]
                    for _ in range(MAX_WAITING - (len(streams) - len(done))):
                        streams.append(stream())
                    assert time.monotonic() < deadline, (router["num_waiting"], router)
                    await asyncio.sleep(0.1)

            plain = dict(_body(2, max_tokens=4), stream=False)
            refused: list[httpx.Response] = []
            took_a_place = 0
            while len(refused) < 4:
                await fill()
                try:
                    refused.append(await http.post("/v1/chat/completions", json=plain, timeout=60))
                except httpx.ReadTimeout:
                    # on a slow box a long stream can finish between fill() and this post, so
                    # this request took the freed waiting place; dropping it aborts it there
                    took_a_place += 1
                    assert took_a_place <= 4, "the full queue kept admitting requests"
            never = await http.post(
                "/v1/chat/completions", json=dict(plain, max_tokens=MAX_MODEL_LEN)
            )
            for task in streams:  # drop every stream (the waiting ones have no headers yet)
                if task.done():
                    await task.result().aclose()
                else:
                    task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return refused, never

    refused, never = asyncio.run(overflow())
    for resp in refused:
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
    assert never.status_code == 400, never.text
    code = never.json()["error"]["code"]
    print(f"overflow: {len(refused)} x 429 with Retry-After, 1 x 400 ({code})")
    _assert_nothing_held(app)
