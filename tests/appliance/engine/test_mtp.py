"""MTP accept/commit on the worker: the longest draft prefix that matches the main model's samples
(+1 bonus), the accepted tokens written into the request table after the verify chunk's first row,
and the GDN state committed at each request's last accepted row. The end-to-end lossless checks
are in tests/models/test_qwen3_5_mtp.py."""

from __future__ import annotations

import torch

from appliance.engine.mtp import accept, accept_and_commit, extend_rows
from appliance.engine.requests import RequestTable
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk

GREEDY = SamplingOptions(temperature=0.0)


class RecordingPools:
    """Stands in for the pools: records which verify row each slot commits."""

    def __init__(self) -> None:
        self.commits: list[tuple[list[int], list[int]]] = []

    def commit_verify(self, slots: torch.Tensor, accepted_rows: torch.Tensor) -> None:
        self.commits.append((slots.tolist(), accepted_rows.tolist()))


def test_accept_stops_at_the_first_mismatch_and_adds_the_main_sample():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all drafts right: k + 1 tokens
    assert accept([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # second draft wrong
    assert accept([1, 6, 7], [5, 6, 7, 8]) == [5]  # first draft wrong: the main sample only


def test_accept_and_commit_writes_tokens_and_commits_gdn_rows():
    table = RequestTable(4, 32, 3, torch.device("cpu"))
    table.admit(
        [
            NewRequest(0, [1, 2, 3, 4], GREEDY, num_draft=3),
            NewRequest(2, [1, 2, 3, 4, 5, 6], GREEDY, num_draft=3),
        ]
    )
    table.draft_tokens[0] = torch.tensor([20, 21, 22])
    table.draft_tokens[2] = torch.tensor([30, 31, 32])
    chunks = [  # each verifies its last known token + 3 drafts
        ScheduledChunk(0, 3, 4, [10, 11, 12, 13], True, num_draft=3),
        ScheduledChunk(2, 5, 4, [14, 15, 16, 17], True, num_draft=3),
    ]
    pools = RecordingPools()
    got = accept_and_commit(chunks, [[20, 21, 99, 98], [7, 31, 32, 33]], table, pools)
    assert got == [[20, 21, 99], [7]]
    assert table.token_ids[0, :7].tolist() == [1, 2, 3, 4, 20, 21, 99]
    assert table.token_ids[2, :7].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert table.num_tokens_host[0] == 7 and table.num_tokens_host[2] == 7
    assert table.num_tokens[[0, 2]].tolist() == [7, 7]
    assert pools.commits == [([0, 2], [2, 0])]
    assert accept_and_commit([], [], table, pools) == []  # no verify chunks: nothing committed
    assert len(pools.commits) == 1


def test_extend_rows_cuts_verify_chunks_to_their_accepted_rows():
    table = RequestTable(4, 32, 2, torch.device("cpu"))
    table.admit(
        [
            NewRequest(0, [1, 2, 3], GREEDY, num_draft=2),
            NewRequest(1, [1, 2], GREEDY),  # plain decoding: no draft rows
            NewRequest(3, [4, 5, 6, 7, 8], GREEDY, num_draft=2),
        ]
    )
    chunks = [
        ScheduledChunk(0, 0, 3, [0, 1, 2], True),  # prefill, samples
        ScheduledChunk(1, 1, 1, [3], True),
        ScheduledChunk(3, 4, 3, [4, 5, 6], True, num_draft=2),  # verify, 2 accepted
    ]
    rows = extend_rows(chunks, {3: 2}, table)
    assert [(r.req_slot, r.first_row, r.start, r.count, r.kv_slots) for r in rows] == [
        (0, 0, 0, 3, [0, 1, 2]),
        (3, 4, 4, 2, [4, 5]),
    ]


def test_stacked_commit_equals_each_layers_commit(tiny_dense):
    """Pools.commit_verify (all GDN layers in one go) leaves what GatedDeltaNet.commit_verify
    leaves layer by layer."""
    from appliance.engine.pools import Pools, PoolSizes
    from appliance.models.config import load_text_config
    from appliance.models.registry import model_class

    cfg = load_text_config(tiny_dense)
    model = model_class(cfg)(cfg)
    pools = Pools([model], PoolSizes(64, 4, 32, mtp_step=3), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for tensor in pools.stacked.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    slots, rows = torch.tensor([2, 0]), torch.tensor([3, 1])
    want = []
    for layer in pools.gdn_layers:
        conv, ssm = layer.conv_states.clone(), layer.ssm_states.clone()
        layer.conv_states, layer.ssm_states = conv, ssm  # a private copy, committed per layer
        layer.commit_verify(slots, rows)
        want.append((conv, ssm))
    pools.commit_verify(slots, rows)
    assert len(pools.gdn_layers) > 1
    for (conv, ssm), i in zip(want, range(len(want))):
        assert torch.equal(pools.stacked["conv_states"][i], conv)
        assert torch.equal(pools.stacked["ssm_states"][i], ssm)
