"""The fused MTP step (appliance/engine/mtp_graphs.py): acceptance on the device, lossless against
MTP off, the same accept counts as the host path, and padding rows that never touch a live
request's KV, state or scratch slots. On CPU the programs run eagerly (padded as when replayed);
capture and replay are checked on the GPU (tests marked gpu)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from appliance.engine.draft_graphs import DraftGraphs
from appliance.engine.graphs import DecodeGraphs
from appliance.engine.mtp import Drafter
from appliance.engine.mtp_graphs import (
    MtpGraphs,
    is_full_verify,
    mtp_graph_max_bs,
    mtp_graph_reserve_bytes,
)
from appliance.engine.pools import Pools
from appliance.engine.requests import RequestTable
from appliance.messages import ScheduledChunk
from appliance.offline.llm import LLM
from appliance.sampling_params import SamplingParams

OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_slots=4096, max_model_len=256)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_k=30, seed=7, ignore_eos=True)


def prompts(n: int, vocab: int, seed: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


def test_which_steps_and_sizes():
    verify = ScheduledChunk(0, 9, 3, [1, 2, 3], True, num_draft=2)
    assert is_full_verify([verify, ScheduledChunk(1, 4, 3, [4, 5, 6], True, num_draft=2)], 2)
    assert not is_full_verify([], 2)
    assert not is_full_verify([verify], 3)  # clamped drafts (near max_tokens): host path
    assert not is_full_verify([verify, ScheduledChunk(1, 4, 1, [7], True)], 2)  # a plain decode
    assert mtp_graph_max_bs(256, 3) == 64 and mtp_graph_max_bs(8, 1) == 4
    assert mtp_graph_max_bs(0, 3) == 0 and mtp_graph_max_bs(2, 3) == 1
    assert mtp_graph_reserve_bytes(0, 3, 1000) == 0 < mtp_graph_reserve_bytes(1, 3, 1000)


def chosen(out) -> list[float]:
    """The sampled tokens' logprobs, from vLLM's per-token {id: Logprob} dicts."""
    return [d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True)]


def padded(runner, max_bs: int) -> MtpGraphs:
    """What the runner builds on CUDA: pools with a padding row, then the fused step rounding every
    batch up to a bucket (here run eagerly)."""
    sizes = dataclasses.replace(runner.pools.sizes, padding=True)
    device = runner.device
    runner.pools = Pools([runner.model, *runner.draft_modules], sizes, runner.dtype, device)
    runner.requests = RequestTable(sizes.num_req_rows, sizes.max_model_len, sizes.mtp_step, device)
    runner.drafter = Drafter(
        runner.model, runner.draft_modules, sizes.mtp_step, runner.requests, sizes, device
    )
    graphs = MtpGraphs(
        runner.model,
        runner.draft_modules,
        runner.pools,
        runner.requests,
        sizes,
        max_bs,
        runner.text_config.hidden_size,
        runner.dtype,
        device,
    )
    graphs.padded = True
    runner.mtp_graphs = graphs
    return graphs


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("k", [1, 3])
def test_padded_fused_step_is_lossless_and_keeps_padding_apart(fixture, k, request):
    model_dir = str(request.getfixturevalue(fixture))
    off = LLM(model_dir, **OPTS)
    seqs = prompts(3, off.runner.text_config.vocab_size)  # 3 requests -> bucket 4: one pad row
    params = [GREEDY, SEEDED, GREEDY]
    want = [o.token_ids for o in off.generate(seqs, params)]

    llm = LLM(model_dir, mtp_step=k, **OPTS)
    graphs = padded(llm.runner, max_bs=4)
    runs = []
    run = graphs.run
    graphs.run = lambda chunks, *more: runs.append(len(chunks)) or run(chunks, *more)
    sizes = llm.runner.pools.sizes
    gdn = llm.runner.pools.gdn_layers[0]
    idle = 7  # a request slot the three requests never get
    idle_state = (gdn.ssm_states[idle].clone(), gdn.conv_states[idle].clone())
    k_cache = llm.runner.pools.kv[0][0]
    unused = slice(2000, sizes.num_kv_slots)  # router slots past those three requests use
    unused_kv = k_cache[unused].clone()
    idle_scratch = [sizes.scratch_slot(idle, j) for j in range(k)]
    draft_k = llm.runner.pools.kv[-1][0]  # the MTP layer's KV pool (scratch slots live there)
    scratch_kv = draft_k[idle_scratch].clone()

    got = [o.token_ids for o in llm.generate(seqs, params)]
    assert got == want
    assert runs and set(runs) <= {1, 2, 3}  # the fused step ran (padded to buckets 1, 2, 4)
    assert torch.equal(gdn.ssm_states[idle], idle_state[0])
    assert torch.equal(gdn.conv_states[idle], idle_state[1])
    assert torch.equal(k_cache[unused], unused_kv)
    assert torch.equal(draft_k[idle_scratch], scratch_kv)
    assert k_cache[sizes.pad_kv_slot].abs().sum() > 0  # the padding rows wrote their own slot
    stats = llm.scheduler.stats()
    assert (stats.kv_used, stats.state_used, stats.num_running) == (0, 0, 0)


def test_padded_step_edits_rows_of_the_shared_logits_buffer(tiny_trained):
    """As captured: the verify logits land in the persistent buffer every bucket shares, and the
    rows of penalised / scored requests are edited there before the sampling program reads them.
    Three requests (bucket 4, a padding row): the tokens and logprobs of MTP off."""
    seeded = dict(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    evens = list(range(0, 200, 2))
    params = [
        SamplingParams(repetition_penalty=1.4, logprobs=2, allowed_token_ids=evens, **seeded),
        SamplingParams(**seeded),
        SamplingParams(
            frequency_penalty=2.0, logit_bias={3: 50.0, 4: 50.0}, temperature=0, max_tokens=20
        ),
    ]
    seqs = prompts(3, 200, seed=6)
    off = LLM(str(tiny_trained), **OPTS)
    want = off.generate(seqs, params)
    plain = off.generate(seqs, [SamplingParams(**seeded)] * 2 + [GREEDY])
    assert all(a.token_ids != b.token_ids for a, b in zip(want[::2], plain[::2]))  # edits bite
    # the bias outweighs the model's logits: only 3 and 4, the frequency penalty alternating them
    assert set(want[2].token_ids[:6]) == {3, 4} and all(t % 2 == 0 for t in want[0].token_ids)
    llm = LLM(str(tiny_trained), mtp_step=3, **OPTS)
    graphs = padded(llm.runner, max_bs=4)
    vocab = llm.runner.text_config.vocab_size
    graphs._logits_buf = torch.full((4 * 4, vocab), float("nan"))  # what capture() allocates
    got = llm.generate(seqs, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    torch.testing.assert_close(chosen(got[0]), chosen(want[0]), atol=1e-4, rtol=1e-4)
    assert graphs.logits.data_ptr() == graphs._logits_buf.data_ptr()  # the forward wrote there
    # drafts were accepted (the biased request's seldom are: its draft head knows no bias)
    assert llm.scheduler.stats().mtp_mean_accept_len > 1.25


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_fused_and_host_paths_accept_the_same_drafts(tiny_trained, mode, monkeypatch):
    """On a model whose draft head agrees, the device step accepts exactly what the host path
    accepts (same tokens, same accept counts per position)."""
    seqs = prompts(6, 64, seed=2)
    results = {}
    for fused in (True, False):
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "" if fused else "1")
        llm = LLM(str(tiny_trained), mtp_step=3, mtp_mode=mode, **OPTS)
        assert (llm.runner.mtp_graphs is not None) == fused
        tokens = [o.token_ids for o in llm.generate(seqs, GREEDY)]
        stats = llm.scheduler.stats()
        results[fused] = (tokens, stats.mtp_accepted_per_position, stats.mtp_drafts)
    assert results[True] == results[False]
    assert sum(results[True][1]) > results[True][2] // 2  # drafts really were accepted


def test_the_flag_or_the_env_variable_turns_the_fused_step_off(tiny_dense, monkeypatch):
    """`--disable-mtp-fused-graph` (GraphConfig) and APPLIANCE_DISABLE_MTP_FUSED_GRAPH each leave
    the runner without its fused step (and its memory unreserved); neither: the step is built."""
    monkeypatch.delenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", raising=False)
    assert LLM(str(tiny_dense), mtp_step=2, **OPTS).runner.mtp_graphs is not None
    flag = LLM(str(tiny_dense), mtp_step=2, disable_mtp_fused_graph=True, **OPTS)
    assert flag.runner.mtp_graphs is None and not flag.runner.mtp_fused
    monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "1")
    assert LLM(str(tiny_dense), mtp_step=2, **OPTS).runner.mtp_graphs is None


def test_a_step_with_prefill_chunks_splits_around_the_fused_verify(tiny_dense):
    """Verify chunks of decoding requests take the fused step while another request's prefill
    chunks (and clamped verifies near max_tokens) run on the host path in the same step."""
    off = LLM(str(tiny_dense), **OPTS)
    vocab = off.runner.text_config.vocab_size
    seqs = [prompts(1, vocab)[0], torch.randint(0, vocab, (200,)).tolist()]  # short, long
    params = [GREEDY, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    want = [o.token_ids for o in off.generate(seqs, params)]
    llm = LLM(str(tiny_dense), mtp_step=2, **dict(OPTS, max_num_batched_tokens=24))
    runner, eager, shared = llm.runner, [], []
    step, forward, launch = runner._launch, runner._forward_eager, runner._launch_mtp
    runner._launch = lambda plan: eager.clear() or step(plan)
    runner._forward_eager = lambda chunks: eager.append(len(chunks)) or forward(chunks)
    runner._launch_mtp = lambda *a: shared.append((sum(eager), len(a[3]))) or launch(*a)
    assert [o.token_ids for o in llm.generate(seqs, params)] == want
    assert any(rows for rows, _ in shared)  # host-path chunks ran in the same step as the fused
    stats = llm.scheduler.stats()
    assert (stats.kv_used, stats.state_used, stats.num_running) == (0, 0, 0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host"])
def test_a_draft_vocabulary_limits_the_drafts_not_the_output(tiny_dense, fused, monkeypatch):
    monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "" if fused else "1")
    off = LLM(str(tiny_dense), **OPTS)
    seqs = prompts(3, off.runner.text_config.vocab_size)
    want = [o.token_ids for o in off.generate(seqs, GREEDY)]
    llm = LLM(str(tiny_dense), mtp_step=2, mtp_draft_vocab=40, **OPTS)
    assert [o.token_ids for o in llm.generate(seqs, GREEDY)] == want
    drafted = llm.runner.requests.draft_tokens[:3]
    assert drafted.max() < 40 and drafted.sum() > 0


def with_draft_graphs(runner, verify_bs: int, decode_bs: int) -> DraftGraphs:
    """padded(), then what the runner builds beside it on CUDA: the decode graphs and the draft
    graphs after them (here run eagerly)."""
    padded(runner, verify_bs)
    cfg, sizes = runner.text_config, runner.pools.sizes
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.requests,
        sizes,
        decode_bs,
        cfg.hidden_size,
        cfg.vocab_size,
        runner.dtype,
        runner.device,
    )
    runner.draft_graphs = DraftGraphs(
        runner.graphs, runner.draft_modules, sizes, sizes.mtp_step, 0, runner.device
    )
    return runner.draft_graphs


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_steps_over_the_batch_limit_verify_nothing_and_keep_drafting(
    tiny_trained, mode, monkeypatch
):
    """--mtp-disable-batch-size 2 with five requests that end one after another: the steps with
    more than two decoding requests verify no drafts, yet draft after their one-row decodes (on
    the device after graphed decodes, else on the host), so the verify steps after them accept
    drafts as with no limit; the tokens are MTP off's. The draft graphs' path and the host path
    accept exactly the same drafts."""
    seqs = prompts(5, 64, seed=3)
    params = [
        SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True) for i in range(5)
    ]
    want = [o.token_ids for o in LLM(str(tiny_trained), **OPTS).generate(seqs, params)]
    opts = dict(OPTS, mtp_step=3, mtp_mode=mode, mtp_disable_batch_size=2)
    results = []
    for on_device in (True, False):
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "" if on_device else "1")
        llm = LLM(str(tiny_trained), **opts)
        drafted = []
        if on_device:
            graphs = with_draft_graphs(llm.runner, verify_bs=4, decode_bs=8)
            graphs.run = lambda n, run=graphs.run, seen=drafted: seen.append(n) or run(n)
        assert [o.token_ids for o in llm.generate(seqs, params)] == want
        stats = llm.scheduler.stats()
        assert stats.mtp_paused_steps >= 5 and stats.mtp_drafts > 0
        assert (set(drafted) >= {3, 4, 5}) == on_device  # the draft graphs drafted those steps
        # the verifies after the pause accept: the drafts were kept up to date through it
        assert stats.mtp_accepted_tokens > 0.6 * stats.mtp_draft_tokens
        results.append((stats.mtp_accepted_per_position, stats.mtp_drafts))
    assert results[0] == results[1]


def test_verify_costs_time_each_verify_bucket_on_padding_rows(tiny_trained):
    """The startup measurement (run eagerly here): one verify-over-paused ratio per verify
    bucket, each paused step timed at the decode bucket holding it; it touches only padding rows,
    so generation afterwards is MTP off's, and the router takes the costs as its policy."""
    from appliance.engine.mtp_costs import verify_costs
    from appliance.router import Scheduler

    seqs = prompts(3, 64, seed=8)
    want = [o.token_ids for o in LLM(str(tiny_trained), **OPTS).generate(seqs, GREEDY)]
    llm = LLM(str(tiny_trained), mtp_step=2, **OPTS)
    draft = with_draft_graphs(llm.runner, verify_bs=4, decode_bs=8)
    timed = []
    decode_forward = llm.runner.graphs._forward
    llm.runner.graphs._forward = lambda bs: timed.append(bs) or decode_forward(bs)
    costs = verify_costs(llm.runner.mtp_graphs, llm.runner.graphs, draft, reps=1)
    assert sorted(costs) == [1, 2, 4] and all(c > 0 for c in costs.values())
    assert sorted(set(timed)) == [1, 2, 4]  # (the decode buckets 1, 2, 4, 8 hold them)
    assert [o.token_ids for o in llm.generate(seqs, GREEDY)] == want
    sched = Scheduler(llm.config.scheduler, 100, 100, mtp_verify_max_bs=4, mtp_verify_costs=costs)
    assert sched.verify_policy.buckets == [1, 2, 4] and sched.verify_policy.limit == 0


