"""The server's link to the engine: submits tokenized requests to the router, routes text deltas
from the detokenizer back to the waiting HTTP handler, folds the router's and the visual server's
reports into the metrics, and fails everything when the engine dies.

Used by the handler skeleton in serving.py; created by process.py (real sockets) or by tests
(sockets to an in-test scripted engine).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from appliance.logging import get_logger
from appliance.messages import (
    AbortRequest,
    DetokOutput,
    PrefixCacheReset,
    ProfileAction,
    ProfileAnswer,
    ProfileRequest,
    ResetPrefixCache,
    RouterStats,
    RouterStatus,
    StatusQuery,
    TextDelta,
    TokenizedRequest,
    ToServer,
    VisualStats,
    decoder,
    encode,
)
from appliance.metrics import MetricsRecorder
from appliance.server.errors import (
    APIError,
    BadRequest,
    EngineFailed,
    ServiceUnavailable,
    TooManyRequests,
)

logger = get_logger(__name__)


@dataclass
class _Prompt:
    """One prompt of a request, shared by its n choices: its tokens are counted once (as usage
    counts them), by the first choice that computes it."""

    counted: bool = False


@dataclass
class _Choice:
    """Bookkeeping of one sub-request (one choice) for metrics and aborts."""

    index: int
    prompt_tokens: int
    arrival: float
    prompt: _Prompt = field(default_factory=_Prompt)
    last_delivery: float = 0.0
    first_token_s: float | None = None
    num_tokens: int = 0
    finished: bool = False


@dataclass
class RequestGroup:
    """The choices of one HTTP request; deltas arrive on one queue as (choice index, TextDelta)."""

    group_id: str
    choices: dict[str, _Choice] = field(default_factory=dict)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    error: APIError | None = None
    deadline: float | None = None  # time.monotonic() past which the request is aborted (408)
    timeout_s: float = 0.0  # the limit that set `deadline` (for the error message)
    # why its unfinished choices were aborted (None: none were): "client_gone", "deadline",
    # "drain_timeout", "error"; read by the access log
    abort_reason: str | None = None
    # choices that ended "stop" whose metrics label the answer decides (a chat answer that made
    # tool calls ends "tool_calls"): index -> (req_id, choice), until `label_finish` or release
    pending_stops: dict[int, tuple[str, _Choice]] | None = None

    @property
    def open_ids(self) -> list[str]:
        return [rid for rid, c in self.choices.items() if not c.finished]


def finish_label(delta: TextDelta) -> str:
    """The metrics' finish reason of a final delta: a refusal with a client-error status (the
    router's 400 / 429: too long, queue full) is "rejected", not a server-side "error"."""
    if delta.finish_reason == "error" and 400 <= delta.error_status < 500:
        return "rejected"
    return delta.finish_reason or "error"


