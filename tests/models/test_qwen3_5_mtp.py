"""MTP speculative decoding for Qwen3.5 dense and MoE: draft logits against a hand-built HF oracle,
lossless greedy and seeded sampling with MTP on (vanilla and eagle, k = 1..3, chunked prefill), and
the accept/commit path driven with oracle drafts that are right, partly right or wrong."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.batch import build_batch
from appliance.engine.mtp import Drafter
from appliance.messages import ScheduledChunk
from appliance.models.context import forward_context
from appliance.offline.llm import LLM
from appliance.sampling_params import SamplingParams
from appliance.testing.oracle import hf_mtp_logits

LENS = [3, 11, 20, 37, 64, 70, 90, 130]
OPTS = dict(max_num_seqs=8, max_num_batched_tokens=48, num_kv_slots=4096, max_model_len=512)


def prompts(vocab: int, lens=LENS, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def assert_pools_empty(llm: LLM) -> None:
    s = llm.scheduler.stats()
    assert (s.kv_used, s.state_used, s.num_running, s.num_waiting) == (0, 0, 0, 0)


@pytest.fixture(scope="module", params=["tiny_dense", "tiny_moe"])
def ckpt(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), **OPTS)
    seqs = prompts(llm.runner.text_config.vocab_size)
    greedy = [
        o.token_ids
        for o in llm.generate(seqs, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    ]
    sampled = [
        o.token_ids
        for o in llm.generate(
            seqs,
            SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        )
    ]
    assert_pools_empty(llm)
    return seqs, greedy, sampled


def test_draft_logits_match_hf(ckpt):
    llm = LLM(str(ckpt), mtp_step=1, **OPTS)
    runner = llm.runner
    seq = prompts(runner.text_config.vocab_size, lens=[90], seed=3)[0]
    runner.requests.token_ids[0, : len(seq)] = torch.tensor(seq)
    batch = build_batch(
        [ScheduledChunk(0, 0, len(seq), list(range(len(seq))), False)],
        runner.requests,
        runner.device,
    )
    n = len(seq) - 1
    with torch.inference_mode():
        with forward_context(batch.ctx):
            hidden = runner.model(batch.input_ids, batch.positions)
        with forward_context(runner.drafter._ctx([0], [n], [n], list(range(n)))):
            y = runner.draft_modules[0](torch.tensor(seq[1:]), hidden[:n], torch.arange(n))
        got = runner.model.compute_logits(y)
    torch.testing.assert_close(got, hf_mtp_logits(ckpt, seq), atol=1e-3, rtol=0)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_lossless_greedy_and_sampling(ckpt, reference, mode, k):
    seqs, greedy, sampled = reference
    llm = LLM(str(ckpt), mtp_step=k, mtp_mode=mode, **OPTS)
    got = llm.generate(seqs, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == greedy
    got = llm.generate(
        seqs, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    )
    assert [o.token_ids for o in got] == sampled
    assert_pools_empty(llm)


class OracleDrafter(Drafter):
    """Real draft extend (fills the draft KV), but proposes the reference continuation with every
    `wrong_every`-th draft corrupted, so full, partial and zero acceptance all happen."""

    def __init__(self, base: Drafter, futures: dict[tuple[int, ...], list[int]], wrong_every: int):
        super().__init__(base.main, base.modules, base.k, base.requests, base.sizes, base.device)
        self.futures, self.wrong_every, self.calls = futures, wrong_every, 0

    def _chain(self, rows, y1):
        for r in rows:
            known = self.requests.token_ids[r.req_slot, : r.start + r.count + 1].tolist()
            prompt = next(p for p in self.futures if tuple(known[: len(p)]) == p)
            done = len(known) - len(prompt)
            future = (self.futures[prompt][done:] + [0] * self.k)[: self.k]
            for j in range(self.k):
                self.calls += 1
                if self.calls % self.wrong_every == 0:
                    future[j] = (future[j] + 1) % self.main.config.vocab_size
            self.requests.draft_tokens[r.req_slot, : self.k] = torch.tensor(future)


def oracle_drafts(runner, futures: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
    """Installs the oracle in both MTP paths: the host path's Drafter (steps with prefill chunks,
    or every step with the fused path off) and the fused device step's draft chain."""
    oracle = OracleDrafter(runner.drafter, futures, wrong_every)
    runner.drafter = oracle
    if runner.mtp_graphs is None:
        return

    def chain(bs, slots, last, y1):  # the fused step's chain: P = last committed position
        rows = [  # the host Drafter's view of the same requests: start + count - 1 = P
            type("Row", (), {"req_slot": slot, "start": p, "count": 1})
            for slot, p in zip(slots.tolist(), last.tolist())
        ]
        oracle._chain(rows, y1)

    runner.mtp_graphs._chain = chain


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host"])
@pytest.mark.parametrize("wrong_every", [1000, 5, 2])
def test_accept_and_commit_with_oracle_drafts(ckpt, reference, wrong_every, fused, monkeypatch):
    seqs, greedy, _ = reference
    if not fused:
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "1")
    llm = LLM(str(ckpt), mtp_step=3, **OPTS)
    assert (llm.runner.mtp_graphs is not None) == fused
    futures = {tuple(s): g for s, g in zip(seqs, greedy)}
    oracle_drafts(llm.runner, futures, wrong_every)
    got = llm.generate(seqs, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == greedy
    stats = llm.scheduler.stats()
    per_position = stats.mtp_accepted_per_position
    assert stats.mtp_drafts > 0 and per_position[0] >= per_position[1] >= per_position[2]
    if wrong_every == 1000:  # nearly every draft right: close to k + 1 tokens per verify step
        assert stats.mtp_mean_accept_len > 3.5
    elif wrong_every == 5:  # partial acceptance at every depth, and rejections
        assert 1.0 < stats.mtp_mean_accept_len < 3.5 and per_position[2] > 0
    else:  # every other draft wrong: never past the second position
        assert 1.0 < stats.mtp_mean_accept_len < 2.0 and per_position[1] == 0
    assert_pools_empty(llm)


def test_stop_tokens_strings_and_max_tokens_inside_accepted_runs(ckpt, reference):
    """With (nearly) every draft accepted, stops and length limits land inside multi-token runs:
    output must be truncated exactly as without MTP, and the rest of the run freed."""
    seqs, greedy, _ = reference
    plain = LLM(str(ckpt), **OPTS)
    params = []
    for i, g in enumerate(greedy):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[g[6 + i]]))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True))
        else:
            text = plain.tokenizer.decode(g[:12])
            params.append(
                SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop=[text[-3:]])
            )
    want = plain.generate(seqs, params)
    llm = LLM(str(ckpt), mtp_step=3, **OPTS)
    oracle_drafts(llm.runner, dict(zip(map(tuple, seqs), greedy)), 1000)
    got = llm.generate(seqs, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]
    assert llm.scheduler.stats().mtp_mean_accept_len > 2.5
    assert_pools_empty(llm)


