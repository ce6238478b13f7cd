"""The router process loop: wraps the Scheduler. Takes tokenized requests, aborts and stop-string
finishes in; runs schedule -> broadcast StepPlan to every worker -> StepResult from rank 0 ->
update; sends token updates (and periodic RouterStats) to the detokenizer. With a visual server,
requests arrive through it (image requests carry `mm` handles); when such a request ends, the
router tells the visual server (ReleaseImages) to unpin its cached embeddings.

Spawned by appliance/launch.py (`run_router`); `RouterLoop` is socket-agnostic enough for tests and
the overhead benchmark to drive it in-process.
"""

from __future__ import annotations

import collections
import time

import zmq

from appliance.config import EngineConfig
from appliance.ipc import Addresses, RoleLink, child_init, zmq_socket
from appliance.logging import get_logger
from appliance.messages import (
    AbortRequest,
    DetokRegister,
    FinishRequest,
    RejectRequest,
    ReleaseImages,
    RequestProgress,
    RouterOutput,
    RouterStats,
    RouterStatus,
    StatusQuery,
    StepPlan,
    StepResult,
    TokenizedRequest,
    TokenUpdate,
    ToRouter,
    VisualStats,
    WorkerInfo,
    decoder,
    encode,
)
from appliance.router.request import FinishReason, Request, RequestStatus
from appliance.router.scheduler import QueueFull, Scheduler, SchedulerError

logger = get_logger(__name__)

STATS_INTERVAL_S = 0.5  # RouterStats to the server at most this often while busy
TIMING_WINDOW = 256  # steps averaged in step_overhead_ms / step_forward_ms


