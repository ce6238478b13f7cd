"""The scheduler driven as the engine loop drives it: step N+1 is planned before step N's result
arrives. Decodes of in-flight tokens are planned at once; eos, stop and max_tokens that land while
the next step is out never leak a token or a slot; MTP requests wait for their accept length."""

from __future__ import annotations

import pytest
from fake_worker import (
    FakeWorker,
    make_scheduler,
    next_token,
    prompt_of,
    reference_tokens,
    req,
    run_pipelined,
)

from appliance.config import SchedulerConfig
from appliance.messages import SampledTokens, SamplingOptions, StepResult
from appliance.router import FinishReason, Scheduler


@pytest.mark.parametrize("budget", [4, 64])
def test_pipelined_tokens_equal_lockstep(budget: int) -> None:
    sched = make_scheduler(budget=budget, max_num_seqs=4)
    worker = FakeWorker(1000)
    prompts = {f"r{i}": prompt_of(3 + 7 * i, salt=i) for i in range(6)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(req(rid, prompt, max_tokens=1 + 3 * i))
    out = run_pipelined(sched, worker)  # pools empty at the end
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert out.tokens[rid] == reference_tokens(prompt, 1 + 3 * i)
        assert out.reasons[rid] is FinishReason.LENGTH


def test_decode_of_an_inflight_token_is_planned_before_its_result() -> None:
    sched = make_scheduler()
    worker = FakeWorker(100)
    prompt = prompt_of(5, salt=3)
    sched.add_request(req("a", prompt, max_tokens=4))
    first = sched.schedule()
    result0 = worker.execute(first)
    second = sched.schedule()  # step 0's token is not known to the router yet
    assert [(c.start, c.num_tokens, c.sample) for c in second.chunks] == [(5, 1, True)]
    assert sched.schedule() is None  # two tokens in flight per request at most
    result1 = worker.execute(second)
    sched.update(result0)
    third = sched.schedule()
    assert [(c.start, c.sample) for c in third.chunks] == [(6, True)]
    sched.update(result1)
    assert sched.get_request("a").output_token_ids == worker.tokens[0][5:7]


def test_no_decode_planned_past_max_tokens() -> None:
    sched = make_scheduler()
    worker = FakeWorker(100)
    sched.add_request(req("a", prompt_of(4, salt=1), max_tokens=2))
    results = [worker.execute(sched.schedule()), worker.execute(sched.schedule())]
    assert sched.schedule() is None  # the pending token is the last one
    outs = [o for r in results for o in sched.update(r)]
    assert [len(o.new_token_ids) for o in outs] == [1, 1] and outs[-1].finished
    assert sched.stats().kv_used == 0 and sched.req_slots.num_used == 0


def test_eos_while_the_next_step_is_out_leaks_nothing() -> None:
    eos = next_token(prompt_of(6, salt=2))  # the first sampled token is eos
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), 100, 100)
    worker = FakeWorker(100)
    sched.add_request(req("a", prompt_of(6, salt=2), max_tokens=10, eos_token_ids={eos}))
    result0 = worker.execute(sched.schedule())
    result1 = worker.execute(sched.schedule())  # planned before eos is seen
    (out,) = sched.update(result0)
    assert out.finished and out.finish_reason is FinishReason.STOP and out.new_token_ids == [eos]
    assert sched.stats().kv_used == 0 and sched.req_slots.num_used == 0  # freed at once
    assert sched.update(result1) == []  # the extra step's token is dropped
    plan = sched.schedule()
    assert plan is None and not sched.has_work()
    # the next request reuses the freed slots only in a later step: the worker sees the release
    sched.add_request(req("b", prompt_of(3, salt=9), max_tokens=1))
    plan = sched.schedule()
    assert plan.released_slots == [0] and plan.new_requests[0].req_slot == 0


def test_mtp_request_waits_for_its_accept_length() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, mtp_step=2)
    sched = Scheduler(config, 100, 100, rng_seed=0)
    sched.add_request(req("a", prompt_of(4, salt=1), max_tokens=10, sampling=SamplingOptions()))
    prefill = sched.schedule()
    assert sched.schedule() is None  # its first token is in flight: nothing more to plan
    sched.update(StepResult(prefill.step_id, [SampledTokens(0, [7])]))
    verify = sched.schedule()
    assert verify.chunks[0].num_draft == 2
    assert sched.schedule() is None  # 1..3 tokens will come back: wait for them