def test_a_draft_graph_capture_that_fails_leaves_the_host_path(tiny_dense, monkeypatch, caplog):
    """As on CUDA: the runner builds the draft graphs beside the decode graphs and captures them;
    a capture that raises leaves none (paused steps then draft on the host path) and no costs."""
    from appliance.engine import runner as runner_module

    llm = LLM(str(tiny_dense), mtp_step=2, **OPTS)
    with_draft_graphs(llm.runner, verify_bs=4, decode_bs=8)

    def fail(name, graphs, reserved):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner_module, "capture_logged", fail)
    assert llm.runner._draft_graphs() is None
    assert "MTP draft graphs off, their capture failed" in caplog.text
    llm.runner.draft_graphs = None
    assert llm.runner._verify_costs() == {}


def test_lm_head_argmax_over_a_prefix_of_the_vocabulary():
    from appliance.models.layers.embedding import LMHead

    head = LMHead(100, 8)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    logits = head(hidden)
    assert torch.equal(head.argmax(hidden), logits.argmax(-1))
    assert torch.equal(head.argmax(hidden, 30), logits[:, :30].argmax(-1))
    assert torch.equal(head.argmax(hidden, 1000), logits.argmax(-1))  # past the vocabulary: all


def test_lengths_reach_the_host_mirror_only_for_the_same_admission():
    table = RequestTable(4, 32, 2, torch.device("cpu"))
    from appliance.messages import NewRequest, SamplingOptions

    table.admit([NewRequest(1, [1, 2, 3], SamplingOptions(), num_draft=2)])
    record = table.lengths_on_collect([1])
    record([6])
    assert table.num_tokens_host[1] == 6
    record = table.lengths_on_collect([1])
    table.release([1])
    table.admit([NewRequest(1, [9], SamplingOptions(), num_draft=2)])  # the slot's next request
    record([8])
    assert table.num_tokens_host[1] == 1  # the old step's length does not land on the new one


