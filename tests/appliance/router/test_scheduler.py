"""Scheduler behaviour against the fake worker: chunking, budget, decode-first order, finish rules,
rejection, FIFO admission and stats."""

from __future__ import annotations

import pytest
from fake_worker import (
    FakeWorker,
    assert_pools_empty,
    make_scheduler,
    prompt_of,
    reference_tokens,
    req,
    run,
    run_pipelined,
)

from appliance.messages import SampledTokens, SamplingOptions, StepResult
from appliance.router import (
    FinishReason,
    InvalidRequest,
    QueueFull,
    RequestStatus,
    RequestTooLong,
    SchedulerError,
)


@pytest.mark.parametrize("budget", [1, 3, 4, 10, 11, 64])
def test_chunked_prefill_splits_prompt_by_budget(budget: int) -> None:
    sched = make_scheduler(budget=budget)
    worker = FakeWorker(1000)
    prompt = prompt_of(10, salt=1)
    sched.add_request(req("a", prompt, max_tokens=3))
    out = run(sched, worker)
    chunks = [(c.start, c.num_tokens, c.sample) for p in worker.plans for c in p.chunks]
    expected, start = [], 0
    while start < 10:
        n = min(budget, 10 - start)
        expected.append((start, n, start + n == 10))
        start += n
    expected += [(10, 1, True), (11, 1, True)]  # two decodes after the prefill sampled token 1
    assert chunks == expected
    assert out.tokens["a"] == reference_tokens(prompt, 3)
    assert out.reasons["a"] is FinishReason.LENGTH


@pytest.mark.parametrize("budget", [2, 7, 32])
def test_budget_never_exceeded_and_filled_when_work_exists(budget: int) -> None:
    sched = make_scheduler(budget=budget, max_num_seqs=4)
    worker = FakeWorker(1000)
    prompts = {f"r{i}": prompt_of(5 + 9 * i, salt=i) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=4 + i_of(rid)))
    out = run(sched, worker)  # asserts per-step tokens <= budget
    assert out.max_step_tokens == budget
    for rid, prompt in prompts.items():
        assert out.tokens[rid] == reference_tokens(prompt, 4 + i_of(rid))


def i_of(rid: str) -> int:
    return int(rid[1:])


def test_decodes_come_before_prefill_chunks() -> None:
    sched = make_scheduler(budget=4)
    worker = FakeWorker(1000)
    sched.add_request(req("a", prompt_of(2, 0), max_tokens=10))
    sched.update(worker.execute(sched.schedule()))  # a: prefill + first token
    sched.add_request(req("b", prompt_of(10, 1), max_tokens=2))
    plan = sched.schedule()
    a_slot = sched.get_request("a").req_slot
    assert [(c.req_slot, c.num_tokens) for c in plan.chunks][0] == (a_slot, 1)
    assert [c.num_tokens for c in plan.chunks] == [1, 3]
    assert [n.token_ids for n in plan.new_requests] == [prompt_of(10, 1)]


def test_max_tokens_eos_and_ignore_eos() -> None:
    prompt = prompt_of(6, 3)
    ref = reference_tokens(prompt, 12)
    eos = ref[4]
    first = ref.index(eos)
    sched = make_scheduler()
    sched.add_request(req("len", prompt, max_tokens=5))
    sched.add_request(req("eos", prompt, max_tokens=12, eos_token_ids={eos}))
    sched.add_request(req("ign", prompt, max_tokens=12, eos_token_ids={eos}, ignore_eos=True))
    sched.add_request(req("stop", prompt, max_tokens=12, stop_token_ids={ref[2]}, ignore_eos=True))
    out = run(sched, FakeWorker(1000))
    assert out.tokens["len"] == ref[:5] and out.reasons["len"] is FinishReason.LENGTH
    assert out.tokens["eos"] == ref[: first + 1] and out.reasons["eos"] is FinishReason.STOP
    assert out.tokens["ign"] == ref and out.reasons["ign"] is FinishReason.LENGTH
    assert out.tokens["stop"] == ref[: ref.index(ref[2]) + 1]
    assert out.reasons["stop"] is FinishReason.STOP


