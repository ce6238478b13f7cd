"""A fake worker that executes StepPlans deterministically, and driver loops (in lockstep, and
pipelined like the engine loop); imported by the scheduler tests in this folder (pytest's default
`prepend` import mode puts it on sys.path).

The fake worker checks the seam contract on every step: chunk starts follow the worker's own
progress, `sample` is set exactly when a chunk reaches the last known token, no KV slot is written
while a live request reads it, and every position a chunk "attends" to holds its own token. Prefix
hits: the cached KV slots must hold the request's tokens, and the restored snapshot (the fake
"linear state" is the token sequence it covers) must cover exactly the cached positions.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from appliance.config import SchedulerConfig
from appliance.messages import SampledTokens, StepPlan, StepResult
from appliance.router import FinishReason, Request, Scheduler

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The fake model: a hash of the whole history, so a wrong recompute changes the output."""
    h = 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % VOCAB


class FakeWorker:
    def __init__(self, num_kv_slots: int, sample_fn=None) -> None:
        # sample_fn(tokens, sampling, num_prompt_tokens) -> next token; default: `next_token`
        self.sample_fn = sample_fn or (lambda tokens, sampling, num_prompt: next_token(tokens))
        self.sampling: dict[int, object] = {}  # req_slot -> SamplingOptions
        self.num_prompt: dict[int, int] = {}  # req_slot -> prompt tokens at the head of tokens
        self.tokens: dict[int, list[int]] = {}  # req_slot -> every known token
        self.computed: dict[int, int] = {}  # req_slot -> positions computed
        self.req_to_token: dict[int, list[int]] = {}  # req_slot -> kv slot per computed position
        self.kv_readers = [0] * num_kv_slots  # kv -> live requests whose positions use it
        self.kv_value: list[int | None] = [None] * num_kv_slots  # kv -> token written there
        self.snapshots: dict[int, tuple[int, ...]] = {}  # snapshot slot -> tokens it covers
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for save in plan.snapshot_saves:
            assert save.req_slot in self.tokens, f"snapshot of slot {save.req_slot}: not live"
            covered = self.computed[save.req_slot]
            self.snapshots[save.snapshot] = tuple(self.tokens[save.req_slot][:covered])
        for slot in plan.released_slots:
            assert slot in self.tokens, f"released slot {slot} was not live"
            for kv in self.req_to_token.pop(slot):
                self.kv_readers[kv] -= 1
            del self.tokens[slot], self.computed[slot]
        for new in plan.new_requests:
            assert new.req_slot not in self.tokens, f"slot {new.req_slot} reused before release"
            assert new.sampling.seed is not None
            self.tokens[new.req_slot] = list(new.token_ids)
            self.sampling[new.req_slot] = new.sampling
            assert 1 <= new.num_prompt_tokens <= len(new.token_ids)
            self.num_prompt[new.req_slot] = new.num_prompt_tokens
            cached = list(new.cached_kv_slots)
            for pos, kv in enumerate(cached):
                assert self.kv_value[kv] == new.token_ids[pos], (
                    f"cached kv {kv} holds another token"
                )
                self.kv_readers[kv] += 1
            if new.restore_snapshot >= 0:
                restored = self.snapshots[new.restore_snapshot]
                assert restored == tuple(new.token_ids[: len(cached)]), "snapshot of another prefix"
            self.computed[new.req_slot] = len(cached)
            self.req_to_token[new.req_slot] = cached
        assert len({c.req_slot for c in plan.chunks}) == len(plan.chunks), "slot twice in one step"
        sampled = []
        for chunk in plan.chunks:
            sampled_token = self._run_chunk(chunk)
            if sampled_token is not None:
                sampled.append(SampledTokens(chunk.req_slot, [sampled_token]))
        return StepResult(plan.step_id, sampled)

    def _run_chunk(self, chunk) -> int | None:
        slot, start, n = chunk.req_slot, chunk.start, chunk.num_tokens
        tokens = self.tokens[slot]
        assert n >= 1 and len(chunk.kv_slots) == n
        assert start == self.computed[slot], (
            f"chunk starts at {start}, computed {self.computed[slot]}"
        )
        if chunk.num_draft:  # an MTP verify: its drafts are all rejected (the router frees
            # the KV slots of rows past the first), so one token comes back
            assert n == chunk.num_draft + 1 and chunk.sample
            assert start + 1 == len(tokens), "a verify starts at the last known token"
            n = 1
        assert start + n <= len(tokens), "chunk past the known tokens"
        assert chunk.sample == (start + n == len(tokens))
        for i, kv in enumerate(chunk.kv_slots[:n]):
            assert self.kv_readers[kv] == 0, f"kv slot {kv} written while a live request reads it"
            self.kv_readers[kv] += 1
            self.kv_value[kv] = tokens[start + i]
            self.req_to_token[slot].append(kv)
        self.computed[slot] = start + n
        if chunk.save_snapshot >= 0:
            self.snapshots[chunk.save_snapshot] = tuple(tokens[: start + n])
        for pos, kv in enumerate(self.req_to_token[slot]):  # "attention" reads every position
            assert self.kv_value[kv] == tokens[pos]
        if not chunk.sample:
            return None
        token = self.sample_fn(tokens, self.sampling[slot], self.num_prompt[slot])
        tokens.append(token)
        return token


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    reasons: dict[str, FinishReason] = field(default_factory=dict)
    finish_order: list[str] = field(default_factory=list)
    steps: int = 0
    max_step_tokens: int = 0


