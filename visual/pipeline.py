"""The visual server's bookkeeping and its batch encoder, independent of sockets and threads.

`VisualPipeline` (the server's main thread) takes requests with images: images already cached are
pinned at once, the others become encode jobs (one per content key, however many requests want
it); a request goes on to the router, with `ImageInput` handles in place of its image files, once
all of its images are cached and pinned. `encode_jobs` (the encoder thread) decodes, preprocesses
and encodes a batch of jobs and writes each image's embeddings into its shared-memory segment.
Called by visual/server.py and by tests.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from appliance.logging import get_logger
from appliance.messages import ImageData, ImageInput, RejectRequest, TokenizedRequest, VisualStats
from visual.cache import EmbeddingCache, segment_name
from visual.image_io import ImageError, ImageLimits, decode_image
from visual.preprocess import preprocess_image

logger = get_logger(__name__)


@dataclass(frozen=True)
class ImageJob:
    key: str
    data: bytes
    grid_thw: tuple[int, int, int]


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


@dataclass
class _Pending:
    msg: TokenizedRequest
    waiting: set[str] = field(default_factory=set)  # keys not cached yet


class VisualPipeline:
    """Pending requests, encode jobs and the cache index; `send` delivers a message to the
    router."""

    def __init__(
        self, cache: EmbeddingCache, merge_size: int, send: Callable[[msgspec.Struct], None]
    ) -> None:
        self.cache = cache
        self.merge_size = merge_size
        self.send = send
        self._pending: dict[str, _Pending] = {}  # req_id -> request waiting for encodes
        self._queued: collections.OrderedDict[str, ImageJob] = collections.OrderedDict()
        self._in_flight: set[str] = set()  # keys the encoder is working on
        self.cache_queries = 0
        self.cache_hits = 0
        self._preprocess_s: list[float] = []
        self._encode_s: list[float] = []
        self.dirty = False  # stats changed since the last stats()

    # ------------------------------------------------------------------ requests
    def on_request(self, msg: TokenizedRequest) -> None:
        """A request with images from the server: pin what is cached, queue what is not."""
        pending = _Pending(msg)
        for image in msg.images:
            self.cache_queries += 1
            if image.key in self.cache:
                self.cache_hits += 1
                self.cache.pin(image.key, msg.req_id)
                continue
            if image.key in self._queued or image.key in self._in_flight:
                self.cache_hits += 1  # another request's encode will serve this one too
            elif image.key not in pending.waiting:
                self._queued[image.key] = ImageJob(image.key, image.data, image.grid_thw)
            pending.waiting.add(image.key)
        self.dirty = True
        if pending.waiting:
            self._pending[msg.req_id] = pending
        else:
            self._forward(msg)

    def on_abort(self, req_id: str) -> bool:
        """True when the request was still here (it is dropped and never reaches the router)."""
        if self._pending.pop(req_id, None) is None:
            return False
        self.cache.release(req_id)
        self.dirty = True
        return True

    def on_release(self, req_ids: Sequence[str]) -> None:
        """The router is done with these requests: unpin their entries."""
        for req_id in req_ids:
            self.cache.release(req_id)
        self.dirty = True

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ encoding
    def next_batch(self, max_images: int) -> list[ImageJob]:
        """Up to `max_images` queued jobs, oldest first, now counted as in flight."""
        batch = []
        while self._queued and len(batch) < max_images:
            key, job = self._queued.popitem(last=False)
            if not any(key in p.waiting for p in self._pending.values()):
                continue  # every request that wanted it was aborted
            self._in_flight.add(key)
            batch.append(job)
        return batch

    def on_encoded(self, results: Sequence[EncodedImage | FailedImage]) -> None:
        """Results of a batch: cache (pinned for every waiting request) or fail the requests."""
        for result in results:
            self._in_flight.discard(result.key)
            waiters = [p for p in self._pending.values() if result.key in p.waiting]
            if isinstance(result, FailedImage):
                for pending in waiters:
                    self._reject(pending, result)
                continue
            self._preprocess_s.append(result.preprocess_s)
            self._encode_s.append(result.encode_s)
            owners = [
                p.msg.req_id for p in waiters for image in p.msg.images if image.key == result.key
            ]
            self.cache.add(result.key, result.handle, result.nbytes, owners)
            for pending in waiters:
                pending.waiting.discard(result.key)
                if not pending.waiting:
                    del self._pending[pending.msg.req_id]
                    self._forward(pending.msg)
        self.dirty = True

    # ------------------------------------------------------------------ outbound
    def _forward(self, msg: TokenizedRequest) -> None:
        mm = [self._image_input(image) for image in sorted(msg.images, key=lambda i: i.offset)]
        self.send(msgspec.structs.replace(msg, images=[], mm=mm))

    def _image_input(self, image: ImageData) -> ImageInput:
        t, h, w = image.grid_thw
        entry = self.cache.get(image.key)
        assert entry is not None and entry.pins, f"forwarding unpinned image {image.key}"
        num_tokens = t * h * w // self.merge_size**2
        return ImageInput(image.offset, num_tokens, image.grid_thw, entry.handle)

    def _reject(self, pending: _Pending, failure: FailedImage) -> None:
        req_id = pending.msg.req_id
        del self._pending[req_id]
        self.cache.release(req_id)
        message = f"messages: image rejected: {failure.reason}"
        self.send(RejectRequest(req_id, message, failure.status))

    def stats(self) -> VisualStats:
        """Cache gauges, cumulative counters and the timings observed since the last call."""
        preprocess, self._preprocess_s = self._preprocess_s, []
        encode, self._encode_s = self._encode_s, []
        self.dirty = False
        return VisualStats(
            len(self.cache),
            self.cache.num_pinned,
            self.cache.bytes,
            self.cache_queries,
            self.cache_hits,
            preprocess,
            encode,
        )


# ------------------------------------------------------------------------------ the encoder side


def encode_jobs(
    encoder, store, jobs: Sequence[ImageJob], limits: ImageLimits
) -> list[EncodedImage | FailedImage]:
    """Decode + preprocess each job, encode the good ones in one ViT forward, write each image's
    [1 + deepstack, tokens, hidden] embeddings into shared memory (`store.put`). Runs on the
    encoder thread; `encoder` is a VisionEncoder, `store` a SharedMemoryImageStore."""
    results: list[EncodedImage | FailedImage] = []
    rows, grids, ready, prep_s = [], [], [], []
    for job in jobs:
        start = time.perf_counter()
        try:
            processed = preprocess_image(decode_image(job.data, limits), encoder.preprocess)
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