class EngineClient:
    """Owns the PUSH socket to the router and the PULL socket from the detokenizer."""

    def __init__(
        self,
        router_addr: str,
        inbox_addr: str,
        max_open: int,
        metrics: MetricsRecorder | None = None,
    ) -> None:
        self._router_addr = router_addr
        self._inbox_addr = inbox_addr
        self.max_open = max_open  # running + waiting sequences before 429
        self.metrics = metrics
        self._groups: dict[str, RequestGroup] = {}  # req_id -> group
        self._waiters: dict[int, asyncio.Future] = {}  # query id -> the router's answer
        self._query_ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self.failure: str | None = None  # set when the engine died; every request fails with it
        self.visual_stats: VisualStats | None = None  # the visual server's latest report
        self.detok_live = 0  # requests the detokenizer holds state for (its latest report)

    async def start(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        self._to_router = ctx.socket(zmq.PUSH)
        self._to_router.setsockopt(zmq.LINGER, 0)
        self._to_router.setsockopt(zmq.SNDHWM, 0)
        self._to_router.connect(self._router_addr)
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(self._inbox_addr)
        self._task = asyncio.create_task(self._dispatch(), name="engine-dispatch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # its failure was handled when it happened
                pass
        self._to_router.close()
        self._inbox.close()

    @property
    def num_open(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        group_id: str,
        requests: list[TokenizedRequest],
        arrival: float,
        label_stops: bool = False,
        choices_per_prompt: int = 1,
    ) -> RequestGroup:
        """label_stops: the caller names the metrics finish reason of each choice that ends "stop"
        (label_finish), as the formatted answer says it; release records any it did not name.
        `requests` are prompt by prompt, `choices_per_prompt` (n) each."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        if len(requests) > self.max_open:  # never fits, however long the client waits: no 429
            raise BadRequest(
                f"The request asks for {len(requests)} sequences at once (n x prompts); this "
                f"server holds at most {self.max_open} (--max-num-seqs + --max-waiting). Send "
                "fewer prompts or a smaller n."
            )
        if self.num_open + len(requests) > self.max_open:
            raise TooManyRequests(
                f"The server is at capacity ({self.num_open} sequences open, limit "
                f"{self.max_open}). Please retry later."
            )
        # Encode every choice before any is counted open: a request that cannot be put on the wire
        # is refused with nothing registered (nothing to leak).
        try:
            wires = [encode(req) for req in requests]
        except (OverflowError, TypeError, ValueError) as exc:
            raise BadRequest(f"The request has a value the engine cannot carry: {exc}.") from None
        group = RequestGroup(group_id, pending_stops={} if label_stops else None)
        prompts = [_Prompt() for _ in range(-(-len(requests) // choices_per_prompt))]
        for index, req in enumerate(requests):
            prompt = prompts[index // choices_per_prompt]
            group.choices[req.req_id] = _Choice(index, len(req.prompt_token_ids), arrival, prompt)
            self._groups[req.req_id] = group
        sent: list[str] = []
        try:
            for req, wire in zip(requests, wires):
                self._push(wire)
                sent.append(req.req_id)
        except BaseException as exc:  # the choices already sent are dropped in the router again
            self._release(group, sent)
            if isinstance(exc, zmq.ZMQError):
                raise EngineFailed(f"The server could not reach the router: {exc}.") from None
            raise
        return group

    def label_finish(self, group: RequestGroup, index: int, reason: str) -> None:
        """The metrics finish reason of a choice that ended "stop" in a label_stops group."""
        pending = group.pending_stops.pop(index, None) if group.pending_stops else None
        if pending is not None:
            self._record_finish(pending[0], pending[1], reason)

    def abort(self, group: RequestGroup, reason: str) -> None:
        """Frees the group's unfinished choices in the router at once (the client went away, the
        deadline passed, ...); the first reason given is the group's `abort_reason`. Every way out
        of a request calls it: stops not labelled by then count as "stop"."""
        for index in list(group.pending_stops or ()):
            self.label_finish(group, index, "stop")
        if not group.open_ids:
            return
        group.abort_reason = group.abort_reason or reason
        self._release(group, group.open_ids)

    def _release(self, group: RequestGroup, in_router: list[str]) -> None:
        """Forgets the group's unfinished choices and asks the router to drop `in_router` (best
        effort: a broken link is the engine's failure, reported on its own)."""
        for req_id in group.open_ids:
            group.choices[req_id].finished = True
            self._groups.pop(req_id, None)
            self._record_finish(req_id, group.choices[req_id], "abort")
        if self.failure is not None:
            return
        for req_id in in_router:
            try:
                self._send(AbortRequest(req_id))
            except zmq.ZMQError as exc:
                logger.warning("could not send the abort of %s: %s", req_id, exc)

    def _push(self, wire: bytes) -> None:
        # Sends only queue the message (unbounded HWM), so the sync-style call never blocks.
        self._to_router.send(wire, copy=False)

    def _send(self, msg) -> None:
        self._push(encode(msg))

    async def status(self, timeout_s: float = 5.0) -> RouterStatus:
        return await self._ask(StatusQuery, "the status query", timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = 10.0) -> PrefixCacheReset:
        """Empties the router's prefix cache (what live requests hold stays); its report."""
        return await self._ask(ResetPrefixCache, "the prefix-cache reset", timeout_s)

    async def profile(self, action: ProfileAction, timeout_s: float) -> ProfileAnswer:
        """Starts or stops the workers' profiler; the router's answer once rank 0 applied it."""
        query = functools.partial(ProfileRequest, action=action)
        return await self._ask(query, "the profiler switch", timeout_s)

    async def _ask(
        self, query: Callable[[int], Any], what: str, timeout_s: float
    ) -> RouterStatus | PrefixCacheReset | ProfileAnswer:
        """Sends `query(query_id)` to the router and waits for the answer carrying that id."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._waiters[query_id] = future
        self._send(query(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"The router did not answer {what}.") from None
        finally:
            self._waiters.pop(query_id, None)

    def engine_failed(self, message: str) -> int:
        """A role died: every open request fails with `message`, and so will every new one."""
        self.failure = message
        return self._fail_groups(EngineFailed(message), abort_reason=None)

    def abort_all(self, message: str) -> int:
        """Drain timeout: abort every open request in the router and fail it with a 503."""
        return self._fail_groups(ServiceUnavailable(message), abort_reason="drain_timeout")

    def _fail_groups(self, err: APIError, abort_reason: str | None) -> int:
        """Fails every open group with `err`; with an abort_reason their choices are also
        aborted in the router (which is still alive)."""
        send_abort = abort_reason is not None
        groups = {id(g): g for g in self._groups.values()}.values()
        count = len(self._groups)
        for group in groups:
            group.error = err
            group.abort_reason = group.abort_reason or abort_reason
            for req_id in group.open_ids:
                if send_abort:
                    self._send(AbortRequest(req_id))
                group.choices[req_id].finished = True
                self._record_finish(req_id, group.choices[req_id], "error")
            group.queue.put_nowait(None)
        self._groups.clear()
        return count

    # ------------------------------------------------------------------ inbound
    async def _dispatch(self) -> None:
        try:
            await self._dispatch_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would leave every request hanging: fail them all
            logger.exception("engine dispatch failed")
            self.engine_failed(f"The server's engine link failed: {type(exc).__name__}: {exc}")
            raise

    @property
    def dispatch_task(self) -> asyncio.Task | None:
        return self._task

    async def _dispatch_loop(self) -> None:
        dec = decoder(ToServer)
        while True:
            msg = dec.decode(await self._inbox.recv(copy=False))
            if isinstance(msg, DetokOutput):
                self.detok_live = msg.num_live
                now = time.monotonic()
                for delta in msg.deltas:
                    self._deliver(delta, now)
            elif isinstance(msg, RouterStats):
                if self.metrics is not None:
                    self.metrics.apply_router_stats(msg)
            elif isinstance(msg, RouterStatus):
                # A status snapshot drained the router's new queue-time samples too: keep them.
                if self.metrics is not None:
                    self.metrics.apply_router_stats(msg.stats)
                self._answer(msg.query_id, msg)
            elif isinstance(msg, (PrefixCacheReset, ProfileAnswer)):
                self._answer(msg.query_id, msg)
            elif isinstance(msg, VisualStats):
                self.visual_stats = msg
                if self.metrics is not None:
                    self.metrics.apply_visual_stats(msg)

    def _answer(
        self, query_id: int, answer: RouterStatus | PrefixCacheReset | ProfileAnswer
    ) -> None:
        waiter = self._waiters.get(query_id)
        if waiter is not None and not waiter.done():  # (none: it timed out already)
            waiter.set_result(answer)

    def _deliver(self, delta: TextDelta, now: float) -> None:
        group = self._groups.get(delta.req_id)
        if group is None:
            return  # aborted by us; late deltas are dropped
        choice = group.choices[delta.req_id]
        self._record_tokens(delta.req_id, choice, delta, now)
        if delta.finish_reason is not None:
            choice.finished = True
            del self._groups[delta.req_id]
            label = finish_label(delta)
            if label == "stop" and group.pending_stops is not None:
                group.pending_stops[choice.index] = (delta.req_id, choice)
            else:
                self._record_finish(delta.req_id, choice, label)
        group.queue.put_nowait((choice.index, delta))

    # ------------------------------------------------------------------ metrics
    def _record_tokens(self, req_id: str, choice: _Choice, delta: TextDelta, now: float) -> None:
        n = len(delta.token_ids)
        if n == 0:
            return
        if choice.first_token_s is None:
            choice.first_token_s = now - choice.arrival
            counted, choice.prompt.counted = choice.prompt.counted, True
            if self.metrics is not None:
                prompt = 0 if counted else choice.prompt_tokens  # once for its n choices
                self.metrics.on_first_token(req_id, choice.first_token_s, prompt, n)
        elif self.metrics is not None:
            self.metrics.on_tokens(req_id, n, now - choice.last_delivery)
        choice.last_delivery = now
        choice.num_tokens += n

    def _record_finish(self, req_id: str, choice: _Choice, reason: str) -> None:
        # a choice that finished without a token still computed its prompt (max_tokens 0)
        counted = choice.prompt.counted
        if reason in ("stop", "length"):
            choice.prompt.counted = True
        if self.metrics is not None:
            self.metrics.on_request_finished(
                req_id,
                reason,
                time.monotonic() - choice.arrival,
                choice.prompt_tokens,
                choice.num_tokens,
                ttft_s=choice.first_token_s,
                prompt_counted=counted,
            )
