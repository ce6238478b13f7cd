"""The router: request queue, admission, token-budget scheduling and slot allocators (no torch).

Used by the router process and the offline `LLM`: `Scheduler` plans `StepPlan`s and consumes
`StepResult`s.
"""

from __future__ import annotations

from appliance.router.allocators import OutOfSlots, SlotAllocator
from appliance.router.request import FinishReason, Request, RequestOutput, RequestStatus
from appliance.router.scheduler import (
    InvalidRequest,
    QueueFull,
    RequestTooLong,
    Scheduler,
    SchedulerError,
    SchedulerStats,
)

__all__ = [
    "FinishReason",
    "InvalidRequest",
    "OutOfSlots",
    "QueueFull",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestTooLong",
    "Scheduler",
    "SchedulerError",
    "SchedulerStats",
    "SlotAllocator",
]
