"""The scheduler's queue of waiting requests, in the order they are admitted.

`fcfs` (the default): first come, first served; a preempted request goes back to the front.
`priority` (vLLM's `--scheduling-policy priority`): lower `Request.priority` first, arrival order
among equals; a preempted request goes back to its place by the same key, which, as it came
before every request still waiting at its priority, is the front of its priority. Used by
router/scheduler.py; no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from appliance.router.request import Request

POLICIES = ("fcfs", "priority")


class WaitQueue:
    """Waiting requests sorted by (priority under the priority policy, else 0; arrival number)."""

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._keys: list[tuple[int, int]] = []
        self._requests: list[Request] = []
        self._arrivals = 0

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.policy == "priority" else 0, req.arrival_number)

    def append(self, req: Request) -> None:
        """A new request: numbered on arrival, queued at its place."""
        req.arrival_number = self._arrivals
        self._arrivals += 1
        self._insert(req)

    def appendleft(self, req: Request) -> None:
        """A preempted request, back ahead of every later arrival of its priority."""
        self._insert(req)

    def _insert(self, req: Request) -> None:
        key = self._key(req)
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._requests.insert(at, req)

    def popleft(self) -> Request:
        self._keys.pop(0)
        return self._requests.pop(0)

    def remove(self, req: Request) -> None:
        at = self._requests.index(req)
        del self._keys[at], self._requests[at]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))