def make_scheduler(
    num_kv_slots: int = 1000,
    max_model_len: int = 1000,
    max_num_seqs: int = 8,
    budget: int = 64,
    **kwargs,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, num_kv_slots, max_model_len, rng_seed=0, **kwargs)


def run(
    sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000, keep_cache: bool = False
) -> RunResult:
    """Drives schedule -> execute -> update until no work is left; checks the budget per step and
    (unless `keep_cache`: later requests should hit it) that no slot leaked."""
    result = RunResult()
    budget = sched.config.max_num_batched_tokens
    while sched.has_work():
        assert result.steps < max_steps, "no progress"
        plan = sched.schedule()
        assert plan is not None, "work left but nothing scheduled"
        step_tokens = sum(c.num_tokens for c in plan.chunks)
        assert step_tokens <= budget
        result.max_step_tokens = max(result.max_step_tokens, step_tokens)
        for out in sched.update(worker.execute(plan)):
            result.tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                result.reasons[out.req_id] = out.finish_reason
                result.finish_order.append(out.req_id)
        result.steps += 1
    if not keep_cache:
        assert_pools_empty(sched)
    return result


def run_pipelined(
    sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000, keep_cache: bool = False
) -> RunResult:
    """Like `run`, but as the engine loop drives the workers: step N+1 is planned (and executed by
    the fake worker) before step N's result is applied; the oldest result is applied once two
    steps are out or nothing new could be planned."""
    result, inflight = RunResult(), []
    while sched.has_work() or inflight:
        assert result.steps < max_steps, "no progress"
        plan = sched.schedule() if sched.has_work() else None
        if plan is not None:
            inflight.append(worker.execute(plan))
            result.max_step_tokens = max(
                result.max_step_tokens, sum(c.num_tokens for c in plan.chunks)
            )
            result.steps += 1
        assert plan is not None or inflight, "work left but nothing scheduled or in flight"
        if inflight and (plan is None or len(inflight) >= 2):
            for out in sched.update(inflight.pop(0)):
                result.tokens[out.req_id].extend(out.new_token_ids)
                if out.finished:
                    result.reasons[out.req_id] = out.finish_reason
                    result.finish_order.append(out.req_id)
    if not keep_cache:
        assert_pools_empty(sched)
    return result


def assert_pools_empty(sched: Scheduler) -> None:
    """No slot leaked: once the prefix cache lets go of everything, every pool is free."""
    if sched.cache is not None:
        sched.cache.clear()
        assert sched.cache.num_nodes == 0 and sched.cache.num_tokens == 0
    assert sched.snapshots.num_used == 0
    assert sched.kv.num_used == 0 and sched.kv.num_free == sched.kv.num_total
    assert sched.req_slots.num_used == 0
    assert not sched.running and not sched.waiting


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def prompt_of(length: int, salt: int) -> list[int]:
    return [(salt * 7 + i * 3) % VOCAB for i in range(length)]


def req(req_id: str, prompt: list[int], max_tokens: int, **kwargs) -> Request:
    return Request(req_id=req_id, prompt_token_ids=prompt, max_tokens=max_tokens, **kwargs)