class RouterLoop:
    """One router: a Scheduler plus its sockets. `run()` never returns."""

    def __init__(
        self,
        scheduler: Scheduler,
        eos_token_ids: list[int],
        inbox: zmq.Socket,
        results: zmq.Socket,
        to_workers: list[zmq.Socket],
        to_detok: zmq.Socket,
        to_visual: zmq.Socket | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.inbox, self.results = inbox, results
        self.to_workers, self.to_detok = to_workers, to_detok
        self._inbox_decoder = decoder(ToRouter)
        self._result_decoder = decoder(StepResult)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(results, zmq.POLLIN)
        self._registers: list[DetokRegister] = []
        self._updates: list[TokenUpdate] = []
        self._status: RouterStatus | None = None
        self._queued: dict[str, float] = {}  # req_id -> arrival (monotonic), until first scheduled
        self._queue_times: list[float] = []
        self._overhead_s: collections.deque[float] = collections.deque(maxlen=TIMING_WINDOW)
        self._forward_s: collections.deque[float] = collections.deque(maxlen=TIMING_WINDOW)
        self._last_stats = 0.0
        self._was_busy = False
        self.to_visual = to_visual
        self._mm_live: set[str] = set()  # live requests whose images the visual server pins
        self._mm_ended: list[str] = []  # ended since the last flush: unpin after the step
        self._visual: VisualStats | None = None  # latest cache report
        self._image_preprocess_s: list[float] = []
        self._image_encode_s: list[float] = []

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        busy = self.scheduler.has_work()
        self._read_inbox(timeout_ms=0 if busy else 100)
        plan = self.scheduler.schedule() if self.scheduler.has_work() else None
        if plan is not None:
            self._execute(plan)
        elif self.scheduler.has_work():
            self._read_inbox(timeout_ms=1)  # nothing runnable yet: wait briefly for news
        self._flush()

    def _execute(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        if plan.new_requests:
            self._note_admissions()
        wire = encode(plan)
        for sock in self.to_workers:
            sock.send(wire, copy=False)
        result = self._wait_result(plan.step_id)
        for out in self.scheduler.update(result):
            reason = out.finish_reason.value if out.finish_reason is not None else None
            if reason is not None:
                self._ended(out.req_id)
            self._updates.append(
                TokenUpdate(out.req_id, out.new_token_ids, reason, out.logprobs, out.top_logprobs)
            )
        self._forward_s.append(result.forward_s)
        self._overhead_s.append(time.perf_counter() - start - result.forward_s)

    def _wait_result(self, step_id: int) -> StepResult:
        """Blocks for rank 0's result, handling requests and aborts that arrive meanwhile."""
        while True:
            for sock, _ in self._poller.poll():
                if sock is self.results:
                    result = self._result_decoder.decode(self.results.recv(copy=False))
                    if result.step_id != step_id:
                        raise SchedulerError(f"expected step {step_id}, got {result.step_id}")
                    return result
                self._read_inbox(timeout_ms=0)

    # ------------------------------------------------------------------ inbound
    def _read_inbox(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._inbox_decoder.decode(frame))

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            if self.scheduler.get_request(msg.req_id) is not None:
                self.scheduler.abort(msg.req_id)
                self._queued.pop(msg.req_id, None)
                self._updates.append(TokenUpdate(msg.req_id, [], "abort"))
                self._ended(msg.req_id)
        elif isinstance(msg, FinishRequest):
            self.scheduler.finish(msg.req_id, FinishReason(msg.reason))
            self._queued.pop(msg.req_id, None)
            self._ended(msg.req_id)
        elif isinstance(msg, RejectRequest):
            self._reject(msg.req_id, msg.message, msg.status)
        elif isinstance(msg, VisualStats):
            self._visual = msg
            self._image_preprocess_s += msg.preprocess_s
            self._image_encode_s += msg.encode_s
        elif isinstance(msg, StatusQuery):
            self._status = RouterStatus(msg.query_id, self.stats(), self._progress())

    def _add(self, msg: TokenizedRequest) -> None:
        req = Request(
            msg.req_id,
            msg.prompt_token_ids,
            msg.sampling,
            msg.max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            mm=list(msg.mm),
        )
        if msg.mm:
            self._mm_live.add(msg.req_id)
        try:
            self.scheduler.add_request(req)
        except QueueFull as exc:
            self._reject(msg.req_id, f"The router queue is full ({exc}). Please retry later.", 429)
            self._ended(msg.req_id)
            return
        except (SchedulerError, ValueError) as exc:
            self._reject(msg.req_id, str(exc), 400)
            self._ended(msg.req_id)
            return
        self._queued[msg.req_id] = req.arrival_time
        self._registers.append(DetokRegister(msg.req_id, len(msg.prompt_token_ids), msg.detok))

    def _reject(self, req_id: str, message: str, status: int) -> None:
        self._updates.append(TokenUpdate(req_id, [], "error", error=message, error_status=status))

    def _ended(self, req_id: str) -> None:
        """A request is gone; if the visual server pinned images for it, unpin them at the next
        flush — after the step in flight (whose plan may admit it, i.e. load its embeddings) is
        done. Preempted requests are not ended: their re-admission reloads the same handles."""
        if req_id in self._mm_live:
            self._mm_live.discard(req_id)
            self._mm_ended.append(req_id)

    def _note_admissions(self) -> None:
        """Queue time of requests scheduled for the first time (FIFO: stop at the first waiter)."""
        now = time.monotonic()
        for req_id in list(self._queued):
            req = self.scheduler.get_request(req_id)
            if req is not None and req.status is RequestStatus.WAITING:
                break
            arrival = self._queued.pop(req_id)
            if req is not None:
                self._queue_times.append(now - arrival)

    # ------------------------------------------------------------------ outbound
    def _flush(self) -> None:
        if self._mm_ended and self.to_visual is not None:
            self.to_visual.send(encode(ReleaseImages(self._mm_ended)))
        self._mm_ended = []
        now = time.monotonic()
        busy = self.scheduler.has_work()
        stats = None
        if (busy and now - self._last_stats >= STATS_INTERVAL_S) or (self._was_busy and not busy):
            stats = self.stats()
            self._last_stats = now
        self._was_busy = busy
        if not (self._registers or self._updates or stats or self._status):
            return
        out = RouterOutput(self._registers, self._updates, stats, self._status)
        self.to_detok.send(encode(out), copy=False)
        self._registers, self._updates, self._status = [], [], None

    def stats(self) -> RouterStats:
        s = self.scheduler.stats()
        queue_times, self._queue_times = self._queue_times, []
        preprocess, self._image_preprocess_s = self._image_preprocess_s, []
        encode_s, self._image_encode_s = self._image_encode_s, []
        visual = self._visual or VisualStats(0, 0, 0)
        n = len(self._overhead_s)
        return RouterStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            state_usage=s.state_used / s.state_total if s.state_total else 0.0,
            kv_used=s.kv_used,
            kv_total=s.kv_total,
            state_used=s.state_used,
            state_total=s.state_total,
            num_preemptions=s.num_preemptions,
            mtp_drafts=s.mtp_drafts,
            mtp_draft_tokens=s.mtp_draft_tokens,
            mtp_accepted_tokens=s.mtp_accepted_tokens,
            mtp_accepted_per_position=list(s.mtp_accepted_per_position),
            queue_time_s=queue_times,
            num_steps=s.num_steps,
            step_overhead_ms=1000.0 * sum(self._overhead_s) / n if n else 0.0,
            step_forward_ms=1000.0 * sum(self._forward_s) / n if n else 0.0,
            mm_cache_entries=visual.cache_entries,
            mm_cache_pinned=visual.cache_pinned,
            mm_cache_bytes=visual.cache_bytes,
            mm_cache_queries=visual.cache_queries,
            mm_cache_hits=visual.cache_hits,
            image_preprocess_s=preprocess,
            image_encode_s=encode_s,
        )

    def _progress(self) -> list[RequestProgress]:
        reqs = [*self.scheduler.running, *self.scheduler.waiting]
        return [
            RequestProgress(
                r.req_id,
                r.status.value,
                r.num_prompt_tokens,
                r.num_output_tokens,
                r.num_computed,
                r.num_kv,
                r.num_preemptions,
            )
            for r in reqs
        ]


def run_router(
    config: EngineConfig, addrs: Addresses, worker: WorkerInfo, with_visual: bool = False
) -> None:
    child_init("router")
    link = RoleLink(addrs.launcher, "router")
    scheduler = Scheduler(config.scheduler, worker.num_kv_slots, worker.max_model_len)
    ctx = zmq.Context.instance()
    loop = RouterLoop(
        scheduler,
        worker.eos_token_ids,
        inbox=zmq_socket(ctx, zmq.PULL, addrs.router, bind=True),
        results=zmq_socket(ctx, zmq.PULL, addrs.router_results, bind=True),
        to_workers=[zmq_socket(ctx, zmq.PUSH, a, bind=False) for a in addrs.workers],
        to_detok=zmq_socket(ctx, zmq.PUSH, addrs.detokenizer, bind=False),
        to_visual=zmq_socket(ctx, zmq.PUSH, addrs.visual, bind=False) if with_visual else None,
    )
    link.ready()
    loop.run()
