"""Scheduler under KV pressure (preemption + recompute) and aborts, against the fake worker."""

from __future__ import annotations

import random

import pytest
from fake_worker import (
    FakeWorker,
    assert_pools_empty,
    make_scheduler,
    prompt_of,
    reference_tokens,
    req,
    run,
)

from appliance.router import FinishReason, RequestStatus


@pytest.mark.parametrize("budget", [5, 16, 64])
def test_preemption_completes_every_request_with_unpressured_tokens(budget: int) -> None:
    prompts = {f"r{i}": prompt_of(10, i) for i in range(6)}
    sched = make_scheduler(num_kv_slots=40, budget=budget, max_num_seqs=6, decode_reserve=0)
    worker = FakeWorker(40)
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=20))  # peak 29 of 40 slots each
    out = run(sched, worker)
    stats = sched.stats()
    assert stats.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert out.tokens[rid] == reference_tokens(prompt, 20)
        assert out.reasons[rid] is FinishReason.LENGTH
    # re-admission resends prompt + generated tokens
    resent = [n for p in worker.plans for n in p.new_requests if len(n.token_ids) > 10]
    assert resent and all(n.token_ids[:10] in prompts.values() for n in resent)
    assert all(n.num_prompt_tokens == 10 for p in worker.plans for n in p.new_requests)
    assert stats.num_prompt_tokens == 60  # recompute is not counted as prompt again
    assert stats.num_generation_tokens == 120
    assert stats.num_computed_tokens > 60 + 6 * 19


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_match_reference_under_pressure(seed: int) -> None:
    rng = random.Random(seed)
    num_kv = rng.choice([32, 48, 80])
    sched = make_scheduler(
        num_kv_slots=num_kv,
        budget=rng.choice([1, 3, 8, 32]),
        max_num_seqs=rng.choice([1, 3, 8]),
        decode_reserve=rng.choice([0, 2, 16]),
    )
    worker = FakeWorker(num_kv)
    expected = {}
    for i in range(10):
        prompt = prompt_of(rng.randint(1, 20), salt=100 * seed + i)
        max_tokens = rng.randint(1, num_kv - len(prompt) + 1)
        sched.add_request(req(f"r{i}", prompt, max_tokens=max_tokens))
        expected[f"r{i}"] = reference_tokens(prompt, max_tokens)
    out = run(sched, worker)
    assert dict(out.tokens) == expected


def test_preempts_most_recently_admitted_and_requeues_it_first() -> None:
    sched = make_scheduler(num_kv_slots=24, budget=64, decode_reserve=0)
    worker = FakeWorker(24)
    sched.add_request(req("a", prompt_of(10, 0), max_tokens=5))
    sched.add_request(req("b", prompt_of(10, 1), max_tokens=5))
    sched.add_request(req("c", prompt_of(4, 2), max_tokens=5))
    sched.add_request(req("d", prompt_of(1, 3), max_tokens=2))
    first = sched.schedule()
    assert len(first.new_requests) == 3 and sched.kv.num_free == 0
    sched.update(worker.execute(first))
    c = sched.get_request("c")
    c_slot = c.req_slot
    plan = sched.schedule()  # a's decode needs a slot: c (newest) goes
    assert c.status is RequestStatus.WAITING and c.num_preemptions == 1
    assert [r.req_id for r in sched.waiting] == ["c", "d"]
    assert plan.released_slots == [c_slot] and plan.new_requests == []
    assert [ch.req_slot for ch in plan.chunks] == [sched.get_request(x).req_slot for x in "ab"]
    sched.update(worker.execute(plan))
    out = run(sched, worker)
    readmit = [n.token_ids for p in worker.plans[2:] for n in p.new_requests]
    assert prompt_of(4, 2) + reference_tokens(prompt_of(4, 2), 1) in readmit
    assert out.tokens["c"] == reference_tokens(prompt_of(4, 2), 5)[1:]


def test_abort_mid_prefill_frees_slots_at_once() -> None:
    sched = make_scheduler(budget=4)
    worker = FakeWorker(1000)
    sched.add_request(req("a", prompt_of(20, 0), max_tokens=5))
    for _ in range(2):
        assert sched.update(worker.execute(sched.schedule())) == []
    a_slot = sched.get_request("a").req_slot
    assert sched.kv.num_used == 20
    sched.abort("a")
    assert sched.stats().kv_used == 0 and sched.req_slots.num_used == 0
    assert sched.schedule() is None and not sched.has_work()
    sched.add_request(req("b", prompt_of(3, 1), max_tokens=2))
    plan = sched.schedule()
    assert plan.released_slots == [a_slot]
    assert plan.new_requests[0].req_slot == a_slot  # reused after the worker saw the release
    out = run_rest(sched, worker, plan)
    assert out == reference_tokens(prompt_of(3, 1), 2)
    assert_pools_empty(sched)


def run_rest(sched, worker, plan) -> list[int]:
    tokens = []
    while plan is not None:
        for o in sched.update(worker.execute(plan)):
            tokens += o.new_token_ids
        plan = sched.schedule()
    return tokens


def test_abort_waiting_unknown_finished_and_preempted_requests() -> None:
    sched = make_scheduler(num_kv_slots=24, decode_reserve=0, max_num_seqs=2)
    worker = FakeWorker(24)
    sched.add_request(req("a", prompt_of(10, 0), max_tokens=8))
    sched.add_request(req("b", prompt_of(10, 1), max_tokens=8))
    sched.add_request(req("w", prompt_of(2, 2), max_tokens=2))
    sched.abort("w")  # waiting: just dequeued
    assert [r.req_id for r in sched.waiting] == ["a", "b"]
    sched.abort("nope")
    a_tokens = []
    for _ in range(
        4
    ):  # prefill, then a and b decode until the pool (24) is full and b is preempted
        for o in sched.update(worker.execute(sched.schedule())):
            a_tokens += o.new_token_ids if o.req_id == "a" else []
    assert sched.get_request("b").status is RequestStatus.WAITING
    sched.abort("b")
    sched.abort("b")
    assert sched.get_request("b") is None and not sched.waiting
    out = run(sched, worker)
    assert a_tokens + out.tokens["a"] == reference_tokens(prompt_of(10, 0), 8)
    assert sched.stats().num_finished == 3 and sched.stats().num_preemptions == 1