def edited_params(greedy, sampled, vocab: int) -> list[SamplingParams]:
    """One request per kind of sampling edit, greedy and seeded (as `sampled` was), with logprobs
    on some; the min_tokens request bans the tokens its seeded run samples 4th and 6th."""
    seeded = dict(temperature=0.9, top_p=0.95, seed=11)
    allowed = list(range(0, vocab, 3))
    kinds = [
        dict(repetition_penalty=1.3, temperature=0),
        # bad words: a two-token word the greedy answer completes at its 7th token, one token
        dict(
            logprobs=2,
            temperature=0,
            bad_words_token_ids=[[greedy[1][5], greedy[1][6]], [(greedy[1][6] + 1) % vocab]],
        ),
        dict(presence_penalty=0.8, frequency_penalty=0.5, logprobs=3, **seeded),
        dict(logit_bias={greedy[3][2]: -100.0, 5: 4.0, 17: 3.0}, temperature=0),
        dict(min_tokens=12, stop_token_ids=[sampled[4][3], sampled[4][5]], **seeded),
        dict(allowed_token_ids=allowed, logprobs=1, **seeded),
        dict(repetition_penalty=1.2, logprobs=1, **seeded),
        dict(temperature=0, prompt_logprobs=1),  # scored prompt, then plain drafting
    ]
    return [SamplingParams(max_tokens=24, ignore_eos=i != 4, **kw) for i, kw in enumerate(kinds)]


def generate_scored(llm: LLM, seqs, params) -> list[tuple]:
    """Per request: its tokens, its tokens' (logprob, top [(token, logprob)]), its finish and its
    prompt logprobs."""
    scores: dict[int, list] = {}  # id of the output -> its entries
    apply = llm._apply

    def record(delta, update, out, params):
        entries = scores.setdefault(id(out), [])
        entries += [(e.logprob, [(t, v) for t, v, _ in e.top]) for e in delta.logprobs or []]
        apply(delta, update, out, params)

    llm._apply = record
    outs = llm.generate(seqs, params)

    def prompt_scores(o) -> list[float | None] | None:
        if o.prompt_logprobs is None:
            return None
        return [d and d[t].logprob for t, d in zip(o.prompt_token_ids, o.prompt_logprobs)]

    return [(o.token_ids, scores.get(id(o), []), o.finish_reason, prompt_scores(o)) for o in outs]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host"])