def test_stop_token_id_reported_in_output() -> None:
    prompt = prompt_of(3, 5)
    first = reference_tokens(prompt, 1)[0]
    sched = make_scheduler()
    worker = FakeWorker(1000)
    sched.add_request(req("a", prompt, max_tokens=8, eos_token_ids={first}))
    (output,) = sched.update(worker.execute(sched.schedule()))
    assert output.new_token_ids == [first] and output.finished
    assert output.finish_reason is FinishReason.STOP and output.stop_token_id == first
    assert_pools_empty(sched)


def test_rejects_impossible_requests() -> None:
    sched = make_scheduler(num_kv_slots=50, max_model_len=100)
    with pytest.raises(RequestTooLong, match="maximum context length is 100"):
        sched.add_request(req("ctx", prompt_of(90, 0), max_tokens=11))
    with pytest.raises(RequestTooLong, match="KV cache holds only 50"):
        sched.add_request(req("kv", prompt_of(40, 0), max_tokens=12))  # peak 51 slots
    sched.add_request(req("fits", prompt_of(40, 0), max_tokens=11))  # peak exactly 50
    with pytest.raises(InvalidRequest, match="prompt"):
        sched.add_request(req("empty", [], max_tokens=1))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sched.add_request(req("negative", [1], max_tokens=-1))
    with pytest.raises(InvalidRequest, match="already in use"):
        sched.add_request(req("fits", [1], max_tokens=1))
    assert isinstance(RequestTooLong("x", 1, 1, 1), ValueError)
    out = run(sched, FakeWorker(50))
    assert len(out.tokens["fits"]) == 11


@pytest.mark.parametrize("drive", [run, run_pipelined])
def test_max_tokens_zero_computes_the_prompt_and_drops_its_sample(drive) -> None:
    sched = make_scheduler(num_kv_slots=10, budget=4)
    worker = FakeWorker(10)
    sched.add_request(req("only-prompt", prompt_of(10, 0), max_tokens=0))  # 10 of 10 slots
    out = drive(sched, worker)
    assert out.tokens["only-prompt"] == [] and out.reasons["only-prompt"] is FinishReason.LENGTH
    assert sum(c.num_tokens for p in worker.plans for c in p.chunks) == 10  # no decode
    assert_pools_empty(sched)


def test_queue_full() -> None:
    from appliance.config import SchedulerConfig
    from appliance.router import Scheduler

    # max_waiting requests wait beyond the running batch's free seats: a burst the server admitted
    # (max_num_seqs + max_waiting sequences) is queued whole, and starts at the next step
    sched = Scheduler(SchedulerConfig(max_waiting=2, max_num_seqs=1), 100, 100)
    for name in "abc":
        sched.add_request(req(name, [1], 1))
    with pytest.raises(QueueFull):
        sched.add_request(req("d", [1], 1))
    sched.schedule()  # a runs: no free seat left, so the queue holds max_waiting
    assert [r.req_id for r in sched.running] == ["a"]
    with pytest.raises(QueueFull):
        sched.add_request(req("d", [1], 1))


def admitted_order(worker: FakeWorker, prompts: dict[str, list[int]]) -> list[str]:
    by_prompt = {tuple(p): rid for rid, p in prompts.items()}
    return [by_prompt[tuple(n.token_ids)] for plan in worker.plans for n in plan.new_requests]


def test_fifo_admission_by_request_slots() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=8)
    worker = FakeWorker(1000)
    prompts = {f"r{i}": prompt_of(n, i) for i, n in enumerate([30, 2, 3, 40, 1, 5])}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=3))
    out = run(sched, worker)
    assert admitted_order(worker, prompts) == list(prompts)
    assert sorted(out.finish_order) == sorted(prompts)


