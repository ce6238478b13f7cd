"""The router's view of one request (tokens, slots, progress) and the per-step output it reports.

Created by the router process / offline `LLM` from a tokenized request; mutated only by
`appliance.router.scheduler.Scheduler`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from appliance.messages import (
    ImageInput,
    PromptLogprobs,
    RepetitionCheck,
    RequestTiming,
    SamplingOptions,
    SpecCounts,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # holds a request slot and KV slots
    FINISHED = "finished"  # stopped, hit a length limit, or was aborted; holds nothing


class FinishReason(str, enum.Enum):
    STOP = (
        "stop"  # eos or a stop token id (stop strings are the detokenizer's, via Scheduler.finish)
    )
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away or the owner aborted it
    REPETITION = "repetition"  # the output repeats itself (vLLM's repetition_detection)


class PromptScoreBuffer:
    """A request's prompt logprobs while its prefill chunks report them (a chunk recomputed after
    a preemption writes the same places again); token 0 keeps None."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.token_ids = prompt_token_ids
        self.logprobs: list[float | None] = [None] * len(prompt_token_ids)
        self.top: list[list[tuple[int, float]]] = [[] for _ in prompt_token_ids]
        self.ranks: list[int] = [0] * len(prompt_token_ids)  # 0: not ranked (token 0)

    def add(self, part: PromptLogprobs) -> None:
        end = part.start + len(part.logprobs)
        self.logprobs[part.start : end] = part.logprobs
        self.top[part.start : end] = part.top
        if part.ranks:
            self.ranks[part.start : end] = part.ranks

    def whole(self) -> PromptLogprobs:
        return PromptLogprobs(0, list(self.token_ids), self.logprobs, self.top, self.ranks)


