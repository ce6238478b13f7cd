"""The visual server's socket loop on real ZMQ sockets (inproc, no subprocess): text-only requests,
aborts and status queries reach the router byte for byte; a request with images reaches it once
encoded, with `mm` handles; VisualStats go to the server's inbox, never to the router."""

from __future__ import annotations

import hashlib
import io
import time

import pytest
import zmq

from appliance.encoder import process
from appliance.encoder.pipeline import VisualPipeline
from appliance.ipc import zmq_socket
from appliance.messages import (
    AbortRequest,
    ImageData,
    RejectRequest,
    ReleaseImages,
    ResetPrefixCache,
    SamplingOptions,
    StatusQuery,
    TokenizedRequest,
    VisualStats,
    decoder,
    encode,
)
from tests.visual.conftest import random_image
from visual.cache import EmbeddingCache
from visual.encoder import VisionEncoder
from visual.image_io import ImageLimits
from visual.preprocess import image_grid
from visual.shm import UntrackedSegmentStore

ANY_TO_ROUTER = decoder(TokenizedRequest | AbortRequest | StatusQuery | RejectRequest | VisualStats)
STATS = decoder(VisualStats)


@pytest.fixture(scope="module")
def encoder(qwen3_vl_dir):
    return VisionEncoder.from_pretrained(qwen3_vl_dir)


@pytest.fixture
def loop(encoder):
    """(VisualServer, client PUSH to its inbox, router PULL, server PULL), one zmq context."""
    ctx = zmq.Context()
    store = UntrackedSegmentStore()
    cache = EmbeddingCache(store, 1 << 30)
    inbox = zmq_socket(ctx, zmq.PULL, "inproc://visual", bind=True)
    router = zmq_socket(ctx, zmq.PULL, "inproc://router", bind=True)
    server = zmq_socket(ctx, zmq.PULL, "inproc://server", bind=True)
    wake = zmq_socket(ctx, zmq.PULL, process._WAKE, bind=True)
    to_router = zmq_socket(ctx, zmq.PUSH, "inproc://router", bind=False)
    to_server = zmq_socket(ctx, zmq.PUSH, "inproc://server", bind=False)
    client = zmq_socket(ctx, zmq.PUSH, "inproc://visual", bind=False)
    thread = process.EncoderThread(encoder, store, ImageLimits(), ctx)
    pipeline = VisualPipeline(
        cache, encoder.config.spatial_merge_size, lambda msg: to_router.send(encode(msg))
    )
    visual = process.VisualServer(pipeline, thread, 8, inbox, wake, to_router, to_server)
    thread.start()
    yield visual, client, router, server
    cache.clear()
    ctx.destroy(linger=0)  # the encoder thread idles in its queue; its socket closes here too


def _drain(sock: zmq.Socket) -> list[bytes]:
    frames = []
    while sock.poll(0):
        frames.append(sock.recv())
    return frames


def _image_request(req_id: str, encoder: VisionEncoder) -> TokenizedRequest:
    buf = io.BytesIO()
    random_image(64, 48, 5).save(buf, "PNG")
    data = buf.getvalue()
    grid = image_grid(48, 64, encoder.preprocess)
    image = ImageData(hashlib.blake2b(data, digest_size=16).hexdigest(), data, 2, grid)
    return TokenizedRequest(req_id, [1] * 100, SamplingOptions(), 4, images=[image])


def test_relay_encode_and_stats_to_the_server(loop, encoder):
    visual, client, router, server = loop
    text = encode(TokenizedRequest("text", [1, 2, 3], SamplingOptions(), 4))
    query, abort = encode(StatusQuery(7)), encode(AbortRequest("elsewhere"))
    reset = encode(ResetPrefixCache(8))
    for frame in (text, encode(_image_request("img", encoder)), query, reset, abort):
        client.send(frame)
    to_router, to_server = [], []
    deadline = time.monotonic() + 120
    while len(to_router) < 5:  # the image request comes last, once its image is encoded
        assert time.monotonic() < deadline, "the image request never reached the router"
        visual.run_once(timeout_ms=50)
        to_router += _drain(router)
        to_server += _drain(server)
    assert to_router[:4] == [text, query, reset, abort]  # byte for byte, in arrival order
    forwarded = ANY_TO_ROUTER.decode(to_router[4])
    assert isinstance(forwarded, TokenizedRequest) and forwarded.req_id == "img"
    assert len(to_router) == 5 and forwarded.images == [] and len(forwarded.mm) == 1
    assert forwarded.mm[0].offset == 2 and forwarded.mm[0].handle.endswith(
        _image_request("img", encoder).images[0].key
    )
    stats = [STATS.decode(f) for f in to_server]
    assert stats and (stats[-1].cache_entries, stats[-1].cache_pinned) == (1, 1)
    assert stats[-1].cache_queries == 1 and sum(len(s.encode_s) for s in stats) == 1
    # the router's release unpins; the new gauges go to the server again
    client.send(encode(ReleaseImages(["img"])))
    while not (more := _drain(server)):
        assert time.monotonic() < deadline, "no stats after the release"
        visual.run_once(timeout_ms=50)
    assert STATS.decode(more[-1]).cache_pinned == 0 and _drain(router) == []
