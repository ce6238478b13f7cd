"""Priority scheduling (vLLM's --scheduling-policy priority): the queue admits lower priority
values first, arrival order among equals; a decode without KV preempts the running request of the
highest value; fcfs ignores priorities. Against the fake worker."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, assert_pools_empty, prompt_of, reference_tokens, req, run

from appliance.config import SchedulerConfig
from appliance.router import RequestStatus
from appliance.router.scheduler import Scheduler
from appliance.router.wait_queue import WaitQueue


def scheduler(policy: str, num_kv_slots: int = 1000, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy
    )
    return Scheduler(config, num_kv_slots, 1000, rng_seed=0, decode_reserve=0)


def admission_order(sched: Scheduler, worker: FakeWorker) -> list[str]:
    order: list[str] = []
    plan = sched.schedule()
    while plan is not None:
        for new in plan.new_requests:
            rid = next(r.req_id for r in sched.running if r.req_slot == new.req_slot)
            if rid not in order:
                order.append(rid)
        sched.update(worker.execute(plan))
        plan = sched.schedule()
    return order


@pytest.mark.parametrize(
    ("policy", "expected"), [("priority", ["c", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d"])]
)
def test_queue_order_follows_the_policy(policy: str, expected: list[str]) -> None:
    sched = scheduler(policy, max_num_seqs=1)
    for rid, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        sched.add_request(req(rid, prompt_of(3, ord(rid)), max_tokens=2, priority=priority))
    assert admission_order(sched, FakeWorker(1000)) == expected
    assert_pools_empty(sched)


def test_preemption_takes_the_highest_priority_value_first() -> None:
    """a (priority 9, admitted first) is the victim, not c (the newest, priority 0); it goes back
    to the queue ahead of a later arrival of its priority, and every request ends right."""
    sched = scheduler("priority", num_kv_slots=24)
    worker = FakeWorker(24)
    prompts = {"a": prompt_of(10, 0), "b": prompt_of(10, 1), "c": prompt_of(4, 2)}
    for rid, priority in (("a", 9), ("b", 0), ("c", 0)):
        sched.add_request(req(rid, prompts[rid], max_tokens=5, priority=priority))
    first = sched.schedule()
    assert len(first.new_requests) == 3 and sched.kv.num_free == 0
    tokens = {rid: [] for rid in prompts}
    for o in sched.update(worker.execute(first)):
        tokens[o.req_id] += o.new_token_ids
    prompts["late"], tokens["late"] = prompt_of(1, 3), []
    sched.add_request(req("late", prompts["late"], max_tokens=2, priority=9))
    plan = sched.schedule()  # a decode needs a slot
    a = sched.get_request("a")
    assert a.status is RequestStatus.WAITING and a.num_preemptions == 1
    assert sched.get_request("c").status is RequestStatus.RUNNING
    assert [r.req_id for r in sched.waiting] == ["a", "late"]
    for o in sched.update(worker.execute(plan)):
        tokens[o.req_id] += o.new_token_ids
    for rid, more in run(sched, worker).tokens.items():
        tokens[rid] += more
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_tokens(prompt, 2 if rid == "late" else 5), rid


def test_wait_queue() -> None:
    queue = WaitQueue("priority")
    made = {rid: req(rid, [1], 1, priority=p) for rid, p in (("x", 2), ("y", 1), ("z", 2))}
    for r in made.values():
        queue.append(r)
    assert [r.req_id for r in queue] == ["y", "x", "z"] and queue[0] is made["y"]
    queue.remove(made["x"])
    assert queue.popleft() is made["y"] and len(queue) == 1
    queue.appendleft(made["x"])  # back, ahead of z (a later arrival of its priority)
    assert [r.req_id for r in queue] == ["x", "z"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        WaitQueue("lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