@pytest.mark.parametrize("limit,worker_limit", [(2, 0), (0, 2), (2, 8)])
def test_mtp_steps_over_the_batch_limit_verify_no_drafts(limit, worker_limit) -> None:
    """--mtp-disable-batch-size (else, at 0, the worker's largest graphed verify batch): a step
    with more decoding requests than the limit plans one-row decodes (counted as paused steps);
    once few enough decode, the next step verifies drafts again."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, mtp_step=2, mtp_disable_batch_size=limit
    )
    sched = Scheduler(config, 100, 100, rng_seed=0, mtp_verify_max_bs=worker_limit)
    ends = {"a": 3, "b": 6, "c": 9}
    for i, (rid, max_tokens) in enumerate(ends.items()):
        sched.add_request(req(rid, prompt_of(4, salt=i), max_tokens=max_tokens))
    prefill = sched.schedule()
    three = [SampledTokens(slot, [7]) for slot in range(3)]
    sched.update(StepResult(prefill.step_id, three))
    drafts, paused = [], 0
    while sched.has_work():
        plan = sched.schedule()
        drafts.append(sorted({c.num_draft for c in plan.chunks}))
        if len(plan.chunks) > 2:
            assert drafts[-1] == [0] and all(c.num_tokens == 1 for c in plan.chunks)
            paused += 1
        else:  # two or one decoding: drafts verified (clamped to max_tokens near the end)
            assert drafts[-1] != [0] or all(c.num_tokens == 1 for c in plan.chunks)
        # every draft rejected: one token per request and step
        got = [SampledTokens(c.req_slot, [8]) for c in plan.chunks]
        sched.update(StepResult(plan.step_id, got))
    assert paused == 2  # "a" (3 tokens) decodes twice beside the others, then ends
    assert drafts[2] == [2]  # the step after: "b" and "c" verify 2 drafts each
    stats = sched.stats()
    assert stats.mtp_paused_steps == 2 and stats.mtp_drafts > 0


def test_by_default_the_worker_costs_and_the_accept_length_decide() -> None:
    """No --mtp-disable-batch-size and the worker's measured verify costs: steps verify while
    the accept length seen pays for the cost at their batch; drafts that are never accepted
    pause the verifies (all but a probe now and then)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, mtp_step=2)
    costs = {1: 1.1, 2: 1.2, 4: 2.0}
    sched = Scheduler(config, 1000, 1000, rng_seed=0, mtp_verify_max_bs=4, mtp_verify_costs=costs)
    for i in range(2):
        sched.add_request(req(f"r{i}", prompt_of(4, salt=i), max_tokens=60))
    prefill = sched.schedule()
    sched.update(StepResult(prefill.step_id, [SampledTokens(s, [7]) for s in (0, 1)]))
    kinds = []
    for _ in range(40):
        plan = sched.schedule()
        verify = {c.num_draft for c in plan.chunks} == {2}
        kinds.append(verify)
        # a verify accepts both drafts in the first two steps, none after
        tokens = [8, 9, 10] if verify and len(kinds) <= 2 else [8]
        sched.update(
            StepResult(plan.step_id, [SampledTokens(c.req_slot, tokens) for c in plan.chunks])
        )
    assert kinds[:2] == [True, True]  # unmeasured, then accept length 3 > 1.2
    # 3, then decaying by a fifth of the way to 1 per verify that accepts nothing: 2.6, 2.28,
    # 2.02, 1.82, 1.66, 1.52, 1.42, 1.34, 1.27, 1.21 (each still >= 1.2, the cost at two
    # requests), then 1.17: eleven more verifies, then a probe every 16th step
    assert kinds[2:13] == [True] * 11 and not any(kinds[13:28]) and kinds[28]
    assert sched.stats().mtp_paused_steps == kinds.count(False)


