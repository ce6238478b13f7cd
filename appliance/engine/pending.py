"""A step the worker has launched but not reported yet: either its result is already known (steps
that finish on the host: logprobs, mixed MTP steps) or its sampled tokens are on their way to the
host in one non-blocking copy: one token per request (plain decode), or per request its k + 1 MTP
samples followed by how many of them were accepted. A step with grammar-guided rows launched behind
another one holds its sampling back (`deferred`): the masks need the matchers to have read the
earlier step's tokens, so the runner launches it when that step is collected, while this step's
forward runs. Created by the model runner's submit(), read by its collect()."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from appliance.engine.sampler import unpack_logprobs
from appliance.messages import PromptScores, SampledTokens, StepResult


@dataclass
class PendingStep:
    step_id: int
    start: float  # perf_counter() when the step was launched
    done: StepResult | None = None  # set when the result was computed at launch
    slots: list[int] = field(default_factory=list)  # request slot of each sampled row
    host_ids: torch.Tensor | None = None  # [S] or [S, k + 2] int64 (pinned on CUDA), copied into
    # MTP: the logprobs of the scored requests' k + 1 samples (engine/verify_edits.py), copied
    # with the ids: [len(scored) * (k + 1), 1 + 2 * top] fp32; `scored`: (index into slots, top)
    host_logprobs: torch.Tensor | None = None
    scored: list[tuple[int, int]] = field(default_factory=list)
    copied: torch.cuda.Event | None = None  # recorded after the copy (None on CPU)
    lengths: Callable[[list[int]], None] | None = None  # told each request's new length (MTP)
    starts: list[int] = field(default_factory=list)  # MTP: each request's first verify position
    known: list[SampledTokens] = field(default_factory=list)  # results the host already has
    scores: list[PromptScores] = field(default_factory=list)  # prompt logprobs (host lists)
    committed: Callable[[list[SampledTokens]], None] | None = None  # told the copied runs
    # the step's sampling, not launched yet: called once, it launches it and calls start_copy
    deferred: Callable[[PendingStep], None] | None = None

    @classmethod
    def ready(cls, result: StepResult) -> PendingStep:
        return cls(result.step_id, 0.0, done=result)

    @classmethod
    def copying(
        cls,
        step_id: int,
        start: float,
        slots: list[int],
        token_ids: torch.Tensor,
        logprobs: torch.Tensor | None = None,
        **extra,
    ) -> PendingStep:
        """Starts the device-to-host copy of the step's sampled ids [S] (or MTP rows [S, k + 2],
        with `lengths` and `starts`, and the `logprobs` of the `scored` requests' rows)
        (stream-ordered); `scores`: the step's prompt logprobs."""
        pending = cls(step_id, start, slots=slots, **extra)
        pending.start_copy(token_ids, logprobs)
        return pending

    def start_copy(self, token_ids: torch.Tensor, logprobs: torch.Tensor | None = None) -> None:
        self.host_ids = _to_host(token_ids)
        self.host_logprobs = None if logprobs is None else _to_host(logprobs)
        if token_ids.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def launch_deferred(self) -> None:
        """Launches the held-back sampling (the steps before this one must be collected)."""
        if self.deferred is not None:
            launch, self.deferred = self.deferred, None
            launch(self)

    def is_done(self) -> bool:
        """The result can be read without waiting for the device."""
        if self.deferred is not None:
            return False
        return self.done is not None or self.copied is None or self.copied.query()

    def result(self) -> StepResult:
        """The step's result (computed once: waits for the copy, tells `committed`)."""
        if self.done is not None:
            return self.done
        self.launch_deferred()
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.host_ids.tolist()
        if self.host_ids.dim() == 1:
            tokens = [[token] for token in rows]
        else:  # MTP: the k + 1 samples, then how many were accepted
            tokens = [row[: row[-1]] for row in rows]
            if self.lengths is not None:
                self.lengths([s + 1 + len(run) for s, run in zip(self.starts, tokens)])
        copied = [SampledTokens(slot, run) for slot, run in zip(self.slots, tokens)]
        if self.host_logprobs is not None:
            copied = self._with_logprobs(copied)
        if self.committed is not None:
            self.committed(copied)
        sampled = self.known + copied
        elapsed = time.perf_counter() - self.start
        self.done = StepResult(self.step_id, sampled, elapsed, self.scores)
        return self.done

    def _with_logprobs(self, copied: list[SampledTokens]) -> list[SampledTokens]:
        """The scored requests' runs with the logprobs of their accepted tokens."""
        table = self.host_logprobs.tolist()
        rows = self.host_ids.shape[1] - 1  # k + 1 samples per request
        copied = list(copied)
        for p, (i, top) in enumerate(self.scored):
            run = copied[i]
            first = p * rows
            scores = [unpack_logprobs(r, top) for r in table[first : first + len(run.token_ids)]]
            copied[i] = SampledTokens(
                run.req_slot, run.token_ids, [lp for lp, _ in scores], [t for _, t in scores]
            )
        return copied


def _to_host(values: torch.Tensor) -> torch.Tensor:
    """A copy of device values on the host: pinned and non-blocking on CUDA (stream-ordered)."""
    if not values.is_cuda:
        return values.clone()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host
