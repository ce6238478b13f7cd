"""The visual server's batch encode path, independent of sockets, threads and messages.

`encode_jobs` decodes, preprocesses and encodes a batch of `ImageJob`s in one ViT forward and
writes each image's embeddings into its shared-memory segment; each job comes back as an
`EncodedImage` (its segment handle) or a `FailedImage` (the reason). Each job is resized to its own
pixel range (a request's mm_processor_kwargs), checked again against the ViT reservation. Called by
the visual server's encoder thread (appliance/encoder/process.py), ops/gpu/check_vision.py, tests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from visual.cache import segment_name
from visual.image_io import ImageError, ImageLimits, decode_image
from visual.preprocess import pixel_range, preprocess_image


@dataclass(frozen=True)
class ImageJob:
    """One image to encode: its cache key, the encoded file, the grid the API server expects from
    resizing it to the request's pixel range (0: the checkpoint's bound)."""

    key: str
    data: bytes
    grid_thw: tuple[int, int, int]
    min_pixels: int = 0
    max_pixels: int = 0


@dataclass(frozen=True)
class EncodedImage:
    """A job whose embeddings are in shared memory under `handle`."""

    key: str
    handle: str
    nbytes: int
    preprocess_s: float
    encode_s: float


@dataclass(frozen=True)
class FailedImage:
    key: str
    reason: str
    status: int  # 400: the image; 500: the server disagrees with itself (grid mismatch)


def encode_jobs(
    encoder, store, jobs: Sequence[ImageJob], limits: ImageLimits
) -> list[EncodedImage | FailedImage]:
    """Decode + preprocess each job, encode the good ones in one ViT forward, write each image's
    [1 + deepstack, tokens, hidden] embeddings into shared memory (`store.put`). Runs on the
    encoder thread; `encoder` is a VisionEncoder, `store` a visual.shm store (in the server, an
    UntrackedSegmentStore)."""
    results: list[EncodedImage | FailedImage] = []
    rows, grids, ready, prep_s = [], [], [], []
    for job in jobs:
        start = time.perf_counter()
        try:
            config = pixel_range(
                encoder.preprocess, job.min_pixels, job.max_pixels, limits.max_pixels
            )
        except ValueError as exc:  # the API server checked it with the same rule
            results.append(FailedImage(job.key, f"pixel range: {exc}", 500))
            continue
        try:
            processed = preprocess_image(decode_image(job.data, limits), config)
        except ImageError as exc:
            results.append(FailedImage(job.key, exc.reason, 400))
            continue
        if processed.grid_thw != tuple(job.grid_thw):
            reason = f"grid {processed.grid_thw} differs from the server's {tuple(job.grid_thw)}"
            results.append(FailedImage(job.key, reason, 500))
            continue
        rows.append(processed.pixel_values)
        grids.append(processed.grid_thw)
        ready.append(job)
        prep_s.append(time.perf_counter() - start)
    if not ready:
        return results
    start = time.perf_counter()
    embeds, deepstack = encoder.encode(np.concatenate(rows), grids)
    host = [embeds.cpu(), *(d.cpu() for d in deepstack)]  # [tokens, hidden] each
    seconds = time.perf_counter() - start
    counts = [t * h * w // encoder.merge_unit for t, h, w in grids]
    per_image = [part.split(counts) for part in host]  # [1 + D][images] of [n, hidden]
    total = sum(counts)
    for i, job in enumerate(ready):
        main, deep = per_image[0][i], [parts[i] for parts in per_image[1:]]
        handle = store.put(segment_name(job.key), main, deep)
        nbytes = len(host) * main.numel() * main.element_size()
        share = seconds * counts[i] / total
        results.append(EncodedImage(job.key, handle, nbytes, prep_s[i], share))
    return results