def test_edited_requests_draft_and_stay_lossless(ckpt, reference, fused, monkeypatch):
    """Penalties, logprobs, bad words, a logit bias, min_tokens and allowed ids: such requests
    draft too (the fused step edits their verify rows between forward and sampling, the host path
    samples them after their drafts) and decode exactly as with MTP off: the same tokens,
    logprobs and top logprobs. The drafts are the MTP-off output (nearly all accepted), so every
    verify row after the first samples behind drafts that a penalty must count and a bad word's
    prefix must match."""
    from appliance.engine.verify_edits import VerifyEdits

    seqs, greedy, sampled = reference
    off = LLM(str(ckpt), **OPTS)
    params = edited_params(greedy, sampled, off.runner.text_config.vocab_size)
    want = generate_scored(off, seqs, params)
    banned = set(params[4].stop_token_ids)
    assert not banned & set(want[4][0][:12]) and want[4][0][:3] == sampled[4][:3]
    bad = want[1][0]  # the bad word took effect where the greedy answer completed it
    assert bad[:6] == greedy[1][:6] and bad[6] != greedy[1][6]
    if not fused:
        monkeypatch.setenv("APPLIANCE_DISABLE_MTP_FUSED_GRAPH", "1")
    llm = LLM(str(ckpt), mtp_step=3, **OPTS)
    assert (llm.runner.mtp_graphs is not None) == fused
    edited = []
    apply = VerifyEdits.apply
    monkeypatch.setattr(
        VerifyEdits, "apply", lambda self, *a: edited.append(len(self.chunks)) or apply(self, *a)
    )
    oracle_drafts(llm.runner, {tuple(s): w[0] for s, w in zip(seqs, want)}, 1000)
    got = generate_scored(llm, seqs, params)
    assert [(g[0], g[2]) for g in got] == [(w[0], w[2]) for w in want]
    assert want[7][3] is not None and len(want[7][3]) == len(seqs[7])
    torch.testing.assert_close(got[7][3][1:], want[7][3][1:], atol=1e-4, rtol=1e-4)
    for (tokens, mine, *_), (_, theirs, *_), p in zip(got, want, params):
        assert len(mine) == len(theirs) == (len(tokens) if p.logprobs is not None else 0)
        assert [[t for t, _ in top] for _, top in mine] == [[t for t, _ in tp] for _, tp in theirs]
        values = [[lp, *(v for _, v in top)] for lp, top in mine]
        expected = [[lp, *(v for _, v in top)] for lp, top in theirs]
        # a verify row's forward against a decode's: the same up to float rounding
        torch.testing.assert_close(values, expected, atol=1e-4, rtol=1e-4)
    stats = llm.scheduler.stats()
    assert stats.mtp_mean_accept_len > 2.5  # 7 of the 8 requests are edited: they drafted
    assert bool(edited) == fused and (not fused or max(edited) >= 3)  # several a step
    assert_pools_empty(llm)


def test_abort_mid_generation_frees_everything(ckpt, reference):
    from appliance.router.request import Request

    seqs, greedy, _ = reference
    llm = LLM(str(ckpt), mtp_step=3, **OPTS)
    sched = llm.scheduler
    for i, seq in enumerate(seqs[:3]):
        sched.add_request(
            Request(
                req_id=f"r{i}",
                prompt_token_ids=seq,
                max_tokens=40,
                sampling=SamplingParams(temperature=0).to_options(),
                ignore_eos=True,
            )
        )
    outputs: dict[str, list[int]] = {"r0": [], "r1": [], "r2": []}
    steps = 0
    while sched.has_work():
        result = llm.runner.execute(sched.schedule())
        for delta in sched.update(result):
            outputs[delta.req_id].extend(delta.new_token_ids)
        steps += 1
        if steps == 4:
            sched.abort("r1")  # mid-generation, with drafts outstanding on the worker
    assert outputs["r0"] == greedy[0][:40] and outputs["r2"] == greedy[2][:40]
    assert len(outputs["r1"]) < 40
    assert_pools_empty(llm)
