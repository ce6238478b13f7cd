"""visual.image_io http(s) fetching against a real HTTP server on 127.0.0.1 started by the test.

Loopback is only reachable through FetchOptions.allowed_networks; without it every fetch is refused.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from visual.image_io import (
    FetchOptions,
    ImageError,
    ImageLimits,
    _is_forbidden,
    fetch_image_bytes,
    load_image,
)

IMAGE = Image.fromarray(np.arange(8 * 6 * 3, dtype=np.uint8).reshape(6, 8, 3))
_buffer = io.BytesIO()
IMAGE.save(_buffer, format="PNG")
PNG = _buffer.getvalue()
_buffer = io.BytesIO()
IMAGE.save(_buffer, format="TIFF")
TIFF = _buffer.getvalue()
LOOPBACK = FetchOptions(allowed_networks=("127.0.0.1/32",), timeout_s=5.0)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str, length: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        port = self.server.server_address[1]
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, "image/png")
        elif path.startswith("/hops/"):
            left = int(path.rsplit("/", 1)[1])
            self._redirect("/img.png" if left == 0 else f"/hops/{left - 1}")
        elif path == "/to-other-loopback":
            self._redirect(f"http://127.0.0.2:{port}/img.png")
        elif path == "/to-ftp":
            self._redirect("ftp://127.0.0.1/img.png")
        elif path == "/img.x-png":  # an old or unusual image type: the bytes decide
            self._send(200, PNG, "image/x-png")
        elif path == "/img.tiff":
            self._send(200, TIFF, "image/tiff")
        elif path == "/page.html":
            self._send(200, b"<html></html>", "text/html; charset=utf-8")
        elif path == "/big":
            self._send(200, b"\0" * 5000, "image/png")
        elif path == "/big-stream":  # no Content-Length: the body ends when the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"\0" * 1000)
                self.wfile.flush()
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, PNG, "image/png")
        else:
            self._send(404, b"not found", "text/plain")


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up early (timeouts, byte limits) break the pipe on purpose


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetch(url: str, options: FetchOptions = LOOPBACK, limits: ImageLimits | None = None) -> bytes:
    return asyncio.run(fetch_image_bytes(url, options, limits))


def test_loopback_is_refused_without_allow_list(server):
    with pytest.raises(ImageError, match="non-public address"):
        fetch(f"{server}/img.png", FetchOptions())


def test_fetch_with_allow_list(server):
    assert fetch(f"{server}/img.png") == PNG


def test_load_image_decodes_fetched_image(server):
    image = asyncio.run(load_image(f"{server}/img.png", fetch=LOOPBACK))
    assert np.array_equal(np.asarray(image), np.asarray(IMAGE))


def test_redirects_are_followed_and_bounded(server):
    assert fetch(f"{server}/hops/2") == PNG  # 3 redirects == the default maximum
    with pytest.raises(ImageError, match="redirected more than 3 times"):
        fetch(f"{server}/hops/3")
    with pytest.raises(ImageError, match="redirected more than 0 times"):
        fetch(f"{server}/hops/0", FetchOptions(allowed_networks=("127.0.0.1/32",), max_redirects=0))


def test_each_redirect_target_is_checked(server):
    # 127.0.0.2 is loopback too, but outside the allow-list: refused before any connection
    with pytest.raises(ImageError, match=r"non-public address \(127\.0\.0\.2\)"):
        fetch(f"{server}/to-other-loopback")
    with pytest.raises(ImageError, match="unsupported image URL scheme ftp"):
        fetch(f"{server}/to-ftp")


def test_content_type_is_checked(server):
    with pytest.raises(ImageError, match="content type text/html"):
        fetch(f"{server}/page.html")


def test_any_image_content_type_is_fetched_and_the_bytes_decide(server):
    """vLLM reads no declared type: image/x-png holding a PNG is a PNG; an image/tiff is fetched
    and then refused by the decoder naming the formats it reads (not an opaque type refusal)."""
    assert fetch(f"{server}/img.x-png") == PNG
    assert fetch(f"{server}/img.tiff") == TIFF
    with pytest.raises(ImageError, match=r"not a supported image \(PNG, JPEG, WebP, GIF or BMP\)"):
        asyncio.run(load_image(f"{server}/img.tiff", fetch=LOOPBACK))


def test_byte_limit_declared_and_streamed(server):
    limits = ImageLimits(max_bytes=3000)
    with pytest.raises(ImageError, match="5000 bytes; the limit is 3000"):
        fetch(f"{server}/big", limits=limits)
    with pytest.raises(ImageError, match="larger than the limit of 3000"):
        fetch(f"{server}/big-stream", limits=limits)
    assert len(fetch(f"{server}/big-stream")) == 10000


def test_timeout(server):
    options = FetchOptions(allowed_networks=("127.0.0.1/32",), timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(ImageError, match="longer than 0.3 s"):
        fetch(f"{server}/slow", options)
    assert time.monotonic() - started < 1.2


def test_http_error_status(server):
    with pytest.raises(ImageError, match="HTTP 404"):
        fetch(f"{server}/missing")


@pytest.mark.parametrize(
    "url,reason",
    [
        ("ftp://example.com/a.png", "scheme ftp"),
        ("file:///etc/passwd", "scheme file"),
        ("http://10.1.2.3/a.png", "non-public"),
        ("http://192.168.0.1/a.png", "non-public"),
        ("http://169.254.169.254/latest/meta-data", "non-public"),
        ("http://[::1]/a.png", "non-public"),
        ("http://[::ffff:127.0.0.1]/a.png", "non-public"),
        ("http://0.0.0.0/a.png", "non-public"),
        ("http://user:secret@127.0.0.1/a.png", "credentials"),
    ],
)
def test_refused_urls_never_connect(url, reason):
    with pytest.raises(ImageError, match=reason):
        fetch(url, FetchOptions(timeout_s=2.0))


def test_address_classification():
    forbidden = [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.1.1",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:10.0.0.1",
        "2002:0a00:0001::1",
        "64:ff9b::7f00:1",
    ]
    allowed = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
    for text in forbidden:
        assert _is_forbidden(ipaddress.ip_address(text)), text
    for text in allowed:
        assert not _is_forbidden(ipaddress.ip_address(text)), text


def test_fetch_options_validate():
    with pytest.raises(ValueError, match="allowed_networks"):
        FetchOptions(allowed_networks=("not-a-network",))
