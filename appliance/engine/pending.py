"""A step the worker has launched but not reported yet: either its result is already known (steps
that finish on the host: MTP, logprobs) or its sampled tokens are on their way to the host in one
non-blocking copy. Created by the model runner's submit(), read by its collect()."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from appliance.messages import SampledTokens, StepResult


@dataclass
class PendingStep:
    step_id: int
    start: float  # perf_counter() when the step was launched
    done: StepResult | None = None  # set when the result was computed at launch
    slots: list[int] = field(default_factory=list)  # request slot of each sampled row
    host_ids: torch.Tensor | None = None  # [S] int64 (pinned on CUDA), filled by the copy
    copied: torch.cuda.Event | None = None  # recorded after the copy (None on CPU)

    @classmethod
    def ready(cls, result: StepResult) -> PendingStep:
        return cls(result.step_id, 0.0, done=result)

    @classmethod
    def copying(
        cls, step_id: int, start: float, slots: list[int], token_ids: torch.Tensor
    ) -> PendingStep:
        """Starts the device-to-host copy of the step's sampled ids [S] (stream-ordered)."""
        if not token_ids.is_cuda:
            return cls(step_id, start, slots=slots, host_ids=token_ids)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host.copy_(token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(step_id, start, slots=slots, host_ids=host, copied=event)

    def is_done(self) -> bool:
        """The result can be read without waiting for the device."""
        return self.done is not None or self.copied is None or self.copied.query()

    def result(self) -> StepResult:
        if self.done is not None:
            return self.done
        if self.copied is not None:
            self.copied.synchronize()
        ids = self.host_ids.tolist()
        sampled = [SampledTokens(slot, [token]) for slot, token in zip(self.slots, ids)]
        return StepResult(self.step_id, sampled, time.perf_counter() - self.start)