def test_fifo_head_blocked_on_kv_is_not_overtaken() -> None:
    sched = make_scheduler(num_kv_slots=60, budget=64, decode_reserve=0)
    worker = FakeWorker(60)
    prompts = {"a": prompt_of(40, 0), "b": prompt_of(30, 1), "c": prompt_of(3, 2)}
    sched.add_request(req("a", prompts["a"], max_tokens=10))
    sched.add_request(req("b", prompts["b"], max_tokens=2))
    sched.add_request(req("c", prompts["c"], max_tokens=2))
    plan = sched.schedule()
    # c (3 slots) would fit next to a, but b (30 slots) is ahead of it and does not
    assert len(plan.new_requests) == 1 and [r.req_id for r in sched.waiting] == ["b", "c"]
    first = sched.update(worker.execute(plan))
    out = run(sched, worker)
    assert admitted_order(worker, prompts) == ["a", "b", "c"]
    assert first[0].req_id == "a" and out.finish_order[0] == "a"
    assert sched.stats().num_preemptions == 0


def test_seed_drawn_once_at_admission_and_kept() -> None:
    sched = make_scheduler()
    a = req("a", [1, 2], 2)
    b = req("b", [1, 2], 2, sampling=SamplingOptions(seed=7))
    sched.add_request(a)
    sched.add_request(b)
    assert a.sampling.seed is not None and b.sampling.seed == 7
    plan = sched.schedule()
    assert [n.sampling.seed for n in plan.new_requests] == [a.sampling.seed, 7]


def test_update_rejects_unknown_step_and_missing_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(req("a", [1, 2], 2))
    plan = sched.schedule()
    with pytest.raises(SchedulerError, match="unknown"):
        sched.update(StepResult(plan.step_id + 5, []))
    with pytest.raises(SchedulerError, match="no sampled token"):
        sched.update(StepResult(plan.step_id, []))


def test_update_drops_tokens_of_request_aborted_in_flight() -> None:
    sched = make_scheduler()
    worker = FakeWorker(1000)
    sched.add_request(req("a", [1, 2, 3], 5))
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.abort("a")
    assert_pools_empty(sched)
    assert sched.update(result) == []
    assert sched.schedule() is None


def test_finish_ends_request_early_and_stats_count_tokens() -> None:
    sched = make_scheduler(budget=4)
    worker = FakeWorker(1000)
    sched.add_request(req("a", prompt_of(10, 2), 50))
    sched.add_request(req("b", prompt_of(3, 4), 2))
    generated = 0
    for _ in range(5):
        generated += sum(
            len(o.new_token_ids) for o in sched.update(worker.execute(sched.schedule()))
        )
    # steps: a 0-4 | a 4-8 | a 8-10 + b 0-2 | a dec + b 2-3 | a dec + b dec (b done, max_tokens 2)
    assert sched.get_request("a").num_output_tokens == 3 and sched.get_request("b") is None
    sched.finish("a", FinishReason.STOP)
    assert sched.get_request("a") is None and sched.stats().kv_used == 0
    out = run(sched, worker)
    generated += sum(len(t) for t in out.tokens.values())
    stats = sched.stats()
    assert stats.num_prompt_tokens == 13 and stats.num_generation_tokens == generated == 5
    assert stats.num_finished == 2 and stats.kv_used == 0 and stats.state_used == 0
    assert stats.num_computed_tokens == 13 + 3  # a's two decodes, b's one


def test_request_status_transitions() -> None:
    sched = make_scheduler()
    r = req("a", [1, 2], 1)
    sched.add_request(r)
    assert r.status is RequestStatus.WAITING
    plan = sched.schedule()
    assert r.status is RequestStatus.RUNNING and r.req_slot == plan.chunks[0].req_slot
    sched.update(StepResult(plan.step_id, [SampledTokens(r.req_slot, [9])]))
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == [9] and r.req_slot == -1
    assert_pools_empty(sched)