def _gpu_llm(model_dir, k: int, **extra) -> LLM:
    """fp32 on the GPU: MTP is exactly lossless only where verify and plain rows round alike.
    Every step verifies (the limit at max_num_seqs) unless `extra` sets the policy."""
    opts = dict(OPTS, max_num_seqs=16, device="cuda", dtype="float32", cuda_graph_max_bs=16)
    opts.setdefault("mtp_disable_batch_size", 16)
    return LLM(str(model_dir), mtp_step=k, **{**opts, **extra})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_captured_fused_step_is_lossless(family, k, tmp_path):
    from appliance.testing.tiny import build_qwen3_5

    model_dir = build_qwen3_5(tmp_path / family, moe=family == "moe", seed=3)
    seqs = prompts(3, 200)  # padded to bucket 4
    params = [GREEDY, SEEDED, GREEDY]
    want = [o.token_ids for o in _gpu_llm(model_dir, 0).generate(seqs, params)]
    llm = _gpu_llm(model_dir, k)
    graphs = llm.runner.mtp_graphs
    assert graphs is not None and graphs.graphs and graphs.max_bs == 16 // (k + 1)
    runs = []
    run = graphs.run
    graphs.run = lambda chunks, *more: runs.append(len(chunks)) or run(chunks, *more)
    assert [o.token_ids for o in llm.generate(seqs, params)] == want
    assert 3 in runs  # the three requests decoded together through the captured graphs
    stats = llm.scheduler.stats()
    assert (stats.kv_used, stats.state_used, stats.num_running) == (0, 0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_draft_graphs_keep_drafting_past_the_verify_graphs(tiny_trained):
    """With a limit of 4 (the largest captured verify batch here, 16 // (k + 1)), seven requests
    that end one after another decode through the decode graphs with the captured draft graphs
    after them, then verify: MTP off's tokens, and the verifies after the pause accept drafts.
    Then the default policy (the costs measured at startup against the accept length): this
    model's drafts are accepted, so it verifies, losslessly."""
    seqs = prompts(7, 64, seed=3)
    params = (
        [GREEDY] * 2
        + [SEEDED]
        + [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(4)]
    )
    want = [o.token_ids for o in _gpu_llm(tiny_trained, 0).generate(seqs, params)]
    llm = _gpu_llm(tiny_trained, 3, mtp_disable_batch_size=4)
    graphs = llm.runner.draft_graphs
    assert graphs is not None and graphs.graphs and llm.scheduler.verify_policy.limit == 4
    # measured at startup for the default policy: a verify step per captured verify batch
    costs = llm.runner.mtp_verify_costs
    assert sorted(costs) == [1, 2, 4] and all(0.3 < c < 20 for c in costs.values()), costs
    drafted = []
    graphs.run = lambda n, run=graphs.run: drafted.append(n) or run(n)
    assert [o.token_ids for o in llm.generate(seqs, params)] == want
    stats = llm.scheduler.stats()
    assert stats.mtp_paused_steps > 0 and set(drafted) >= {5, 6, 7}
    assert stats.mtp_accepted_tokens > 0.5 * stats.mtp_draft_tokens
    few = seqs[:3]
    llm = _gpu_llm(tiny_trained, 3, mtp_disable_batch_size=0)
    assert llm.scheduler.verify_policy.buckets == [1, 2, 4]
    assert [o.token_ids for o in llm.generate(few, params[:3])] == want[:3]
    trained = llm.scheduler.stats()  # accepted drafts pay: verifies past the first
    assert trained.mtp_drafts > 3 and trained.mtp_mean_accept_len > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_fused_step_edits_penalised_and_scored_rows(tiny_trained):
    """Requests with penalties, a bias, allowed ids, min_tokens, bad words and logprobs through
    the captured MTP graphs (their rows edited between the forward and the sampling graph): the
    tokens and logprobs of MTP off, and they drafted."""
    seqs = prompts(4, 200, seed=4)
    seeded = dict(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logprobs=2, **seeded),
        SamplingParams(logit_bias={7: 5.0}, allowed_token_ids=list(range(0, 200, 2)), **seeded),
        SamplingParams(
            frequency_penalty=2.0,
            logit_bias={3: 9.0, 4: 9.0},
            logprobs=0,
            temperature=0,
            max_tokens=20,
        ),
        SamplingParams(min_tokens=10, stop_token_ids=[1, 2, 3], **dict(seeded, ignore_eos=False)),
    ]
    off = _gpu_llm(tiny_trained, 0)
    free = off.generate(seqs[:1], GREEDY)[0].token_ids
    # bad words (a second batch, so each fits one captured bucket): a two-token word the greedy
    # answer completes at its 6th token, and one token
    single = next(t for t in free[6:] if t not in free[:6])
    bad = SamplingParams(bad_words_token_ids=[free[4:6], [single]], logprobs=1, temperature=0)
    batches = [
        (seqs, params),
        (seqs[:2], [dataclasses.replace(bad, max_tokens=20, ignore_eos=True), params[2]]),
    ]
    wants = [off.generate(*batch) for batch in batches]
    cut = next(i for i in range(1, 6) if free[i - 1 : i + 1] == free[4:6])
    banned = wants[1][0].token_ids
    assert banned[:cut] == free[:cut] and banned[cut] != free[cut] and single not in banned
    llm = _gpu_llm(tiny_trained, 3)
    graphs = llm.runner.mtp_graphs
    assert graphs is not None and graphs.graphs
    edits = []
    run = graphs.run
    graphs.run = lambda chunks, mask=None, edit=None: (
        edits.append(edit is not None) or run(chunks, mask, edit)
    )
    for batch, want in zip(batches, wants):
        edits.clear()
        got = llm.generate(*batch)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            assert (a.logprobs is None) == (b.logprobs is None)
            if b.logprobs is not None:
                torch.testing.assert_close(chosen(a), chosen(b), atol=1e-4, rtol=1e-4)
        assert any(edits)
    assert llm.scheduler.stats().mtp_mean_accept_len > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_fused_step_forces_the_end_of_reasoning(tiny_trained):
    """thinking_token_budget through the captured MTP graphs: </think> where MTP off puts it."""
    off = _gpu_llm(tiny_trained, 0)
    hf = off.tokenizer.hf
    think, end = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    seqs = [p + [think] for p in prompts(4, 200, seed=6)]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, thinking_token_budget=n)
        for n in (0, 2, 5, 11)
    ]
    want = [o.token_ids for o in off.generate(seqs, params)]
    assert [ids.index(end) for ids in want] == [0, 2, 5, 11]
    llm = _gpu_llm(tiny_trained, 3)
    assert [o.token_ids for o in llm.generate(seqs, params)] == want
    assert llm.scheduler.stats().mtp_mean_accept_len > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_fused_step_is_lossless_on_fp8_kv(tiny_trained):
    """The draft layer's fp8 KV pool and the verify rows through the captured MTP graphs."""
    seqs = prompts(3, 200)
    want = [
        o.token_ids
        for o in _gpu_llm(tiny_trained, 0, kv_cache_dtype="fp8_e4m3").generate(seqs, GREEDY)
    ]
    llm = _gpu_llm(tiny_trained, 2, kv_cache_dtype="fp8_e4m3")
    assert all(k.dtype == torch.float8_e4m3fn for k, _ in llm.runner.pools.kv)
    assert llm.runner.mtp_graphs is not None and llm.runner.mtp_graphs.graphs
    assert [o.token_ids for o in llm.generate(seqs, GREEDY)] == want
    assert llm.scheduler.stats().mtp_mean_accept_len > 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_fused_step_accepts_like_the_host_path(tiny_trained, monkeypatch):
    seqs = prompts(6, 64, seed=2)
    results = {}
    for fused in (True, False):
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "" if fused else "1")
        llm = _gpu_llm(tiny_trained, 3)
        assert (llm.runner.mtp_graphs is not None) == fused
        tokens = [o.token_ids for o in llm.generate(seqs, GREEDY)]
        stats = llm.scheduler.stats()
        results[fused] = (tokens, stats.mtp_mean_accept_len)
        print(f"fused={fused}: mean accept length {stats.mtp_mean_accept_len:.3f}")
    assert results[True][0] == results[False][0]
    assert abs(results[True][1] - results[False][1]) < 0.05 and results[True][1] > 1.5


