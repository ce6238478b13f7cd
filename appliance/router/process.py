"""The router process: an EngineCore (router/engine.py) between sockets. Takes tokenized requests,
aborts and stop-string finishes in; broadcasts each StepPlan to every worker and reads rank 0's
StepResults in order, planning and sending the next step while the workers run the current one;
token updates go to the detokenizer, RouterStats, RouterStatus, PrefixCacheReset (the answer to
a ResetPrefixCache) and ProfileAnswer (to a ProfileRequest, whose action rides in the next plan)
straight to the server. With a visual server, requests arrive through it
(image requests carry `mm` handles); when such a request ends, the router tells the visual server
(ReleaseImages) to unpin them.

Spawned by appliance/launch.py (`run_router`); tests and the overhead benchmark drive `RouterLoop`
in-process with their own sockets.
"""

from __future__ import annotations

import dataclasses
import time

import zmq

from appliance.config import EngineConfig
from appliance.ipc import Addresses, RoleLink, child_init, zmq_socket
from appliance.logging import get_logger
from appliance.messages import (
    AbortRequest,
    FinishRequest,
    PrefixCacheReset,
    ProfileRequest,
    RejectRequest,
    ReleaseImages,
    ResetPrefixCache,
    RouterStatus,
    StatusQuery,
    StepPlan,
    StepResult,
    TokenizedRequest,
    ToRouter,
    WorkerInfo,
    decoder,
    encode,
)
from appliance.router.engine import EngineCore
from appliance.router.scheduler import Scheduler

logger = get_logger(__name__)

STATS_INTERVAL_S = 0.5  # RouterStats to the server at most this often while busy


class RouterLoop:
    """One router: an EngineCore plus its sockets. `run()` never returns."""

    def __init__(
        self,
        scheduler: Scheduler,
        eos_token_ids: list[int],
        inbox: zmq.Socket,
        results: zmq.Socket,
        to_workers: list[zmq.Socket],
        to_detok: zmq.Socket,
        to_server: zmq.Socket,
        to_visual: zmq.Socket | None = None,
    ) -> None:
        self.engine = EngineCore(scheduler, eos_token_ids, self)
        self.inbox, self.results = inbox, results
        self.to_workers, self.to_detok = to_workers, to_detok
        self.to_server, self.to_visual = to_server, to_visual
        self._inbox_decoder = decoder(ToRouter)
        self._result_decoder = decoder(StepResult)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(results, zmq.POLLIN)
        self._last_stats = 0.0
        self._was_busy = False

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        busy = self.engine.has_work()
        self._read_inbox(timeout_ms=0 if busy else 100)
        if not self.engine.step() and self.engine.has_work():
            self._read_inbox(timeout_ms=1)  # nothing runnable yet: wait briefly for news
        self._flush()

    def submit(self, plan: StepPlan) -> None:
        """The engine's executor: the plan to every worker rank."""
        wire = encode(plan)
        for sock in self.to_workers:
            sock.send(wire, copy=False)

    def collect(self) -> StepResult:
        """Rank 0's next result; requests and aborts that arrive meanwhile are handled."""
        while True:
            for sock, _ in self._poller.poll():
                if sock is self.results:
                    return self._result_decoder.decode(self.results.recv(copy=False))
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
            self.engine.add(msg)
        elif isinstance(msg, AbortRequest):
            self.engine.abort(msg.req_id)
        elif isinstance(msg, FinishRequest):
            self.engine.finish(msg.req_id, msg.reason)
        elif isinstance(msg, RejectRequest):
            self.engine.reject(msg.req_id, msg.message, msg.status)
        elif isinstance(msg, StatusQuery):
            status = RouterStatus(msg.query_id, self.engine.stats(), self.engine.progress())
            self.to_server.send(encode(status))
        elif isinstance(msg, ResetPrefixCache):
            self._reset_prefix_cache(msg.query_id)
        elif isinstance(msg, ProfileRequest):
            self.engine.profile(msg.query_id, msg.action)

    def _reset_prefix_cache(self, query_id: int) -> None:
        """Safe here: the inbox is read between plans (before planning, or while waiting for a
        result), never inside the scheduler's `schedule` / `update`. The new gauges reach the
        server before the answer, so /metrics agrees with it once the route has answered."""
        cleared = self.engine.scheduler.reset_prefix_cache()
        counts = dataclasses.asdict(cleared) if cleared is not None else {}
        self.to_server.send(encode(self.engine.stats()))
        self.to_server.send(encode(PrefixCacheReset(query_id, cleared is not None, **counts)))

    # ------------------------------------------------------------------ outbound
    def _flush(self) -> None:
        ended = self.engine.take_ended_images()
        if ended and self.to_visual is not None:
            self.to_visual.send(encode(ReleaseImages(ended)))
        out = self.engine.take_output()
        if out is not None:
            self.to_detok.send(encode(out), copy=False)
        for answer in self.engine.take_profile_answers():
            self.to_server.send(encode(answer))
        now = time.monotonic()
        busy = self.engine.has_work()
        if (busy and now - self._last_stats >= STATS_INTERVAL_S) or (self._was_busy and not busy):
            self.to_server.send(encode(self.engine.stats()))
            self._last_stats = now
        self._was_busy = busy


def run_router(
    config: EngineConfig, addrs: Addresses, worker: WorkerInfo, with_visual: bool = False
) -> None:
    child_init("router")
    link = RoleLink(addrs.launcher, "router")
    scheduler = Scheduler(
        config.scheduler,
        worker.num_kv_slots,
        worker.max_model_len,
        num_snapshot_slots=worker.num_snapshot_slots,
        linear_state=worker.linear_state,
        mtp_verify_max_bs=worker.mtp_verify_max_bs,
        mtp_verify_costs=worker.mtp_verify_costs,
    )
    ctx = zmq.Context.instance()
    loop = RouterLoop(
        scheduler,
        worker.eos_token_ids,
        inbox=zmq_socket(ctx, zmq.PULL, addrs.router, bind=True),
        results=zmq_socket(ctx, zmq.PULL, addrs.router_results, bind=True),
        to_workers=[zmq_socket(ctx, zmq.PUSH, a, bind=False) for a in addrs.workers],
        to_detok=zmq_socket(ctx, zmq.PUSH, addrs.detokenizer, bind=False),
        to_server=zmq_socket(ctx, zmq.PUSH, addrs.server, bind=False),
        to_visual=zmq_socket(ctx, zmq.PUSH, addrs.visual, bind=False) if with_visual else None,
    )
    link.ready()
    loop.run()
