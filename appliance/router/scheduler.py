"""Token-budget scheduler (vLLM v1 rule): each running request's computed-token count catches up
with its known tokens under a per-step budget. Owns the request-slot and KV-slot allocators; emits
StepPlans and consumes StepResults. Called by the router process and the offline `LLM`; no torch.

Per step: decodes of running requests first (oldest first), then prefill chunks of running requests,
then admission of waiting requests in queue order (router/wait_queue.py: first come, first served;
or, with scheduling_policy "priority", lower priority values first), never past the head, while
budget, request slots and KV remain. A decode that cannot get a KV slot preempts the most recently
admitted request (under the priority policy the one of the highest priority value, the latest of
those); its slots are freed, it goes back to the queue ahead of every later arrival of its
priority and is recomputed from prompt + generated tokens when re-admitted.

Prefix caching (router/prefix_cache.py): admission starts a request at its longest usable cached
prefix (KV slots shared, the GDN state restored from a snapshot). Prompt prefill chunks end at
every `snapshot_interval` tokens and at the prompt's end; the worker snapshots the state there and
the prefix goes into the tree when the step's result arrives. A request that ends (stop/length)
leaves its whole computed sequence in the tree, its state saved by the next plan.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from appliance.config import SchedulerConfig
from appliance.logging import get_logger
from appliance.messages import (
    NewRequest,
    SampledTokens,
    ScheduledChunk,
    SchedulerStats,
    SnapshotSave,
    StepPlan,
    StepResult,
)
from appliance.router.allocators import RefCountedSlots, SlotAllocator
from appliance.router.mtp_policy import VerifyPolicy
from appliance.router.prefix_cache import Cleared, PrefixCache, cache_keys
from appliance.router.request import FinishReason, Request, RequestOutput, RequestStatus
from appliance.router.wait_queue import WaitQueue

logger = get_logger(__name__)


MAX_PENDING = 2  # sampled tokens of one request in flight at most (the engine keeps 2 steps out)


class SchedulerError(Exception):
    """Base of the scheduler's typed errors."""


class InvalidRequest(SchedulerError, ValueError):
    """Malformed request (empty prompt, max_tokens < 0, duplicate id). Maps to HTTP 400."""


