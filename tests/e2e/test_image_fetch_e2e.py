"""Image requests before they reach the engine, on a live appliance (tiny Qwen3-VL): fetching an
image counts against --request-timeout (408, not the fetch's own 10 s), a client that leaves while
its image is still being fetched is let go at once, and a photo's EXIF orientation is applied (the
model sees the picture upright, as with an upright copy)."""

from __future__ import annotations

import base64
import io
import re
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from tests.e2e.live import start_appliance
from tests.e2e.test_vision_e2e import NO_THINK, data_uri, random_image

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def hanging_url():
    """An http URL on 127.0.0.1 whose server accepts and then never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/photo.png"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    listener.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ckpt = build_tiny_qwen3_vl(tmp_path_factory.mktemp("vl") / "vl_fetch", tokenizer="bpe", seed=7)
    app = start_appliance(
        ckpt,
        tmp_path_factory.mktemp("vl_fetch_live") / "appliance.log",
        "--request-timeout",
        str(TIMEOUT_S),
        "--image-fetch-allowed-networks",
        "127.0.0.1/32",
    )
    yield app
    assert app.stop() == 0, app.log()[-4000:]


def _body(url: str, stream: bool = False) -> dict:
    content = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": stream,
        **NO_THINK,
    }


def _frontend(app) -> float:
    text = httpx.get(f"{app.url}/metrics", timeout=10).text
    return float(re.search(r"^appliance_num_requests_frontend\{[^}]*\} (\S+)", text, re.M)[1])


def test_an_image_that_never_arrives_counts_against_the_request_timeout(app, hanging_url):
    start = time.monotonic()
    r = httpx.post(f"{app.url}/v1/chat/completions", json=_body(hanging_url), timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 408, r.text
    error = r.json()["error"]
    assert error["code"] == "request_timeout" and "fetching its images" in error["message"]
    assert TIMEOUT_S - 0.2 < took < TIMEOUT_S + 2.5, took  # not the fetch's own 10 s
    assert _frontend(app) == 0


def test_a_client_that_leaves_during_the_fetch_is_let_go(app, hanging_url):
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(f"{app.url}/v1/chat/completions", json=_body(hanging_url, stream=True))
    left = time.monotonic()
    while _frontend(app) != 0 and time.monotonic() - left < TIMEOUT_S - 1.5:
        time.sleep(0.05)
    assert _frontend(app) == 0, "the request still waits for its image after its client left"
    assert re.search(r"POST /v1/chat/completions 499 ", app.log())


def test_a_photo_is_seen_upright_as_its_exif_orientation_says(app):
    upright = random_image(40, 72, seed=11)  # portrait
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # as a sensor held sideways stores it
    exif = Image.Exif()
    exif[0x0112] = 6  # "turn 90 degrees clockwise to view"
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif.tobytes())
    tagged = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    answers = []
    for url in (tagged, data_uri(upright), data_uri(stored)):
        r = httpx.post(f"{app.url}/v1/chat/completions", json=_body(url), timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        answers.append((out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]))
    assert answers[0] == answers[1]  # the tagged photo is the upright picture
    assert answers[0] != answers[2]  # and not the stored pixels