def test_a_pending_mtp_step_joins_what_the_host_path_already_sampled():
    from appliance.engine.pending import PendingStep
    from appliance.messages import SampledTokens

    lengths = []
    out = torch.tensor([[5, 6, 7, 2], [8, 9, 1, 1]])  # k = 2: three samples, then accepted
    pending = PendingStep.copying(
        3, 0.0, [4, 1], out, lengths=lengths.extend, starts=[10, 20], known=[SampledTokens(2, [9])]
    )
    out.zero_()  # the step's buffer is reused by the next step: the pending step kept a copy
    result = pending.result()
    assert [(s.req_slot, s.token_ids) for s in result.sampled] == [(2, [9]), (4, [5, 6]), (1, [8])]
    assert lengths == [13, 22]


def test_guided_requests_take_the_fused_step_losslessly(tiny_trained, monkeypatch):
    """Structured-output requests join the fused step (their grammar masks staged into the verify
    program): the same tokens as MTP off and as the host path, every output matches its regex,
    and drafts the grammar allows are still accepted."""
    from appliance.messages import Guide

    llm_off = LLM(str(tiny_trained), **OPTS)
    tok = llm_off.tokenizer
    guide = Guide("regex", r"[!-/0-9A-Za-z]{1,60}")
    pattern = re.compile(guide.spec)
    params = [
        SamplingParams(max_tokens=40, temperature=0, guide=guide),
        SamplingParams(max_tokens=24, temperature=0.8, top_k=30, seed=7, guide=guide),
        GREEDY,  # an unguided request in the same steps
    ]
    seqs = prompts(3, 64, seed=2)
    want = [o.token_ids for o in llm_off.generate(seqs, params)]
    results = {}
    for fused in (True, False):
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "" if fused else "1")
        llm = LLM(str(tiny_trained), mtp_step=3, **OPTS)
        masked = []
        if fused:
            graphs, run = llm.runner.mtp_graphs, llm.runner.mtp_graphs.run

            def watched(chunks, mask=None, *more, run=run, seen=masked):
                seen.append(mask is not None)
                return run(chunks, mask, *more)

            graphs.run = watched
        tokens = [o.token_ids for o in llm.generate(seqs, params)]
        stats = llm.scheduler.stats()
        results[fused] = (tokens, stats.mtp_accepted_per_position, stats.mtp_drafts)
        if fused:
            assert any(masked)  # guided requests took the fused step
        assert tokens == want
    assert results[True] == results[False]
    assert sum(results[True][1]) > 0  # drafts were accepted under the grammar
    for ids in want[:2]:
        text = tok.decode([t for t in ids if t not in llm_off.eos_token_ids])
        assert pattern.fullmatch(text), text


