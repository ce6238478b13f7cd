"""Beam search (appliance/beam_search.py, vLLM's algorithm): wide enough it is the exhaustive
search by vLLM's score; width 1 is greedy; length_penalty weighs long beams; offline
`LLM.beam_search` on the tiny model: width 1 is the greedy answer and every beam's cumulative
logprob is the model's own score of its tokens."""

from __future__ import annotations

import itertools
import math

import pytest

from appliance import LLM, BeamSearchParams, SamplingParams
from appliance.beam_search import BeamSearch

EOS = 3
VOCAB = 4


def table(last: int) -> list[float]:
    """A Markov toy model: the next token's logprobs given the last one (uneven, no ties)."""
    weights = [(7 * last + 3 * t) % 11 + 1 + 0.1 * t for t in range(VOCAB)]
    total = sum(weights)
    return [math.log(w / total) for w in weights]


def run(search: BeamSearch) -> list[tuple[list[int], float]]:
    while not search.done:
        tops = []
        for ids in search.prompts():
            row = table(ids[-1])
            best = sorted(range(VOCAB), key=lambda t: -row[t])[: search.num_top]
            tops.append([(t, row[t]) for t in best])
        search.advance(tops)
    return [(b.tokens, b.cum_logprob) for b in search.result()]


def exhaustive(prompt: list[int], max_tokens: int, width: int, penalty: float):
    """Every sequence (ended at eos, or at max_tokens) ranked by vLLM's score."""
    found = []
    for n in range(1, max_tokens + 1):
        for seq in itertools.product(range(VOCAB), repeat=n):
            if EOS in seq[:-1] or (n < max_tokens and seq[-1] != EOS):
                continue
            last, cum = prompt[-1], 0.0
            for t in seq:
                cum += table(last)[t]
                last = t
            length = len(prompt) + n - (seq[-1] == EOS)
            found.append((list(seq), cum, cum / length**penalty))
    found.sort(key=lambda f: -f[2])
    return [(seq, cum) for seq, cum, _ in found[:width]]


@pytest.mark.parametrize("penalty", [1.0, 0.0, 2.0])
def test_wide_beams_are_the_exhaustive_search(penalty: float) -> None:
    params = BeamSearchParams(beam_width=64, max_tokens=3, length_penalty=penalty)
    search = BeamSearch([1, 2], params, [EOS])
    got = run(search)
    want = exhaustive([1, 2], 3, 64, penalty)  # all 40 sequences: ties may come in any order
    assert sorted(map(tuple, (seq for seq, _ in got))) == sorted(map(tuple, (s for s, _ in want)))
    assert [search.score(b) for b in search.result()] == pytest.approx(
        [c / (2 + len(s) - (s[-1] == EOS)) ** penalty for s, c in want]
    )


def test_width_one_without_eos_is_greedy_and_ended_beams_are_kept() -> None:
    got = run(BeamSearch([0], BeamSearchParams(1, 6, ignore_eos=True), [EOS]))
    last, greedy = 0, []
    for _ in range(6):
        last = max(range(VOCAB), key=lambda t: table(last)[t])
        greedy.append(last)
    assert got[0][0] == greedy
    ended = BeamSearch([0], BeamSearchParams(2, 5), [EOS])
    run(ended)
    assert ended.completed and all(b.tokens[-1] == EOS for b in ended.completed)
    assert all(EOS not in b.tokens for b in ended.live)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)


def test_offline_beam_search(tiny_dense) -> None:
    llm = LLM(str(tiny_dense), num_kv_slots=2048, max_num_seqs=16)
    prompt = [11, 300, 42, 7, 99]
    [greedy] = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    [one] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(1, 6, True))
    assert one.sequences[0].tokens == prompt + greedy.token_ids
    [three] = llm.beam_search([prompt], BeamSearchParams(3, 5, True))
    seqs = three.sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    scores = [s.cum_logprob / len(s.tokens) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    for seq in seqs:  # the model's own score of the beam's tokens (prompt logprobs)
        [scored] = llm.generate(
            [seq.tokens], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        )
        own = sum(
            d[t].logprob for t, d in zip(seq.tokens[len(prompt) :], scored.prompt_logprobs[5:])
        )
        assert seq.cum_logprob == pytest.approx(own, abs=1e-3)
        assert seq.text == llm.get_tokenizer().decode(seq.tokens[5:], skip_special_tokens=True)
        assert seq.finish_reason == "length"


def test_the_servers_reading_of_a_request() -> None:
    from appliance.server.errors import BadRequest
    from appliance.server.protocol import CompletionRequest
    from appliance.server.serving_beam import beam_params, check_beam_request

    body = CompletionRequest(prompt="hi", n=3, use_beam_search=True, length_penalty=0)
    assert beam_params(body, 7, True) == BeamSearchParams(3, 7, True, 0.0, 0.0)
    unset = CompletionRequest(prompt="hi", n=2, use_beam_search=True)
    assert beam_params(unset, 5, False).length_penalty == 1.0
    check_beam_request(CompletionRequest(prompt="hi", stream=True, use_beam_search=True))  # streams
    with pytest.raises(BadRequest, match="logprobs"):
        check_beam_request(CompletionRequest(prompt="hi", logprobs=1, use_beam_search=True))
    for field, value in (("presence_penalty", 0.5), ("repetition_penalty", 1.2), ("min_tokens", 2)):
        with pytest.raises(BadRequest, match=field):
            check_beam_request(
                CompletionRequest(prompt="hi", use_beam_search=True, **{field: value})
            )
    neutral = dict(presence_penalty=0, repetition_penalty=1, min_tokens=0, temperature=0.7)
    check_beam_request(CompletionRequest(prompt="hi", use_beam_search=True, **neutral))
