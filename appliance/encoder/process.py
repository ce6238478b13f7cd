"""The visual server process: spawned by appliance/launch.py (`run_visual`) for checkpoints with a
vision tower, between the API server and the router.

Startup: load the ViT on the first worker's device, measure the worst-case activation peak
(appliance/encoder/startup.py) and report it in ProcessReady (VisualInfo). Serving, two threads:
- main: every server -> router message arrives here. Text-only requests, aborts, status queries
  and prefix-cache resets are relayed at once, unchanged; requests with images go through
  `VisualPipeline` (cache pins, encode jobs) and are forwarded with `ImageInput` handles when
  their images are cached. The router's ReleaseImages unpin; VisualStats go to the server
  whenever the cache changed.
- encoder: decodes, preprocesses and encodes one batch of jobs at a time (`encode_jobs`), so a long
  ViT forward never holds back a relayed message.
"""

from __future__ import annotations

import os
import queue
import signal
import threading

import zmq

from appliance.config import ServeConfig
from appliance.encoder.pipeline import VisualPipeline
from appliance.encoder.startup import describe_reservation, plan_reservation, vit_placement
from appliance.ipc import Addresses, RoleLink, child_init, zmq_socket
from appliance.logging import get_logger
from appliance.messages import (
    AbortRequest,
    ProfileRequest,
    ReleaseImages,
    ResetPrefixCache,
    StatusQuery,
    TokenizedRequest,
    ToVisual,
    decoder,
    encode,
)
from visual.cache import EmbeddingCache, remove_leftover_segments
from visual.checkpoint import preprocess_config
from visual.image_io import ImageLimits
from visual.pipeline import ImageJob, encode_jobs

logger = get_logger(__name__)

MIB = 2**20
_WAKE = "inproc://visual-encoder-done"


class EncoderThread(threading.Thread):
    """Runs `encode_jobs` on batches from `jobs`; results (or the exception that stopped it) go to
    `results`, and an empty message on the inproc socket wakes the main thread."""

    def __init__(self, encoder, store, limits: ImageLimits, ctx: zmq.Context) -> None:
        super().__init__(name="vit-encoder", daemon=True)
        self.encoder, self.store, self.limits = encoder, store, limits
        self.jobs: queue.Queue[list[ImageJob]] = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self._wake = zmq_socket(ctx, zmq.PUSH, _WAKE, bind=False)

    def run(self) -> None:
        wake = self._wake
        while True:
            batch = self.jobs.get()
            try:
                self.results.put(encode_jobs(self.encoder, self.store, batch, self.limits))
            except BaseException as exc:  # the main thread re-raises it: the process fails fast
                self.results.put(exc)
            wake.send(b"")


class VisualServer:
    """The main thread's socket loop around a VisualPipeline and an EncoderThread."""

    def __init__(
        self,
        pipeline: VisualPipeline,
        encoder_thread: EncoderThread,
        max_batch: int,
        inbox: zmq.Socket,
        wake: zmq.Socket,
        to_router: zmq.Socket,
        to_server: zmq.Socket,
    ) -> None:
        self.pipeline = pipeline
        self.encoder = encoder_thread
        self.max_batch = max_batch
        self.inbox, self.wake = inbox, wake
        self.to_router, self.to_server = to_router, to_server
        self._decoder = decoder(ToVisual)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(wake, zmq.POLLIN)
        self._busy = False  # a batch is on the encoder thread

    def run(self) -> None:
        while True:
            self.run_once(timeout_ms=100)

    def run_once(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if self.inbox in events:
            self._read_inbox()
        if self.wake in events:
            self._collect_results()
        if not self._busy:
            batch = self.pipeline.next_batch(self.max_batch)
            if batch:
                self.encoder.jobs.put(batch)
                self._busy = True
        if self.pipeline.dirty:
            self.to_server.send(encode(self.pipeline.stats()))

    def _read_inbox(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decoder.decode(frame)
            if isinstance(msg, TokenizedRequest) and msg.images:
                self.pipeline.on_request(msg)
            elif isinstance(msg, ReleaseImages):
                self.pipeline.on_release(msg.req_ids)
            elif isinstance(msg, AbortRequest) and self.pipeline.on_abort(msg.req_id):
                logger.debug("aborted %s before its images were encoded", msg.req_id)
            elif isinstance(
                msg, (TokenizedRequest, AbortRequest, StatusQuery, ResetPrefixCache, ProfileRequest)
            ):
                self.to_router.send(frame)  # relayed byte for byte, in arrival order

    def _collect_results(self) -> None:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                results = self.encoder.results.get_nowait()
            except queue.Empty:
                return
            if isinstance(results, BaseException):
                raise RuntimeError("the ViT encoder thread failed") from results
            self._busy = False
            self.pipeline.on_encoded(results)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(0)


def run_visual(config: ServeConfig, model_dir: str, addrs: Addresses) -> None:
    """Entry point of the visual server process (spawned by the launcher)."""
    from visual.encoder import VisionEncoder  # torch: not in the launcher, which imports this
    from visual.shm import UntrackedSegmentStore

    child_init("visual", on_orphan=lambda: remove_leftover_segments(os.getpid()))
    signal.signal(signal.SIGTERM, _raise_exit)  # unlink the cache's segments on the way out
    link = RoleLink(addrs.launcher, "visual")
    visual = config.server.visual
    device, dtype = vit_placement(config.engine)
    link.progress(f"loading the vision tower on {device}")
    load = config.engine.model.load_format != "dummy"
    encoder = VisionEncoder.from_pretrained(model_dir, device, dtype, load_weights=load)
    if encoder.preprocess != preprocess_config(model_dir):
        raise RuntimeError("the encoder's preprocessing settings differ from the API server's")
    link.progress("measuring the worst-case ViT activation memory")
    info = plan_reservation(encoder, visual)
    logger.info("%s", describe_reservation(info))
    store = UntrackedSegmentStore()
    cache = EmbeddingCache(store, visual.visual_cache_mb * MIB)
    ctx = zmq.Context.instance()
    wake = zmq_socket(ctx, zmq.PULL, _WAKE, bind=True)
    to_router = zmq_socket(ctx, zmq.PUSH, addrs.router, bind=False)
    to_server = zmq_socket(ctx, zmq.PUSH, addrs.server, bind=False)  # VisualStats
    inbox = zmq_socket(ctx, zmq.PULL, addrs.visual, bind=True)
    limits = ImageLimits(visual.max_image_bytes, visual.max_image_pixels)
    thread = EncoderThread(encoder, store, limits, ctx)
    pipeline = VisualPipeline(
        cache, encoder.config.spatial_merge_size, lambda msg: to_router.send(encode(msg))
    )
    server = VisualServer(
        pipeline, thread, visual.visual_max_batch_size, inbox, wake, to_router, to_server
    )
    thread.start()
    link.ready(visual=info)
    try:
        server.run()
    finally:
        cache.clear()