def test_probes_verify_while_paused_steps_overlap() -> None:
    """Drafts never accepted (the fake worker rejects them all): after the first verify the cost
    rule pauses, the paused steps are planned while others are in flight, and still every 16th
    step verifies (it waits for the steps in flight): acceptance keeps being measured."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, mtp_step=2)
    costs = {1: 1.1, 2: 1.2, 4: 2.0}
    sched = Scheduler(config, 1000, 1000, rng_seed=0, mtp_verify_max_bs=4, mtp_verify_costs=costs)
    prompts = {f"r{i}": prompt_of(4 + i, salt=i) for i in range(3)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=70, sampling=SamplingOptions()))
    worker = FakeWorker(1000)
    verifies, overlapped = [], []
    execute = worker.execute

    def spy(plan):
        if any(c.num_draft for c in plan.chunks):
            verifies.append(len(sched._inflight))
        elif len(plan.chunks) > 1 and all(c.num_tokens == 1 for c in plan.chunks):
            overlapped.append(len(sched._inflight))
        return execute(plan)

    worker.execute = spy
    out = run_pipelined(sched, worker)
    for rid, prompt in prompts.items():
        assert out.tokens[rid] == reference_tokens(prompt, 70)
    assert max(overlapped) == 2 and set(verifies) == {1}
    assert len(verifies) >= 4  # the first, then probes in about 68 paused steps


def test_steps_over_the_mtp_verify_limit_overlap_like_plain_decodes() -> None:
    """Driven as the engine loop drives it: a step over the verify limit is planned while the
    previous one is in flight when both are one-row decodes; a verify never is, and no step is
    planned while one is in flight. Every token is the reference's, no slot leaks."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, mtp_step=2, mtp_disable_batch_size=2
    )
    sched = Scheduler(config, 1000, 1000, rng_seed=0)
    prompts = {f"r{i}": prompt_of(4 + i, salt=i) for i in range(5)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(req(rid, prompt, max_tokens=4 + 6 * i, sampling=SamplingOptions()))
    worker = FakeWorker(1000)
    overlapped, verified = [], []
    execute = worker.execute

    def spy(plan):
        drafts = {c.num_draft for c in plan.chunks}
        (verified if drafts - {0} else overlapped).append(len(sched._inflight))
        return execute(plan)

    worker.execute = spy
    out = run_pipelined(sched, worker)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert out.tokens[rid] == reference_tokens(prompt, 4 + 6 * i)
    assert verified and max(verified) == 1  # a verify is planned with nothing else in flight
    assert max(overlapped) == 2  # one-row steps were planned with another in flight
    assert sched.stats().mtp_paused_steps > 0
    # a verify in flight: nothing more is planned (not even a new request's prefill) until it lands
    for i in range(2):
        sched.add_request(req(f"v{i}", prompt_of(4, salt=20 + i), max_tokens=9))
    prefill = sched.schedule()
    sched.update(
        StepResult(prefill.step_id, [SampledTokens(c.req_slot, [7]) for c in prefill.chunks])
    )
    verify = sched.schedule()
    assert {c.num_draft for c in verify.chunks} == {2}
    sched.add_request(req("late", prompt_of(4, salt=30), max_tokens=3))
    assert sched.schedule() is None


def test_mtp_request_reports_its_verify_counts() -> None:
    """Each output of a request that reports them (report_spec) carries its MTP counts so far
    (SGLang's per-request meta_info): verify steps by draft length and drafts accepted; a step
    that max_tokens clamps counts the drafts it had. Others carry none."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, mtp_step=2)
    sched = Scheduler(config, 100, 100, rng_seed=0)
    counted = req("a", prompt_of(4, salt=1), max_tokens=7, sampling=SamplingOptions())
    counted.report_spec = True  # the server asks where the answer words them
    sched.add_request(counted)
    sched.add_request(req("b", prompt_of(4, salt=2), max_tokens=7, sampling=SamplingOptions()))
    prefill = sched.schedule()
    both = [SampledTokens(0, [7]), SampledTokens(1, [7])]
    assert [o.spec for o in sched.update(StepResult(prefill.step_id, both))] == [None, None]
    counts = []
    # both drafts accepted; none of two; the one draft that fits max_tokens, accepted
    for drafts, tokens in ((2, [8, 9, 10]), (2, [11]), (1, [12, 13])):
        plan = sched.schedule()
        assert [c.num_draft for c in plan.chunks] == [drafts, drafts]
        both = [SampledTokens(0, tokens), SampledTokens(1, tokens)]
        out, other = sched.update(StepResult(plan.step_id, both))
        assert other.spec is None
        counts.append((out.spec.draft_tokens, out.spec.histogram, out.spec.by_length))
    assert counts == [
        (2, [0, 0, 1], [[0, 0], [0, 0, 1]]),
        (4, [1, 0, 1], [[0, 0], [1, 0, 1]]),
        (5, [1, 1, 1], [[0, 1], [1, 0, 1]]),
    ]
    assert out.finished and out.spec.verify_steps == 3 and out.spec.accepted_tokens == 3


def test_a_request_that_reports_timing_gets_its_times() -> None:
    """report_timing (the server's --enable-per-request-metrics): each output carries the
    request's queue, first-token and decode times, measured where the Scheduler admits it and
    takes its tokens; others carry none."""
    sched = make_scheduler(max_num_seqs=1)
    worker = FakeWorker(100)
    timed = req("t", prompt_of(4, salt=1), max_tokens=3)
    timed.report_timing = True
    sched.add_request(req("a", prompt_of(4, salt=2), max_tokens=3))
    sched.add_request(timed)  # waits for "a"'s seat
    outs: dict[str, list] = {"a": [], "t": []}
    while sched.has_work():
        for out in sched.update(worker.execute(sched.schedule())):
            outs[out.req_id].append(out)
    assert all(out.timing is None for out in outs["a"])
    times = [out.timing for out in outs["t"]]
    assert len(times) == 3 and times[0].generation_s == 0.0
    assert times[0].queue_s > 0 and times[0].ttft_s > 0  # it queued behind "a"'s three steps
    assert {t.queue_s for t in times} == {times[0].queue_s}
    assert {t.ttft_s for t in times} == {times[0].ttft_s}
    assert 0 < times[1].generation_s < times[2].generation_s
