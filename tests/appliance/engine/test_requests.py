"""The worker's request table: admission fills the token row, host mirrors and per-slot device
knobs; release frees the row; `append` writes new tokens and lengths; sampling offsets of plain
and verify chunks."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.requests import RequestTable
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk

GREEDY = SamplingOptions(temperature=0.0)
SAMPLED = SamplingOptions(temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, seed=1234)


def table(mtp_step: int = 0) -> RequestTable:
    return RequestTable(4, 16, mtp_step, torch.device("cpu"))


def test_admit_fills_tokens_mirrors_and_device_knobs():
    t = table()
    t.admit(
        [
            NewRequest(1, [5, 6, 7], SAMPLED, num_prompt_tokens=2),
            NewRequest(3, [9, 8], GREEDY),
        ]
    )
    assert t.token_ids[1, :3].tolist() == [5, 6, 7] and t.token_ids[3, :2].tolist() == [9, 8]
    assert t.options[1] == SAMPLED and t.options[3] == GREEDY and t.options[0] is None
    assert (t.num_tokens_host[1], t.prompt_len_host[1]) == (3, 2)
    assert (t.num_tokens_host[3], t.prompt_len_host[3]) == (2, 2)  # -1: every token is prompt
    assert t.num_tokens[[1, 3]].tolist() == [3, 2] and t.prompt_len[[1, 3]].tolist() == [2, 2]
    assert t.temperature[1].item() == pytest.approx(0.7) and t.temperature[3].item() == 0.0
    assert t.top_p[1].item() == pytest.approx(0.9) and t.top_k[[1, 3]].tolist() == [20, -1]
    assert t.min_p[1].item() == pytest.approx(0.1)
    assert t.seed[[1, 3]].tolist() == [1234, 0]  # no seed (greedy) -> 0


def test_admit_clamps_what_int64_cannot_hold():
    t = table()
    huge = SamplingOptions(temperature=0.0, top_k=2**70, seed=2**63 + 5)
    t.admit([NewRequest(0, [1], huge)])
    assert t.top_k[0].item() == 2**63 - 1 and t.seed[0].item() == 2**63 - 1
    assert t.options[0] == huge  # the sampler still sees the request's own values


def test_release_frees_the_row_and_mtp_needs_a_drafter():
    t = table(mtp_step=2)
    t.admit([NewRequest(2, [1, 2], GREEDY, num_draft=2)])
    assert t.uses_mtp(2) and not t.uses_mtp(0)
    t.release([2])
    assert t.options[2] is None and not t.uses_mtp(2) and t.num_tokens_host[2] == 0
    with pytest.raises(ValueError, match="MTP requested"):
        table(mtp_step=0).admit([NewRequest(0, [1], GREEDY, num_draft=1)])


def test_append_writes_tokens_and_lengths_for_all_requests():
    t = table()
    t.admit([NewRequest(0, [1, 2, 3], GREEDY), NewRequest(2, [4], GREEDY)])
    t.append([0, 2], [3, 1], [[10], [11, 12, 13]])
    assert t.token_ids[0, :4].tolist() == [1, 2, 3, 10]
    assert t.token_ids[2, :4].tolist() == [4, 11, 12, 13]
    assert t.num_tokens_host[0] == 4 and t.num_tokens_host[2] == 4
    assert t.num_tokens[[0, 2]].tolist() == [4, 4]
    t.append([], [], [])  # a step without plain samples


def test_sampling_offset_of_plain_and_verify_chunks():
    t = table(mtp_step=2)
    t.admit([NewRequest(0, [1, 2, 3, 4, 5], GREEDY, num_draft=2)])
    prefill_tail = ScheduledChunk(0, 3, 2, [3, 4], True)
    assert t.known_before_sampling(prefill_tail) == 5  # every known token
    verify = ScheduledChunk(0, 4, 3, [4, 5, 6], True, num_draft=2)
    assert t.known_before_sampling(verify) == 5  # the verify chunk's first row + 1
