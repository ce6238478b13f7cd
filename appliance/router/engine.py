"""The engine loop: a Scheduler driving an executor (the workers) one step at a time, turning
requests into token updates. Shared by the router process (router/process.py) and the offline `LLM`.

Finish detection by kind, each in one place: eos / stop token ids / max_tokens in the Scheduler,
stop strings in the detokenizer (which answers with `finish()`), rejections here.
"""

from __future__ import annotations

import collections
import time
from typing import Protocol

import msgspec

from appliance.logging import get_logger
from appliance.messages import (
    DetokRegister,
    ProfileAction,
    ProfileAnswer,
    ProfileReport,
    RequestProgress,
    RouterOutput,
    RouterStats,
    StepPlan,
    StepResult,
    TokenizedRequest,
    TokenUpdate,
)
from appliance.router.request import FinishReason, Request, RequestStatus
from appliance.router.scheduler import MAX_PENDING, QueueFull, Scheduler, SchedulerError

logger = get_logger(__name__)

TIMING_WINDOW = 256  # steps averaged in step_overhead_ms / step_forward_ms


class Executor(Protocol):
    """The workers: `submit` sends a plan to every rank, `collect` returns rank 0's result of the
    oldest submitted plan (results come back in order)."""

    def submit(self, plan: StepPlan) -> None: ...

    def collect(self) -> StepResult: ...


AUTO_STOP = -1  # query id of the profiler stop the router sends itself (num_steps): no answer

# Step N+1 is planned and sent while the workers still run step N: as many steps out as the
# scheduler lets a request have sampled tokens pending.
MAX_IN_FLIGHT = MAX_PENDING


