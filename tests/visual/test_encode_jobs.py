"""The batch encode path (`visual.pipeline.encode_jobs`): good images land in shared memory as the
ViT's output, bad files and grid disagreements come back as failures with their HTTP status, and
the batch's ViT time is shared out per image."""

from __future__ import annotations

import io

import pytest
import torch

from tests.visual.conftest import random_image
from visual.cache import segment_name
from visual.encoder import VisionEncoder
from visual.image_io import ImageLimits
from visual.pipeline import EncodedImage, FailedImage, ImageJob, encode_jobs
from visual.preprocess import image_grid, preprocess_images
from visual.shm import SharedMemoryImageStore, UntrackedSegmentStore

LIMITS = ImageLimits()


@pytest.fixture(scope="module")
def encoder(qwen3_vl_dir):
    return VisionEncoder.from_pretrained(qwen3_vl_dir)


@pytest.fixture
def store():
    store, written = UntrackedSegmentStore(), []
    real_put = store.put

    def put(handle, embeds, deepstack=()):
        written.append(handle)
        return real_put(handle, embeds, deepstack)

    store.put = put
    yield store
    for handle in written:
        store.release(handle)


def _job(key: str, width: int, height: int, seed: int, encoder: VisionEncoder) -> ImageJob:
    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, "PNG")
    return ImageJob(key, buf.getvalue(), image_grid(height, width, encoder.preprocess))


def test_a_batch_is_encoded_into_one_segment_per_image(encoder, store):
    jobs = [_job("k1", 64, 48, 1, encoder), _job("k2", 40, 90, 2, encoder)]
    results = encode_jobs(encoder, store, jobs, LIMITS)
    assert [type(r) for r in results] == [EncodedImage, EncodedImage]
    assert [r.key for r in results] == ["k1", "k2"]
    hidden, rows = encoder.config.out_hidden_size, 1 + len(encoder.config.deepstack_visual_indexes)
    for result, job, (width, height, seed) in zip(results, jobs, [(64, 48, 1), (40, 90, 2)]):
        assert result.handle == segment_name(job.key)
        t, h, w = job.grid_thw
        tokens = t * h * w // encoder.merge_unit
        assert result.nbytes == rows * tokens * hidden * 4  # fp32 on CPU
        assert result.preprocess_s > 0 and result.encode_s > 0
        pixel_values, grid_thw = preprocess_images(
            [random_image(width, height, seed)], encoder.preprocess
        )
        embeds, deepstack = encoder.encode(pixel_values, grid_thw)
        loaded = SharedMemoryImageStore().load(result.handle)
        assert loaded.shape == (rows, tokens, hidden)
        torch.testing.assert_close(loaded, torch.stack([embeds, *deepstack]))


def test_bad_files_and_grid_mismatches_fail_without_a_forward(encoder, store, monkeypatch):
    good = _job("good", 64, 64, 3, encoder)
    truncated = ImageJob("truncated", good.data[:60], good.grid_thw)
    wrong_grid = ImageJob("wrong-grid", good.data, (1, 8, 8))
    results = encode_jobs(encoder, store, [truncated, good, wrong_grid], LIMITS)
    failed = {r.key: r for r in results if isinstance(r, FailedImage)}
    assert failed["truncated"].status == 400 and "could not" in failed["truncated"].reason
    assert failed["wrong-grid"].status == 500 and "grid" in failed["wrong-grid"].reason
    assert [r.key for r in results if isinstance(r, EncodedImage)] == ["good"]

    def no_forward(*args, **kwargs):
        raise AssertionError("nothing left to encode")

    monkeypatch.setattr(encoder, "encode", no_forward)
    assert [r.key for r in encode_jobs(encoder, store, [truncated], LIMITS)] == ["truncated"]
