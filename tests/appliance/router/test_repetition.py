"""vLLM's repetition_detection: the router ends a request whose output ends with a pattern of
min..max tokens repeated min_count times ("repetition"), on the token that completes it, also
inside an MTP step's accepted run; the params validate as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fake_worker import prompt_of, req

from appliance.config import SchedulerConfig
from appliance.messages import RepetitionCheck, SampledTokens, SamplingOptions, StepResult
from appliance.router import FinishReason, Scheduler
from appliance.sampling_params import SamplingParams


def test_found_at_the_end_only():
    check = RepetitionCheck(1, 3, 3)
    assert check.found([1, 7, 7, 7]) and check.found([4, 5, 6, 4, 5, 6, 4, 5, 6])
    assert check.found([9, 1, 2, 1, 2, 1, 2])
    assert not check.found([7, 7, 7, 1])  # it has to end the output
    assert not check.found([1, 2, 1, 2])  # twice is not three times
    assert not RepetitionCheck(2, 3, 3).found([7, 7, 7])  # one-token patterns not looked for
    assert not check.found([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4])  # longer than max


@dataclass
class Detection:  # an object with vLLM's RepetitionDetectionParams' attributes
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


def test_params_read_as_vllm_reads_them():
    dict_form = {"max_pattern_size": 4, "min_count": 3}
    assert SamplingParams(repetition_detection=dict_form).repetition_check() == RepetitionCheck(
        1, 4, 3
    )
    assert SamplingParams(
        repetition_detection=Detection(5, 2, 2)
    ).repetition_check() == RepetitionCheck(2, 5, 2)
    assert SamplingParams(repetition_detection=Detection()).repetition_check() is None
    assert SamplingParams().repetition_check() is None
    for bad, words in [
        ({"max_pattern_size": 2, "min_count": 1}, "min_count >= 2"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size"),
        ({"max_pattern_size": -1, "min_count": 2}, "integers >= 0"),
        ({"max_pattern": 2}, "keys among"),
    ]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(repetition_detection=bad)


def test_the_router_ends_the_request_where_the_repetition_completes():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, mtp_step=2)
    sched = Scheduler(config, 100, 100, rng_seed=0)
    request = req("r", prompt_of(4, salt=1), max_tokens=30, sampling=SamplingOptions())
    request.repetition = RepetitionCheck(1, 2, 3)
    sched.add_request(request)
    outs = []
    for tokens in ([5], [6, 5, 6], [5, 6, 9]):  # the prefill's token, then MTP runs
        plan = sched.schedule()
        outs += sched.update(StepResult(plan.step_id, [SampledTokens(0, tokens)]))
    assert [o.new_token_ids for o in outs] == [[5], [6, 5, 6], [5, 6]]  # 9 is dropped
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.REPETITION
    assert sched.stats().kv_used == 0 and not sched.has_work()
