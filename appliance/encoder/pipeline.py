"""The visual server's request bookkeeping, independent of sockets and threads: which requests wait
for which images, the encode-job queue, and the messages that leave when they are ready.

`VisualPipeline` (the server's main thread) takes requests with images: images already cached are
pinned at once, the others become encode jobs (one per content key, however many requests want
it); a request goes on to the router, with `ImageInput` handles in place of its image files, once
all of its images are cached and pinned. The jobs run through `visual.pipeline.encode_jobs` on the
encoder thread. Called by appliance/encoder/process.py and by tests.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from appliance.messages import ImageData, ImageInput, RejectRequest, TokenizedRequest, VisualStats
from visual.cache import EmbeddingCache
from visual.pipeline import EncodedImage, FailedImage, ImageJob


@dataclass
class _Pending:
    msg: TokenizedRequest
    waiting: set[str] = field(default_factory=set)  # keys not cached yet


class VisualPipeline:
    """Pending requests, encode jobs and the cache index; `send` hands a message to the router."""

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
                self._queued[image.key] = ImageJob(
                    image.key, image.data, image.grid_thw, image.min_pixels, image.max_pixels
                )
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
        return ImageInput(image.offset, num_tokens, image.grid_thw, entry.handle, image.key)

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
