"""The visual server's request bookkeeping (no sockets): requests with images are held until their
images are encoded, an identical image is encoded once across requests, cached images are pinned
while their requests live, aborts and bad images are handled, and the embeddings in shared memory
are the tiny ViT's output for the image."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from appliance.encoder.pipeline import VisualPipeline
from appliance.messages import (
    ImageData,
    RejectRequest,
    SamplingOptions,
    TokenizedRequest,
    VisualStats,
)
from appliance.server.images import image_key
from tests.visual.conftest import random_image
from visual.cache import EmbeddingCache
from visual.encoder import VisionEncoder
from visual.image_io import ImageLimits, decode_image
from visual.pipeline import FailedImage, ImageJob, encode_jobs
from visual.preprocess import image_grid, pixel_range, preprocess_images
from visual.shm import SharedMemoryImageStore, UntrackedSegmentStore

LIMITS = ImageLimits()


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, "PNG")
    return buf.getvalue()


def _image(data: bytes, offset: int, encoder: VisionEncoder) -> ImageData:
    image = decode_image(data)
    grid = image_grid(image.height, image.width, encoder.preprocess)
    return ImageData(hashlib.blake2b(data, digest_size=16).hexdigest(), data, offset, grid)


def _request(req_id: str, images: list[ImageData]) -> TokenizedRequest:
    return TokenizedRequest(req_id, [1] * 200, SamplingOptions(), 4, images=images)


@pytest.fixture(scope="module")
def encoder(qwen3_vl_dir):
    return VisionEncoder.from_pretrained(qwen3_vl_dir)


@pytest.fixture
def setup(encoder):
    store = UntrackedSegmentStore()
    cache = EmbeddingCache(store, capacity_bytes=1 << 30)
    sent: list = []
    pipeline = VisualPipeline(cache, encoder.config.spatial_merge_size, sent.append)
    yield pipeline, store, cache, sent
    cache.clear()


def _run_encoder(pipeline, encoder, store, max_images: int = 8) -> int:
    """Drains the job queue through encode_jobs, one batch at a time; returns batches run."""
    batches = 0
    while batch := pipeline.next_batch(max_images):
        pipeline.on_encoded(encode_jobs(encoder, store, batch, LIMITS))
        batches += 1
    return batches


def test_identical_image_is_encoded_once_and_pinned_per_request(setup, encoder):
    pipeline, store, cache, sent = setup
    a, b = _png(64, 48, 1), _png(40, 90, 2)
    pipeline.on_request(_request("r1", [_image(a, 3, encoder), _image(b, 20, encoder)]))
    pipeline.on_request(_request("r2", [_image(a, 5, encoder)]))  # same file, other request
    assert sent == [] and pipeline.num_pending == 2
    batch = pipeline.next_batch(8)
    assert len(batch) == 2  # a once, b once
    pipeline.on_encoded(encode_jobs(encoder, store, batch, LIMITS))
    r1, r2 = sorted(sent, key=lambda m: m.req_id)  # r2 is ready first: it needs only `a`
    assert (r1.req_id, r2.req_id) == ("r1", "r2") and r1.images == [] == r2.images
    assert [m.offset for m in r1.mm] == [3, 20] and r2.mm[0].offset == 5
    assert r1.mm[0].handle == r2.mm[0].handle  # one segment serves both
    assert r1.mm[1].grid_thw == _image(b, 0, encoder).grid_thw
    assert [m.num_tokens for m in r1.mm] == [
        t * h * w // 4 for t, h, w in (m.grid_thw for m in r1.mm)
    ]
    # the segment holds the ViT's output for the image: [1 + deepstack, tokens, hidden]. It was
    # encoded in a batch with b, here alone: the matmuls' blocking may differ with the token count,
    # so equal up to float32 rounding (a fresh-clone CI run saw 8e-7), not bit for bit
    pixel_values, grid_thw = preprocess_images([random_image(64, 48, 1)], encoder.preprocess)
    embeds, deepstack = encoder.encode(pixel_values, grid_thw)
    loaded = SharedMemoryImageStore().load(r1.mm[0].handle)
    torch.testing.assert_close(loaded, torch.stack([embeds, *deepstack]), rtol=1e-4, atol=1e-5)
    assert cache.get(_image(a, 0, encoder).key).pins == 2
    stats = pipeline.stats()
    assert isinstance(stats, VisualStats)
    assert (stats.cache_entries, stats.cache_pinned, stats.cache_queries, stats.cache_hits) == (
        2,
        2,
        3,
        1,
    )
    assert len(stats.preprocess_s) == 2 and len(stats.encode_s) == 2
    assert pipeline.stats().encode_s == []  # observations are reported once
    # a later request for a cached image is forwarded at once, pinned
    pipeline.on_request(_request("r3", [_image(b, 7, encoder)]))
    assert sent[-1].req_id == "r3" and sent[-1].mm[0].handle == r1.mm[1].handle
    pipeline.on_release(["r1", "r2", "r3"])
    stats = pipeline.stats()
    assert stats.cache_pinned == 0 and stats.cache_entries == 2 and stats.cache_hits == 2


def test_batches_are_capped_and_pins_hold_until_release(setup, encoder):
    pipeline, store, cache, sent = setup
    cache.capacity_bytes = 1  # evict anything unpinned
    images = [_image(_png(32 + 8 * i, 32, i), 0, encoder) for i in range(3)]
    for i, image in enumerate(images):
        pipeline.on_request(_request(f"r{i}", [image]))
    assert _run_encoder(pipeline, encoder, store, max_images=2) == 2
    assert [m.req_id for m in sent] == ["r0", "r1", "r2"]
    assert len(cache) == 3 and cache.num_pinned == 3  # over capacity, all live
    pipeline.on_release(["r1"])
    assert len(cache) == 2 and images[1].key not in cache


def test_abort_before_encoding_drops_request_and_job(setup, encoder):
    pipeline, store, cache, sent = setup
    shared, own = _image(_png(64, 64, 7), 0, encoder), _image(_png(48, 48, 8), 0, encoder)
    pipeline.on_request(_request("keep", [shared]))
    pipeline.on_request(_request("gone", [shared, own]))
    assert pipeline.on_abort("gone") and not pipeline.on_abort("gone")
    assert not pipeline.on_abort("unknown")  # not here: the server relays it to the router
    batch = pipeline.next_batch(8)
    assert [job.key for job in batch] == [shared.key]  # nobody waits for `own` any more
    pipeline.on_encoded(encode_jobs(encoder, store, batch, LIMITS))
    assert [m.req_id for m in sent] == ["keep"] and cache.get(shared.key).pins == 1


def test_abort_after_a_cache_hit_unpins(setup, encoder):
    pipeline, store, cache, sent = setup
    cached, missing = _image(_png(64, 64, 9), 0, encoder), _image(_png(48, 64, 10), 0, encoder)
    pipeline.on_request(_request("first", [cached]))
    _run_encoder(pipeline, encoder, store)
    pipeline.on_request(_request("second", [cached, missing]))
    assert cache.get(cached.key).pins == 2
    pipeline.on_abort("second")
    assert cache.get(cached.key).pins == 1


def test_undecodable_image_rejects_its_requests(setup, encoder):
    pipeline, store, cache, sent = setup
    good = _image(_png(64, 64, 11), 0, encoder)
    truncated = ImageData("deadbeef", _png(64, 64, 12)[:60], 10, (1, 4, 4))
    wrong_grid = ImageData("cafe", good.data, 0, (1, 8, 8))
    pipeline.on_request(_request("bad", [good, truncated]))
    pipeline.on_request(_request("mismatch", [wrong_grid]))
    results = encode_jobs(encoder, store, pipeline.next_batch(8), LIMITS)
    failed = {r.key: r for r in results if isinstance(r, FailedImage)}
    assert failed["deadbeef"].status == 400 and "could not" in failed["deadbeef"].reason
    assert failed["cafe"].status == 500 and "grid" in failed["cafe"].reason
    pipeline.on_encoded(results)
    rejects = {m.req_id: m for m in sent if isinstance(m, RejectRequest)}
    assert set(rejects) == {"bad", "mismatch"} and rejects["bad"].status == 400
    assert rejects["bad"].message.startswith("messages: image rejected:")
    assert pipeline.num_pending == 0
    assert good.key in cache and cache.get(good.key).pins == 0  # released with its request


def test_one_file_at_two_pixel_ranges_is_two_encodes_each_at_its_grid(setup, encoder):
    """The same bytes at the checkpoint's range and at a request's smaller one (mm_processor_kwargs)
    are two cache entries, each encoded at its own grid (the grid cross-check passes for both), and
    each request gets its own; a range the reservation does not cover is the server disagreeing
    with itself (500), not a crash."""
    pipeline, store, cache, sent = setup
    data = _png(128, 128, 30)
    default = _image(data, 4, encoder)
    ranged_config = pixel_range(encoder.preprocess, 0, 64 * 64, LIMITS.max_pixels)
    grid = image_grid(128, 128, ranged_config)
    assert (default.grid_thw, grid) == ((1, 8, 8), (1, 4, 4))
    ranged = ImageData(image_key(data, grid), data, 4, grid, 32 * 32, 64 * 64)
    pipeline.on_request(_request("big", [default]))
    pipeline.on_request(_request("small", [ranged]))
    assert _run_encoder(pipeline, encoder, store) == 1
    assert len(cache) == 2  # two encodes, not one deduplicated job
    by_id = {m.req_id: m for m in sent}
    assert [(m.grid_thw, m.num_tokens) for m in by_id["big"].mm] == [((1, 8, 8), 16)]
    assert [(m.grid_thw, m.num_tokens) for m in by_id["small"].mm] == [((1, 4, 4), 4)]
    assert by_id["big"].mm[0].handle != by_id["small"].mm[0].handle
    assert by_id["big"].mm[0].content_key != by_id["small"].mm[0].content_key  # prefix cache
    for msg, config in ((by_id["big"], encoder.preprocess), (by_id["small"], ranged_config)):
        pixel_values, grid_thw = preprocess_images([random_image(128, 128, 30)], config)
        embeds, deepstack = encoder.encode(pixel_values, grid_thw)
        loaded = SharedMemoryImageStore().load(msg.mm[0].handle)
        torch.testing.assert_close(loaded, torch.stack([embeds, *deepstack]), rtol=1e-4, atol=1e-5)
    # the same file and range again: a cache hit on the ranged entry
    pipeline.on_request(_request("again", [ranged]))
    assert sent[-1].req_id == "again" and sent[-1].mm[0].handle == by_id["small"].mm[0].handle
    job = ImageJob("toobig", data, (1, 8, 8), 0, 256 * 256)
    (failed,) = encode_jobs(encoder, store, [job], LIMITS)
    assert isinstance(failed, FailedImage) and failed.status == 500
    assert "pixel range: max_pixels: 65536 is above 16384" in failed.reason