def test_offline_guide_that_does_not_compile_is_a_value_error(tiny_dense):
    from appliance.messages import Guide

    llm = LLM(str(tiny_dense), **OPTS)
    bad = SamplingParams(max_tokens=4, guide=Guide("regex", "(unclosed"))
    with pytest.raises(ValueError, match="regex|parenthes|unclosed|Unclosed"):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4), bad])
    stats = llm.scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.kv_used) == (0, 0, 0)


def test_guided_matchers_advance_only_for_the_same_admission(tiny_dense):
    """A fused step's runs reach the grammar matchers when its result arrives, but not a matcher
    of a request admitted into the slot since the launch."""
    from appliance.messages import Guide, NewRequest, SampledTokens, SamplingOptions

    runner = LLM(str(tiny_dense), mtp_step=2, **OPTS).runner
    guide = Guide("regex", r"(ab|cd)x")
    token_a = runner._load_tokenizer().convert_tokens_to_ids("a")
    options = SamplingOptions(guide=guide)

    def admit() -> None:
        runner.requests.admit([NewRequest(1, [1, 2, 3], options, num_draft=2)])
        runner.guided.admit(1, guide, [])

    def mask() -> torch.Tensor:
        return runner.guided.bitmask([(1, [])])

    admit()
    fresh = mask()
    runner._guided_on_collect([1])([SampledTokens(1, [token_a])])
    assert not torch.equal(mask(), fresh)  # the same admission: the matcher read "a"
    advance = runner._guided_on_collect([1])
    runner.requests.release([1])
    runner.guided.release([1])
    admit()  # the slot's next request, before the old step's result arrives
    advance([SampledTokens(1, [token_a])])
    assert torch.equal(mask(), fresh)
