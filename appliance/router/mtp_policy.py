"""When a step's MTP decodes verify their drafts (the Scheduler asks once per step): a fixed
limit on decoding requests (--mtp-disable-batch-size N), or, by default, a cost rule from the
worker's measured verify-over-plain step times per graphed batch and the accept length seen."""

from __future__ import annotations

from bisect import bisect_left

ACCEPT_EMA = 0.2  # weight of a verify step's mean accept length in the running estimate
PROBE_EVERY = 16  # a verify every this many steps paused by the cost rule (re-measures acceptance)


class VerifyPolicy:
    """`verify(decoding)`: this step's decodes verify drafts. Fixed limit: decoding <= limit.
    Cost rule (limit 0 with `costs`, {graphed verify batch: verify step time / (plain decode +
    draft pass) time}, from WorkerInfo): a verify step yields its accept length L in tokens per
    request for `cost` times a paused step's time, so it verifies while the batch fits a graphed
    verify and L >= the cost of the smallest batch holding it. L is a running mean of the verify
    steps' (starting optimistic: unmeasured acceptance verifies); while the rule pauses, every
    PROBE_EVERY-th step verifies anyway, so a rising acceptance is seen. Neither: always.
    `verify` only answers; `planned` records the steps of decodes really planned."""

    def __init__(self, limit: int = 0, costs: dict[int, float] | None = None) -> None:
        self.limit = limit
        self.buckets = sorted(costs) if costs and not limit else []
        self.costs = [costs[b] for b in self.buckets] if self.buckets else []
        self.accept_len: float | None = None  # running mean of verify steps' accept lengths
        self._paused = 0  # consecutive steps the cost rule paused

    def describe(self) -> str:
        if self.limit:
            return f"steps with more than {self.limit} decoding requests verify no drafts"
        if self.buckets:
            costs = ", ".join(f"{b}: {c:.2f}" for b, c in zip(self.buckets, self.costs))
            return (
                "a step verifies drafts while its accept length pays for the verify's cost "
                f"over a plain step (measured per graphed batch: {costs}); no verify past "
                f"{self.buckets[-1]} decoding requests"
            )
        return "every step verifies drafts"

    def cost(self, decoding: int) -> float | None:
        """Verify over paused step time at this batch; None past the graphed verify batches."""
        i = bisect_left(self.buckets, decoding)
        return self.costs[i] if i < len(self.buckets) else None

    def verify(self, decoding: int) -> bool:
        if self.limit:
            return decoding <= self.limit
        if not self.buckets:
            return True
        cost = self.cost(decoding)
        if cost is None:
            return False
        if self.accept_len is None or self.accept_len >= cost:
            return True
        return self._paused >= PROBE_EVERY - 1  # a probe

    def planned(self, verified: bool) -> None:
        """A step of decodes was planned, verifying drafts or not."""
        self._paused = 0 if verified else self._paused + 1

    def observe(self, verify_chunks: int, accepted_tokens: int) -> None:
        """One verify step's result: its chunks and the draft tokens they accepted."""
        if verify_chunks:
            length = 1.0 + accepted_tokens / verify_chunks
            last = self.accept_len
            self.accept_len = length if last is None else last + ACCEPT_EMA * (length - last)