@dataclass(eq=False)
class Request:
    """One generation request. `eq=False`: requests compare by identity."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    max_tokens: int = 16  # 0: only the prompt is computed (scored); the prefill's sample is dropped
    eos_token_ids: frozenset[int] = frozenset()  # ignored when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()  # always honoured
    ignore_eos: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    mm: list[ImageInput] = field(default_factory=list)  # prompt images (by cache handle), by offset
    turn_start: int = -1  # chat: where the generation prompt starts (a prefix-cache point)
    priority: int = 0  # lower first under --scheduling-policy priority (vLLM's); else unused
    report_timing: bool = False  # its outputs carry RequestTiming (per-request metrics)
    cache_salt: str = ""  # vLLM's: shares cached prefixes only with requests of the same salt
    repetition: RepetitionCheck | None = None  # vLLM's repetition_detection (None: off)
    report_spec: bool = False  # its outputs carry SpecCounts

    # Scheduler-owned state.
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    req_slot: int = -1  # -1 while not running
    num_computed: int = 0  # positions whose KV/state the worker has (or is computing this step)
    num_pending: int = 0  # tokens sampled by steps in flight whose result has not arrived yet
    num_preemptions: int = 0
    arrival_number: int = 0  # order of arrival in the wait queue (router/wait_queue.py)
    guide_ready: bool = True  # False while the worker compiles the request's grammar (guided)
    num_prompt_counted: int = (
        0  # prompt positions already counted in stats (recompute not re-counted)
    )
    # prompt logprobs gathered until the first output carries them (sampling.prompt_logprobs)
    prompt_scores: PromptScoreBuffer | None = None
    num_cached_tokens: int = 0  # prompt positions found in the prefix cache at first admission
    # MTP verify steps by draft length and accepted drafts (SpecCounts; None before the first)
    spec_by_length: list[list[int]] | None = None
    # time.monotonic() when first scheduled (admitted), at its first and its last token; 0: not yet
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    prefix_node: Any = None  # the prefix-tree node it holds locked (router/prefix_cache.py)
    prefix_match: Any = None  # its cache match between _can_admit and _admit
    cache_keys: np.ndarray | None = field(default=None, repr=False)  # tree keys of its tokens
    _kv_buf: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32), repr=False)
    _num_kv: int = 0

    def count_verify(self, num_draft: int, accepted: int, mtp_step: int) -> None:
        """One verify step of `num_draft` drafts that accepted `accepted` of them."""
        if self.spec_by_length is None:
            self.spec_by_length = [[0] * (d + 2) for d in range(mtp_step)]
        self.spec_by_length[num_draft - 1][accepted] += 1

    def spec_counts(self) -> SpecCounts | None:
        """Its SpecCounts so far, if it reports them (report_spec) and has verified."""
        if not self.report_spec or self.spec_by_length is None:
            return None
        return SpecCounts([list(row) for row in self.spec_by_length])

    def timing(self) -> RequestTiming | None:
        """Its RequestTiming so far, if it reports one (report_timing)."""
        if not self.report_timing or not self.scheduled_at:
            return None
        first = self.first_token_at
        return RequestTiming(
            self.scheduled_at - self.arrival_time,
            first - self.scheduled_at if first else 0.0,
            self.last_token_at - first if first else 0.0,
        )

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_scores = PromptScoreBuffer(self.prompt_token_ids)
        self.guide_ready = self.sampling.guide is None

    def take_prompt_scores(self) -> PromptLogprobs | None:
        """The whole prompt's logprobs, once (the first output); a recompute after a later
        preemption does not score the prompt again."""
        if self.prompt_scores is None:
            return None
        whole, self.prompt_scores = self.prompt_scores.whole(), None
        self.sampling = msgspec.structs.replace(self.sampling, prompt_logprobs=None)
        return whole

    # ------------------------------------------------------------------ tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus everything sampled so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known(self) -> int:
        """Known tokens plus those being sampled in flight (the worker feeds them to the next step
        itself, so the router can plan it before the previous result arrives)."""
        return self.num_tokens + self.num_pending

    @property
    def peak_kv_slots(self) -> int:
        """KV slots held at the end of generation: the last sampled token is never fed back (with
        max_tokens 0, every prompt position still gets one)."""
        return self.num_prompt_tokens + max(self.max_tokens, 1) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # ------------------------------------------------------------------ KV slots

    @property
    def kv_slots(self) -> np.ndarray:
        """KV slot of each position that has one, int32 [num_kv] (a view; do not keep it)."""
        return self._kv_buf[: self._num_kv]

    @property
    def num_kv(self) -> int:
        return self._num_kv

    def append_kv(self, slots: np.ndarray) -> None:
        need = self._num_kv + slots.size
        if need > self._kv_buf.size:  # amortised doubling: decodes append one slot per step
            grown = np.empty(max(need, 2 * self._kv_buf.size, 16), dtype=np.int32)
            grown[: self._num_kv] = self._kv_buf[: self._num_kv]
            self._kv_buf = grown
        self._kv_buf[self._num_kv : need] = slots
        self._num_kv = need

    def pop_kv(self, count: int) -> np.ndarray:
        """Removes and returns the last `count` KV slots (rejected MTP verify rows)."""
        count = min(count, self._num_kv)
        self._num_kv -= count
        return self._kv_buf[self._num_kv : self._num_kv + count].copy()

    def take_kv(self) -> np.ndarray:
        """Removes and returns every KV slot (for freeing); the request keeps its tokens."""
        slots = self._kv_buf[: self._num_kv].copy()
        self._num_kv = 0
        return slots


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one step, returned by `Scheduler.update` to the owner (router
    process or offline `LLM`), which forwards it to the detokenizer."""

    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None  # one per new token, when requested
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) pairs
    stop_token_id: int | None = None  # the eos/stop token id that ended the request, if any
    prompt_logprobs: PromptLogprobs | None = None  # the whole prompt's, with the first output
    cached_tokens: int = 0  # prompt tokens the request found in the prefix cache
    spec: SpecCounts | None = None  # its MTP verify counts so far (None: it has not verified)
    timing: RequestTiming | None = None  # its timing so far (None: not asked for)