class EngineCore:
    """Requests in (`add` / `abort` / `finish`), `step()` runs one plan, `take_output()` hands the
    detokenizer its registrations and token updates."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int], executor: Executor) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.executor = executor
        self._registers: list[DetokRegister] = []
        self._updates: list[TokenUpdate] = []
        self._queued: dict[str, float] = {}  # req_id -> arrival (monotonic), until first scheduled
        self._queue_times: list[float] = []
        self._router_s: collections.deque[float] = collections.deque(maxlen=TIMING_WINDOW)
        self._forward_s: collections.deque[float] = collections.deque(maxlen=TIMING_WINDOW)
        # (step id, planning seconds, ran chunks): empty plans (answered when a grammar compiles)
        # stay out of the step timings
        self._in_flight: collections.deque[tuple[int, float, bool]] = collections.deque()
        self._mm_live: set[str] = set()  # live requests whose images the visual server pins
        self._mm_ended: list[str] = []  # ended since the last take: unpin after the step
        # the workers' profiler: a switch waiting for the next plan (query id, action), the plans
        # in flight that carry one (step id -> query id), whether it runs, the device steps left
        # before the router stops it (num_steps; 0: none), answers to send
        self._profile_next: tuple[int, ProfileAction] | None = None
        self._profile_steps: dict[int, int] = {}
        self.profiling = False
        self._profile_left = 0
        self._profile_answers: list[ProfileAnswer] = []

    # ------------------------------------------------------------------ requests in
    def add(self, msg: TokenizedRequest) -> None:
        """Queues a request; one the scheduler refuses ends at once with an error update."""
        try:
            self.enqueue(msg)
        except QueueFull as exc:
            self.reject(msg.req_id, f"The router queue is full ({exc}). Please retry later.", 429)
        except (SchedulerError, ValueError) as exc:
            self.reject(msg.req_id, str(exc), 400)

    def enqueue(self, msg: TokenizedRequest) -> None:
        """Queues a request; raises QueueFull, or SchedulerError / ValueError for a bad one."""
        sampling = msg.sampling
        if sampling.min_tokens:  # what would end it early: eos (unless ignored), stop ids
            ban = set(msg.stop_token_ids) | (set() if msg.ignore_eos else self.eos_token_ids)
            sampling = msgspec.structs.replace(sampling, min_tokens_ban=sorted(ban))
        req = Request(
            req_id=msg.req_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=sampling,
            max_tokens=msg.max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            mm=list(msg.mm),
            turn_start=msg.turn_start,
            priority=msg.priority,
            report_timing=msg.report_timing,
            cache_salt=msg.cache_salt,
            repetition=msg.repetition,
            report_spec=msg.report_spec,
        )
        if msg.mm:
            self._mm_live.add(msg.req_id)
        self.scheduler.add_request(req)
        self._queued[msg.req_id] = req.arrival_time
        self._registers.append(DetokRegister(msg.req_id, len(msg.prompt_token_ids), msg.detok))

    def reject(self, req_id: str, message: str, status: int) -> None:
        """Ends a request that never ran (refused here, or by the visual server)."""
        self._updates.append(TokenUpdate(req_id, [], "error", error=message, error_status=status))
        self._ended(req_id)

    def abort(self, req_id: str) -> None:
        if self.scheduler.get_request(req_id) is not None:
            self.scheduler.abort(req_id)
            self._queued.pop(req_id, None)
            self._updates.append(TokenUpdate(req_id, [], "abort"))
            self._ended(req_id)

    def finish(self, req_id: str, reason: str = "stop") -> None:
        """The detokenizer matched a stop string: free the request (its text is already final)."""
        self.scheduler.finish(req_id, FinishReason(reason))
        self._queued.pop(req_id, None)
        self._ended(req_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight) or self._profile_next is not None

    def profile(self, query_id: int, action: ProfileAction) -> None:
        """Starts or stops the workers' profiler with the next plan (an empty one when idle);
        answered (`take_profile_answers`) once rank 0 has applied it, or at once when refused."""
        if self._profile_next is not None or self._profile_steps:
            refusal = "a profiler switch is already on its way to the workers; retry"
        elif action.start and self.profiling:
            refusal = "the profiler is already running: stop it first (POST /stop_profile)"
        elif not action.start and not self.profiling:
            refusal = "the profiler is not running"
        else:
            self._profile_next = (query_id, action)
            self.profiling = action.start
            self._profile_left = action.num_steps if action.start else 0
            return
        self._profile_answers.append(ProfileAnswer(query_id, False, refusal))

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Plans and submits one step (the previous one may still be running), then collects the
        oldest step once MAX_IN_FLIGHT are out or nothing new could be planned. A request that
        ended in the collected step may have one more step in flight: the scheduler drops its
        result (no token reaches the client) and its slots were freed already. False when there
        was nothing to do."""
        start = time.perf_counter()
        plan = self.scheduler.schedule() if self.scheduler.has_work() else None
        if self._profile_next is not None:
            query_id, action = self._profile_next
            self._profile_next = None
            plan = msgspec.structs.replace(plan or self.scheduler.empty_plan(), profile=action)
            self._profile_steps[plan.step_id] = query_id
        if plan is not None and plan.chunks and self._profile_left:
            self._profile_left -= 1  # the num_steps-th profiled device step: stop after it
            if not self._profile_left:
                self._profile_next = (AUTO_STOP, ProfileAction(start=False))
        if plan is not None:
            if plan.new_requests:
                self._note_admissions()
            self.executor.submit(plan)
        planned = time.perf_counter() - start
        if plan is not None:
            self._in_flight.append((plan.step_id, planned, bool(plan.chunks)))
        if self._in_flight and (plan is None or len(self._in_flight) >= MAX_IN_FLIGHT):
            self._collect()
            return True
        return plan is not None

    def _collect(self) -> None:
        step_id, planned, timed = self._in_flight.popleft()
        result = self.executor.collect()
        if result.step_id != step_id:
            raise SchedulerError(f"expected the result of step {step_id}, got {result.step_id}")
        start = time.perf_counter()
        for out in self.scheduler.update(result):
            reason = out.finish_reason.value if out.finish_reason is not None else None
            if reason is not None:
                self._ended(out.req_id)
            self._updates.append(
                TokenUpdate(
                    out.req_id,
                    out.new_token_ids,
                    reason,
                    out.logprobs,
                    out.top_logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                    cached_tokens=out.cached_tokens,
                    spec=out.spec,
                    timing=out.timing,
                )
            )
        if timed:
            self._forward_s.append(result.forward_s)
            self._router_s.append(planned + time.perf_counter() - start)
        query_id = self._profile_steps.pop(step_id, None)
        if query_id is not None:
            self._profile_applied(query_id, result.profile)

    def _profile_applied(self, query_id: int, report: ProfileReport | None) -> None:
        """Rank 0's report on the switch a plan carried: the answer to its query."""
        if report is None:  # a runner without a profiler (a test or benchmark stand-in)
            report = ProfileReport(False, "the workers' runner does not profile")
        self.profiling = report.started
        if not self.profiling:
            self._profile_left = 0
        if query_id == AUTO_STOP:
            log = logger.info if report.ok else logger.error
            log("profiler stopped after its num_steps: %s; %s", report.message, report.files)
            return
        answer = ProfileAnswer(query_id, report.ok, report.message, report.files)
        self._profile_answers.append(answer)

    def _ended(self, req_id: str) -> None:
        """A request is gone; if the visual server pinned images for it, they are unpinned after
        the step in flight (whose plan may load their embeddings). Preempted requests are not
        ended: their re-admission reloads the same handles."""
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

    # ------------------------------------------------------------------ out
    def take_output(self) -> RouterOutput | None:
        """Registrations and updates since the last call (None if there are none)."""
        if not (self._registers or self._updates):
            return None
        out = RouterOutput(registers=self._registers, updates=self._updates)
        self._registers, self._updates = [], []
        return out

    def take_profile_answers(self) -> list[ProfileAnswer]:
        answers, self._profile_answers = self._profile_answers, []
        return answers

    def take_ended_images(self) -> list[str]:
        """Requests with pinned images that ended since the last call."""
        ended, self._mm_ended = self._mm_ended, []
        return ended

    def stats(self) -> RouterStats:
        """The scheduler's snapshot plus this loop's queue times (drained) and step timings."""
        queue_times, self._queue_times = self._queue_times, []
        n = len(self._router_s)
        return RouterStats(
            scheduler=self.scheduler.stats(),
            queue_time_s=queue_times,
            step_overhead_ms=1000.0 * sum(self._router_s) / n if n else 0.0,
            step_forward_ms=1000.0 * sum(self._forward_s) / n if n else 0.0,
        )

    def progress(self) -> list[RequestProgress]:
        reqs = [*self.scheduler.running, *self.scheduler.waiting]
        return [
            RequestProgress(
                req_id=r.req_id,
                status=r.status.value,
                prompt_tokens=r.num_prompt_tokens,
                output_tokens=r.num_output_tokens,
                computed_tokens=r.num_computed,
                kv_slots=r.num_kv,
                preemptions=r.num_preemptions,
                cached_tokens=r.num_cached_tokens,
            )
            for r in reqs
        ]