class RequestTooLong(SchedulerError, ValueError):
    """prompt + max_tokens exceeds max_model_len or can never fit the KV pool. Maps to HTTP 400."""

    def __init__(self, message: str, num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


class QueueFull(SchedulerError):
    """More than `max_waiting` requests queued. Maps to HTTP 429."""


class Scheduler:
    # Admission wants the prompt plus this many decode slots free (capped at the request's peak), so
    # a fresh request is not preempted on its first decodes.
    DEFAULT_DECODE_RESERVE = 16

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_slots: int,
        max_model_len: int,
        *,
        decode_reserve: int = DEFAULT_DECODE_RESERVE,
        rng_seed: int | None = None,  # seeds the draw of per-request sampling seeds (tests)
        num_snapshot_slots: int = 0,  # the worker's prefix-cache snapshot pool (WorkerInfo)
        linear_state: bool = False,  # the model has GDN layers: hits need snapshots
        mtp_verify_max_bs: int = 0,  # the worker's largest graphed MTP verify batch (WorkerInfo)
        mtp_verify_costs: dict[int, float] | None = None,  # verify / paused step time (WorkerInfo)
    ) -> None:
        if num_kv_slots < 1:
            raise ValueError(f"num_kv_slots: expected an integer >= 1, got {num_kv_slots}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len: expected an integer >= 1, got {max_model_len}")
        self.config = config
        self.max_model_len = max_model_len
        self.decode_reserve = decode_reserve
        self.req_slots = SlotAllocator(config.max_num_seqs, "req_slots")
        self.kv = RefCountedSlots(num_kv_slots, "kv_slots")
        self.snapshots = SlotAllocator(num_snapshot_slots, "snapshot_slots")
        usable = config.prefix_caching and (num_snapshot_slots > 0 or not linear_state)
        self.cache = PrefixCache(self.kv, self.snapshots, linear_state) if usable else None
        if config.prefix_caching and not usable:
            logger.warning(
                "prefix caching is off: the model has Gated-DeltaNet layers and the worker has no "
                "state snapshot slots (raise --snapshot-slots or --snapshot-mem-fraction)"
            )
        self._snapshot_saves: list[SnapshotSave] = []  # ended requests' states, for the next plan
        # step -> prefixes whose state a chunk of the step snapshots: (request, epoch, end, slot)
        self._cache_points: dict[int, list[tuple[Request, int, int, int, str]]] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self.waiting = WaitQueue(config.scheduling_policy)
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self._requests: dict[str, Request] = {}  # every live (waiting or running) request
        self._released: list[int] = []  # req slots freed since the last plan
        self._running_by_slot: dict[int, Request] = {}
        self._preempted_this_step = False
        # step -> req slot -> (request, its num_preemptions when planned): a result is stale if the
        # request was preempted (and maybe re-admitted on the same slot) since.
        self._inflight: dict[int, dict[int, tuple[Request, int, int]]] = {}  # (req, epoch, drafts)
        # step -> req slot -> request, for steps with chunks of requests scoring their prompt
        self._scoring: dict[int, dict[int, Request]] = {}
        self._rng = np.random.default_rng(rng_seed)
        self._step_id = 0
        self._num_preemptions = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_computed_tokens = 0
        self._num_finished = 0
        self._mtp_drafts = 0  # verify steps
        self._mtp_draft_tokens = 0
        self._mtp_accepted_tokens = 0
        self._mtp_accepted_per_position = [0] * config.mtp_step
        # which steps verify drafts: --mtp-disable-batch-size, else the worker's measured costs
        # (else its largest graphed verify batch; else every step)
        limit = config.mtp_disable_batch_size or (0 if mtp_verify_costs else mtp_verify_max_bs)
        self.verify_policy = VerifyPolicy(limit, mtp_verify_costs)
        self._mtp_paused_steps = 0  # steps whose decodes verified no drafts
        self._verify_drafts = True  # this step's decodes verify drafts (schedule())
        if config.mtp_step:
            logger.info("MTP: %s", self.verify_policy.describe())

    # ------------------------------------------------------------------ owner API

    def add_request(self, req: Request) -> None:
        """Queues a new request. Raises InvalidRequest, RequestTooLong or QueueFull."""
        self._validate(req)
        # The queue also holds, beyond max_waiting, as many as the running batch has free seats:
        # they start at the next step. So a burst the server admitted (it counts max_num_seqs +
        # max_waiting sequences, appliance/server/process.py) is not refused here before any of
        # it could be scheduled.
        seats = max(0, self.config.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + seats:
            raise QueueFull(f"{len(self.waiting)} requests waiting (max_waiting)")
        if req.sampling.seed is None:
            # The one place an unseeded request gets its seed: drawn once here, so recomputation
            # after preemption (and every TP rank) samples the same stream.
            seed = int(self._rng.integers(0, 2**63 - 1))
            req.sampling = msgspec.structs.replace(req.sampling, seed=seed)
        req.status = RequestStatus.WAITING
        self._requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> None:
        """Ends a request at once (waiting, mid-prefill or decoding); no-op if unknown/finished."""
        self.finish(req_id, FinishReason.ABORT)

    def finish(self, req_id: str, reason: FinishReason = FinishReason.STOP) -> None:
        """Ends a request early (e.g. the detokenizer matched a stop string) and frees its slots."""
        req = self._requests.get(req_id)
        if req is not None:
            self._finish(req, reason)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def reset_prefix_cache(self) -> Cleared | None:
        """Empties the prefix cache but for the entries live requests hold (their cached
        prefixes: locked); None when caching is off. Call it between plans, never inside
        `schedule` / `update` (as `abort`): a slot it frees goes to a later plan only. A prefix a
        chunk in flight snapshots still enters the tree when its result arrives."""
        if self.cache is None:
            return None
        cleared = self.cache.clear()
        logger.info(
            "prefix cache reset: freed %d tokens and %d state snapshots; kept %d tokens and %d "
            "snapshots on live requests' paths",
            cleared.freed_tokens,
            cleared.freed_snapshots,
            cleared.kept_tokens,
            cleared.kept_snapshots,
        )
        return cleared

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            # slots held by requests (the prefix tree's unused entries count as free: evictable)
            kv_used=self.kv.num_used - (self.cache.num_evictable if self.cache else 0),
            kv_total=self.kv.num_total,
            state_used=self.req_slots.num_used,
            state_total=self.req_slots.num_total,
            num_preemptions=self._num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_computed_tokens=self._num_computed_tokens,
            num_finished=self._num_finished,
            num_steps=self._step_id,
            mtp_drafts=self._mtp_drafts,
            mtp_draft_tokens=self._mtp_draft_tokens,
            mtp_accepted_tokens=self._mtp_accepted_tokens,
            mtp_accepted_per_position=list(self._mtp_accepted_per_position),
            mtp_paused_steps=self._mtp_paused_steps,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            prefix_cache_nodes=self.cache.num_nodes if self.cache else 0,
            prefix_cache_tokens=self.cache.num_tokens if self.cache else 0,
            snapshots_used=self.snapshots.num_used,
            snapshots_total=self.snapshots.num_total,
        )

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan | None:
        """Plans one step; None when no request has anything to compute, or while an MTP
        verify is in flight: its accepted length (so its next chunk) is known only with its
        result, and a step planned meanwhile would leave it out, splitting the MTP requests into
        two alternating halves that each advance every other step. Waiting keeps them in one
        batch; the device idles for the result's round trip instead. Steps over the verify
        limit (_may_verify) decode one row per request, like plain decodes: while only such
        steps are in flight the next one is planned at once if it is one too."""
        pending = self._mtp and any(r.num_pending for r in self.running)
        if pending and self._verify_in_flight():
            return None
        self._verify_drafts = self._may_verify()
        if pending and self._verify_drafts:
            return None
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequest] = []
        self._preempted_this_step = False
        decodes = 0  # decode chunks of generated tokens planned
        # 1. decodes, oldest first
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_known - req.num_computed != 1 or not self._may_decode(req):
                continue
            if not req.guide_ready:  # its first sample waits for the worker's grammar
                continue
            num_draft = self._num_draft(req)
            rows = 1 + num_draft
            if rows > budget:
                continue
            # May preempt newer requests (not planned yet: this loop runs oldest first) or req.
            if not self._reserve_kv(req, req.num_computed + rows):
                continue
            if req.num_computed < req.num_prompt_tokens:  # the prompt's last token: a cache point
                chunks.append(self._prefill_chunk(req, rows))
            else:
                chunks.append(self._make_chunk(req, rows, num_draft))
                decodes += 1
            budget -= rows
        # 2. prefill chunks (including recompute after re-admission), oldest first
        for req in list(self.running):
            if budget == 0:
                break
            remaining = req.num_known - req.num_computed
            if req.status is not RequestStatus.RUNNING or remaining <= 1:
                continue
            take = min(remaining - (not req.guide_ready), budget)
            # Admission allocated every known position, so a chunk never needs (or preempts for) KV.
            assert req.num_kv >= req.num_computed + take, "prefill chunk without KV slots"
            chunks.append(self._prefill_chunk(req, take))
            budget -= chunks[-1].num_tokens
        # 3. admission in queue order, never past its head; none after a preemption (a victim must
        # not come straight back)
        while (
            not self._preempted_this_step
            and budget > 0
            and self.waiting
            and self._can_admit(self.waiting[0])
        ):
            req = self.waiting.popleft()
            new_requests.append(self._admit(req))
            # a guided request's last prompt token (its first sample) waits for its grammar
            take = min(req.num_tokens - req.num_computed - (not req.guide_ready), budget)
            if take:
                chunks.append(self._prefill_chunk(req, take))
                budget -= chunks[-1].num_tokens
        if not chunks and not new_requests and not self._awaiting_guides():
            return None
        if self._mtp and decodes:
            self.verify_policy.planned(self._verify_drafts)
            self._mtp_paused_steps += not self._verify_drafts
        step_id = self._step_id
        self._step_id += 1
        self._inflight[step_id] = {
            c.req_slot: (r, r.num_preemptions, c.num_draft)
            for c in chunks
            if c.sample and (r := self._running_by_slot[c.req_slot])
        }
        scoring = {
            c.req_slot: r
            for c in chunks
            if (r := self._running_by_slot[c.req_slot]).prompt_scores is not None
        }
        if scoring:
            self._scoring[step_id] = scoring
        plan = StepPlan(step_id, new_requests, chunks, self._released, self._snapshot_saves)
        self._released, self._snapshot_saves = [], []
        return plan

    def empty_plan(self) -> StepPlan:
        """A plan that computes nothing (it carries what the workers do between steps: the
        profiler's switch, the slots and snapshots released since the last plan); its result
        updates no request."""
        step_id = self._step_id
        self._step_id += 1
        self._inflight[step_id] = {}
        plan = StepPlan(step_id, [], [], self._released, self._snapshot_saves)
        self._released, self._snapshot_saves = [], []
        return plan

    def _awaiting_guides(self) -> bool:
        """A running request waits for its grammar: an empty plan lets the worker report it
        (the worker waits a few ms for a compile to finish before answering it)."""
        return any(not r.guide_ready for r in self.running)

    def _may_decode(self, req: Request) -> bool:
        """A decode may be planned while the previous step of the request is in flight (its token
        is pending), unless that pending token is the request's last (max_tokens) or MAX_PENDING
        tokens are out already. (No step is planned at all while an MTP decode is pending: see
        schedule().)"""
        if not req.num_pending:
            return True
        if req.num_pending >= MAX_PENDING:
            return False
        return req.num_output_tokens + req.num_pending < req.max_tokens

    def _count_mtp(self, req: Request, num_draft: int, num_tokens: int) -> None:
        accepted = num_tokens - 1
        req.count_verify(num_draft, accepted, self.config.mtp_step)
        self._mtp_drafts += 1
        self._mtp_draft_tokens += num_draft
        self._mtp_accepted_tokens += accepted
        for position in range(accepted):
            self._mtp_accepted_per_position[position] += 1

    @property
    def _mtp(self) -> bool:
        """Every decoding request drafts when MTP is on, whatever its sampling options (the
        worker edits the verify rows of those with penalties, logprobs ...)."""
        return self.config.mtp_step > 0

    def _verify_in_flight(self) -> bool:
        """A step in flight carries a verify chunk (its accepted lengths are still unknown)."""
        return any(drafts for step in self._inflight.values() for _, _, drafts in step.values())

    def _may_verify(self) -> bool:
        """This step's decodes verify their drafts: MTP is on and the policy (router/mtp_policy.py)
        finds it pays at this many decoding requests. A verify's rows and GDN candidate states
        grow k + 1-fold per request, so at large batches or a low accept length it costs more
        than its accepted tokens gain; the step then decodes one row per request, the worker
        still drafts after it, and a later step that verifies finds current drafts."""
        if not self._mtp:
            return False
        decoding = sum(
            1
            for r in self.running
            if r.status is RequestStatus.RUNNING and r.num_output_tokens and r.guide_ready
        )
        return self.verify_policy.verify(decoding)

    def _num_draft(self, req: Request) -> int:
        """MTP draft rows for this decode: mtp_step, clamped so no draft lands past max_tokens (or,
        by validation, past max_model_len); 0 before the worker has drafted (prefill not
        sampled) and in a step the verify policy pauses (_may_verify)."""
        if not self._verify_drafts or req.num_output_tokens == 0:
            return 0
        return max(0, min(self.config.mtp_step, req.max_tokens - req.num_output_tokens - 1))

    def _can_admit(self, req: Request) -> bool:
        """Room for the request's uncached positions (evicting unused cache entries if needed).
        Its cache match is kept locked on `req.prefix_node` when it returns True."""
        if self.req_slots.num_free == 0:
            return False
        hit, node = 0, None
        # a prompt being scored (prompt logprobs) is computed whole: cached rows are not scored
        if self.cache is not None and req.prompt_scores is None:
            match = self.cache.match(self._keys(req), req.num_tokens - 1)
            if match.length:
                hit, node = match.length, match.node
                self.cache.lock(node)
            req.prefix_match = match
        need = min(req.num_tokens + self.decode_reserve, req.peak_kv_slots) - hit
        if self.kv.num_free < need and self.cache is not None:
            self.cache.evict(kv_slots=need)
        if self.kv.num_free >= need:
            req.prefix_node = node
            return True
        if node is not None:
            self.cache.unlock(node)
        return False

    def _admit(self, req: Request) -> NewRequest:
        req.req_slot = self.req_slots.alloc_one()
        match, req.prefix_match = req.prefix_match, None
        hit = match.length if match is not None else 0
        shared = match.kv_slots() if hit else np.empty(0, np.int32)
        if hit:
            self.kv.incref(shared)
            req.append_kv(shared)
        # every known position, so chunks never stall
        req.append_kv(self.kv.alloc(req.num_tokens - hit))
        req.num_computed = hit
        if req.num_preemptions == 0:
            req.scheduled_at = time.monotonic()
            req.num_cached_tokens = hit
            self._prefix_queries += req.num_prompt_tokens if self.cache is not None else 0
            self._prefix_hits += hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._running_by_slot[req.req_slot] = req
        logger.debug(
            "admit %s slot=%d tokens=%d cached=%d preemptions=%d",
            req.req_id,
            req.req_slot,
            req.num_tokens,
            hit,
            req.num_preemptions,
        )
        return NewRequest(
            req_slot=req.req_slot,
            token_ids=req.all_token_ids,
            sampling=req.sampling,
            num_prompt_tokens=req.num_prompt_tokens,
            num_draft=self.config.mtp_step,
            mm=req.mm,  # sent again on re-admission: the visual server keeps them pinned
            cached_kv_slots=shared.tolist(),
            restore_snapshot=match.snapshot if hit else -1,
        )

    def _reserve_kv(self, req: Request, upto: int) -> bool:
        """Makes `req` hold KV slots for positions [0, upto), preempting the most recently admitted
        requests if the pool is short. False when `req` itself had to be preempted."""
        need = upto - req.num_kv
        while need > self.kv.num_free:
            if self.cache is not None:  # unused cache entries go first (a victim's, too)
                self.cache.evict(kv_slots=need)
                if need <= self.kv.num_free:
                    break
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.append_kv(self.kv.alloc(need))
        return True

    def _prefill_chunk(self, req: Request, take: int) -> ScheduledChunk:
        """A prefill chunk of at most `take` tokens, cut at the next snapshot interval and (chat)
        at the generation prompt's start; the chunk ending there or at the last known token
        becomes a cache point (its prefix is inserted into the tree when the step's result
        arrives, with a state snapshot on hybrid models)."""
        if self.cache is None:
            return self._make_chunk(req, take)
        start, interval = req.num_computed, self.config.snapshot_interval
        end = start + take
        at_boundary = False
        if self.cache.needs_snapshots:
            if interval:
                end = min(end, (start // interval + 1) * interval)
            if start < req.turn_start < end:
                end = req.turn_start
            at_boundary = (bool(interval) and end % interval == 0) or end == req.turn_start
        if end != req.num_known and not at_boundary:
            return self._make_chunk(req, end - start)
        # (a chat prompt's end is a few template tokens past its turn start, and the client's
        # next turn re-renders what follows: no more use than a periodic point)
        kind = "interval"
        if end == req.turn_start:
            kind = "turn"
        elif end == req.num_known and req.turn_start < 0:
            kind = "prompt"
        slot = self._snapshot_slot(kind)
        if self.cache.needs_snapshots and slot < 0:
            return self._make_chunk(req, end - start)
        point = (req, req.num_preemptions, end, slot, kind)
        self._cache_points.setdefault(self._step_id, []).append(point)
        return self._make_chunk(req, end - start, save_snapshot=slot)

    def _snapshot_slot(self, kind: str) -> int:
        """A snapshot slot for a cache point of `kind` (prefix_cache.SNAPSHOT_KINDS), or -1 (also
        on a model without linear state). None free: a covered interval snapshot goes; a periodic
        point takes nothing more. For the others, then any other superseded snapshot, then a
        chat request's end, then an unused cache entry (LRU); for a request's end, last, the least
        recently used snapshot even from a running request's path (only between plans: see
        drop_snapshot)."""
        cache = self.cache
        if not cache.needs_snapshots:
            return -1
        free = self.snapshots.num_free or cache.drop_covered_snapshot()
        if not free and kind != "interval":
            if not cache.drop_covered_snapshot(("chat_end", "prompt", "end", "turn")):
                if not cache.drop_snapshot(("chat_end",)):
                    cache.evict(snapshots=1)
            if self.snapshots.num_free == 0 and kind == "end":
                cache.drop_snapshot()
        return self.snapshots.alloc_one() if self.snapshots.num_free else -1

    def _keys(self, req: Request) -> np.ndarray:
        """The tree keys of the request's known tokens, kept on it while no token is added (a
        128k prompt's take ~10 ms: once, not at each cache point or admission attempt)."""
        if req.cache_keys is None or req.cache_keys.size != req.num_tokens:
            req.cache_keys = cache_keys(req.all_token_ids, req.mm, req.cache_salt)
        return req.cache_keys

    def _cache_prefix(self, req: Request, end: int, snapshot: int, kind: str = "end") -> bool:
        """Puts the request's first `end` positions into the tree; its lock moves to the new node.
        False when the snapshot was not kept (the tree has one there already)."""
        keys, kv = self._keys(req)[:end], req.kv_slots[:end]
        node, kept = self.cache.insert(keys, kv, snapshot, kind)
        self.cache.lock(node)
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        req.prefix_node = node
        return kept

    def _cache_points_done(self, step_id: int) -> None:
        """The snapshots planned in step `step_id` are written: their prefixes enter the tree."""
        for req, epoch, end, slot, kind in self._cache_points.pop(step_id, []):
            if req.status is RequestStatus.RUNNING and req.num_preemptions == epoch:
                if self._cache_prefix(req, end, slot, kind) or slot < 0:
                    continue
            if slot >= 0:
                self.snapshots.free(slot)

    def _cache_ended(self, req: Request) -> None:
        """A request that stopped leaves its computed sequence in the tree (the next turn of a
        conversation starts with it); its state is saved by the next plan."""
        end = req.num_computed
        if self.cache is None or req.req_slot < 0 or not 0 < end <= req.num_tokens:
            return  # (an MTP run cut short by a stop token computed rows past the kept tokens)
        if req.num_pending and self._mtp:
            return  # a verify step in flight: how many of its rows the state keeps is unknown
        slot = self._snapshot_slot("end")
        if self.cache.needs_snapshots and slot < 0:
            return
        if self._cache_prefix(req, end, slot, "chat_end" if req.turn_start >= 0 else "end"):
            self._snapshot_saves.append(SnapshotSave(req.req_slot, slot))
        elif slot >= 0:
            self.snapshots.free(slot)

    def _make_chunk(
        self, req: Request, num_tokens: int, num_draft: int = 0, save_snapshot: int = -1
    ) -> ScheduledChunk:
        start = req.num_computed
        end = start + num_tokens
        kv_slots = req.kv_slots[start:end].tolist()
        req.num_computed = end
        self._num_computed_tokens += num_tokens
        prompt_end = min(end, req.num_prompt_tokens)
        if prompt_end > req.num_prompt_counted:
            self._num_prompt_tokens += prompt_end - req.num_prompt_counted
            req.num_prompt_counted = prompt_end
        sample = end >= req.num_known
        req.num_pending += sample
        return ScheduledChunk(
            req_slot=req.req_slot,
            start=start,
            num_tokens=num_tokens,
            kv_slots=kv_slots,
            sample=sample,
            num_draft=num_draft,
            save_snapshot=save_snapshot,
        )

    # ------------------------------------------------------------------ results

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Appends the sampled tokens of one step, finishes requests that hit eos / a stop token /
        max_tokens (freeing their slots) and returns one delta per request that gained tokens."""
        inflight = self._inflight.pop(result.step_id, None)
        if inflight is None:
            raise SchedulerError(f"result for unknown or already-updated step {result.step_id}")
        scoring = self._scoring.pop(result.step_id, {})
        for part in result.prompt_scores:
            req = scoring.get(part.req_slot)
            # kept even when the step is stale: a prompt's scores do not depend on the epoch
            if req is not None and req.prompt_scores is not None:
                req.prompt_scores.add(part.scores)
        if self.cache is not None:
            self._cache_points_done(result.step_id)
        for slot in result.guides_ready:
            if (req := self._running_by_slot.get(slot)) is not None:
                req.guide_ready = True
        outputs: list[RequestOutput] = []
        verified = accepted = 0  # this step's verify chunks and the draft tokens they accepted
        for sampled in result.sampled:
            entry = inflight.pop(sampled.req_slot, None)
            if entry is None:
                raise SchedulerError(
                    f"step {result.step_id}: worker sampled for slot {sampled.req_slot}, "
                    "which had no sampling chunk"
                )
            req, epoch, num_draft = entry
            if req.status is not RequestStatus.RUNNING or req.num_preemptions != epoch:
                continue  # aborted / finished / preempted after the plan was made: drop the token
            req.num_pending -= 1
            if num_draft:
                self._count_mtp(req, num_draft, len(sampled.token_ids))
                verified += 1
                accepted += len(sampled.token_ids) - 1
                # rows past the accepted ones were computed for rejected drafts: give back their KV
                rejected = num_draft + 1 - len(sampled.token_ids)
                req.num_computed -= rejected
                self.kv.free(req.pop_kv(rejected))
            outputs.append(self._append_tokens(req, sampled))
        self.verify_policy.observe(verified, accepted)
        for req, epoch, _ in inflight.values():
            if req.status is RequestStatus.RUNNING and req.num_preemptions == epoch:
                raise SchedulerError(
                    f"step {result.step_id}: no sampled token for request {req.req_id}"
                )
        return outputs

    def _append_tokens(self, req: Request, sampled: SampledTokens) -> RequestOutput:
        new_tokens: list[int] = []
        reason: FinishReason | None = None
        stop_token_id: int | None = None
        if req.max_tokens == 0:  # the prompt was only scored: its sample is dropped
            reason = FinishReason.LENGTH
        for token in sampled.token_ids if req.max_tokens else ():
            req.output_token_ids.append(token)
            new_tokens.append(token)
            if token in req.stop_token_ids or (not req.ignore_eos and token in req.eos_token_ids):
                reason, stop_token_id = FinishReason.STOP, token
                break
            if req.num_output_tokens >= req.max_tokens:
                reason = FinishReason.LENGTH
                break
            if req.repetition is not None and req.repetition.found(req.output_token_ids):
                reason = FinishReason.REPETITION
                break
        self._num_generation_tokens += len(new_tokens)
        n = len(new_tokens)
        if n:
            req.last_token_at = time.monotonic()
            req.first_token_at = req.first_token_at or req.last_token_at
        logprobs = sampled.logprobs[:n] if sampled.logprobs is not None else None
        top = sampled.top_logprobs[:n] if sampled.top_logprobs is not None else None
        if reason is not None:
            self._finish(req, reason)
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=new_tokens,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=logprobs,
            top_logprobs=top,
            stop_token_id=stop_token_id,
            prompt_logprobs=req.take_prompt_scores(),
            cached_tokens=req.num_cached_tokens,
            spec=req.spec_counts(),
            timing=req.timing(),
        )

    # ------------------------------------------------------------------ slot bookkeeping

    def _release(self, req: Request) -> None:
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
            req.prefix_node = None
        if req.prefix_match is not None:
            req.prefix_match = None
        if req.req_slot >= 0:
            self.req_slots.free(req.req_slot)
            self._released.append(req.req_slot)
            del self._running_by_slot[req.req_slot]
            req.req_slot = -1
        self.kv.free(req.take_kv())
        req.num_computed = 0
        req.num_pending = 0  # results of steps in flight are dropped (stale epoch or finished)

    def _victim(self) -> Request:
        """Whom a decode without KV preempts: the last admitted; under the priority policy the
        running request of the highest priority value, the latest arrival of those."""
        if self.config.scheduling_policy != "priority":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.arrival_number))

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._num_preemptions += 1
        self._preempted_this_step = True
        logger.debug("preempt %s (tokens=%d)", req.req_id, req.num_tokens)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            if reason is not FinishReason.ABORT:
                self._cache_ended(req)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self._requests[req.req_id]
        self._num_finished += 1
        logger.debug(
            "finish %s reason=%s prompt=%d output=%d",
            req.req_id,
            reason.value,
            req.num_prompt_tokens,
            req.num_output_tokens,
        )

    def _validate(self, req: Request) -> None:
        if req.req_id in self._requests:
            raise InvalidRequest(f"request id {req.req_id!r} is already in use")
        if req.status is not RequestStatus.WAITING or req.output_token_ids:
            raise InvalidRequest(f"request {req.req_id!r} was already scheduled")
        if req.num_prompt_tokens == 0:
            raise InvalidRequest("prompt: expected at least one token")
        if req.max_tokens < 0:
            raise InvalidRequest(f"max_tokens: expected an integer >= 0, got {req.max_tokens}")
        prompt_len, max_tokens = req.num_prompt_tokens, req.max_tokens
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise RequestTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({prompt_len} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                req.num_prompt_tokens,
                req.max_tokens,
                self.max_model_len,
            )
        if req.peak_kv_slots > self.kv.num_total:
            raise RequestTooLong(
                f"The request needs {req.peak_kv_slots} KV cache slots ({prompt_len} prompt + "
                f"{max_tokens} completion tokens) but the KV cache holds only "
                f"{self.kv.num_total}. Please reduce the length of the messages or completion.",
                req.num_prompt_tokens,
                req.max_tokens,
                self.kv.num_total,
            )
