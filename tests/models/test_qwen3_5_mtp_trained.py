"""MTP with a draft head that really agrees (a tiny model trained on a permutation language):
acceptance is exercised, output stays identical; seeded sampling with MTP has the MTP-off
distribution; GDN verify + commit leaves the states a plain decode of the accepted tokens would."""

from __future__ import annotations

import pytest
import torch

from appliance.models.context import ForwardContext, forward_context
from appliance.models.layers.gdn import GatedDeltaNet
from appliance.offline.llm import LLM
from appliance.sampling_params import SamplingParams
from appliance.testing.synthetic import permutation, sample_sequences

OPTS = dict(max_num_seqs=8, max_num_batched_tokens=48, num_kv_slots=4096, max_model_len=512)


def prompts(n: int = 8, length: int = 12, seed: int = 9) -> list[list[int]]:
    return sample_sequences(permutation(0), n, length, torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_accept_length_above_1_5_with_identical_output(tiny_trained, mode):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tiny_trained), **OPTS).generate(prompts(), params)]
    llm = LLM(str(tiny_trained), mtp_step=2, mtp_mode=mode, **OPTS)
    got = [o.token_ids for o in llm.generate(prompts(), params)]
    assert got == want
    stats = llm.scheduler.stats()
    print(
        f"{mode}: mean accept length {stats.mtp_mean_accept_len:.2f}, "
        f"per position {stats.mtp_accepted_per_position} of {stats.mtp_drafts} verify steps"
    )
    assert stats.mtp_mean_accept_len > 1.5


def test_sampling_distribution_matches_mtp_off(tiny_trained):
    """400 seeded samples of the 3rd generated token at temperature 2 (several tokens likely):
    MTP on draws the same tokens as MTP off (same seed, same offsets), so the two empirical
    distributions agree; chi-square of on-vs-off counts is checked as the issue asks."""
    prompt = prompts(1)[0]
    runs = {}
    for k in (0, 2):
        llm = LLM(str(tiny_trained), mtp_step=k, **OPTS)
        params = [
            SamplingParams(max_tokens=3, temperature=2.0, seed=s, ignore_eos=True)
            for s in range(400)
        ]
        runs[k] = [o.token_ids[2] for o in llm.generate([prompt] * 400, params)]
    assert len(set(runs[0])) > 3  # the distribution is not degenerate
    on, off = torch.tensor(runs[2]), torch.tensor(runs[0])
    ids = torch.unique(torch.cat([on, off]))
    c_on = torch.stack([(on == i).sum() for i in ids]).float()
    c_off = torch.stack([(off == i).sum() for i in ids]).float()
    expected = (c_on + c_off) / 2
    chi2 = (((c_on - expected) ** 2 + (c_off - expected) ** 2) / expected).sum().item()
    assert chi2 < 3.0 * len(ids)  # far below any rejection threshold; 0 when draws coincide
    assert runs[2] == runs[0]


def _layer(seed: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(
        hidden=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4, eps=1e-6
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    slots, rows = 2, 4
    layer.conv_states = torch.randn(slots, layer.conv_dim, 3)
    layer.ssm_states = torch.randn(slots, 4, 8, 8) * 0.1
    layer.ssm_candidates = torch.zeros(slots, rows, 4, 8, 8)
    layer.conv_windows = torch.zeros(slots, layer.conv_dim, 3 + rows)
    return layer


def _ctx(q_lens: list[int], verify: bool) -> ForwardContext:
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    n = len(q_lens)
    return ForwardContext(
        req_slots=torch.arange(n),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(q_lens),
        has_initial_state=torch.ones(n, dtype=torch.bool),
        out_kv_slots=torch.zeros(sum(q_lens), dtype=torch.long),
        req_to_token=torch.zeros(2, 8, dtype=torch.int32),
        q_lens=q_lens,
        all_decode=False,
        num_plain_reqs=0 if verify else -1,
        num_plain_tokens=0 if verify else -1,
    )


@pytest.mark.parametrize("accepted", [[0, 3], [2, 1]])
def test_gdn_verify_commit_equals_plain_decode(accepted):
    verify, plain = _layer(0), _layer(0)
    x = torch.randn(8, 32)  # 2 requests x 4 verify rows
    with torch.no_grad(), forward_context(_ctx([4, 4], verify=True)):
        verify(x)
    verify.commit_verify(torch.tensor([0, 1]), torch.tensor(accepted))
    with torch.no_grad():
        for row in range(max(accepted) + 1):  # plain decode of each request's accepted rows
            live = [b for b in range(2) if row <= accepted[b]]
            sub = x.view(2, 4, 32)[live, row]
            with forward_context(_ctx([1] * len(live), verify=False)) as ctx:
                ctx.req_slots = torch.tensor(live)
                plain(sub)
    torch.testing.assert_close(verify.ssm_states, plain.ssm_states, atol=1e-5, rtol=0)
    torch.testing.assert_close(verify.conv_states, plain.conv_states, atol=1e-5, rtol=0)
