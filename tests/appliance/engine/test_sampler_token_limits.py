"""vLLM's min_tokens and allowed_token_ids in the worker's sampler: eos and the stop ids are not
sampled before min_tokens generated tokens; only the allowed ids are sampled; both hold for
greedy and sampled rows; the fused MTP step edits such rows while the ban is in force."""

from __future__ import annotations

import msgspec
import pytest
import torch

from appliance.engine.sampler import Sampler, apply_allowed_ids, apply_min_tokens, needs_edits
from appliance.messages import SamplingOptions, decoder, encode
from appliance.sampling_params import SamplingParams

EOS = 3
PROCESSED = Sampler(
    "processed_logprobs"
)  # logprobs of what can be sampled (greedy: no temperature)


def test_min_tokens_bans_eos_and_stop_ids_until_enough_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]]).repeat(4, 1)  # eos (3) then 4 lead
    row = SamplingOptions(temperature=0.0, logprobs=0, min_tokens=3, min_tokens_ban=[EOS, 4])
    # prompt of 10 tokens: offsets 10, 11, 12 sample generated tokens 1-3, offset 13 the 4th
    out = PROCESSED.sample(logits, [row] * 4, None, [10, 11, 12, 13], prompt_lens=[10] * 4)
    assert out.token_ids.tolist() == [2, 2, 2, EOS]
    assert out.logprobs[0] > -0.5  # of what can be sampled: eos and 4 are out
    sampled = SamplingOptions(temperature=1.0, seed=5, min_tokens=2, min_tokens_ban=[EOS, 4])
    many = PROCESSED.sample(logits.repeat(8, 1)[:8], [sampled] * 8, None, list(range(8)), [0] * 8)
    assert not {EOS, 4} & set(many.token_ids[:2].tolist())


def test_allowed_token_ids_and_rows_without_limits_untouched() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [0.0, 1.0, 2.0, 9.0]])
    rows = [SamplingOptions(allowed_token_ids=[0, 1]), SamplingOptions()]
    out = apply_allowed_ids(logits, rows)
    assert out[0].tolist() == [0.0, 1.0, float("-inf"), float("-inf")]
    assert out[1].tolist() == logits[1].tolist() and logits[0, 3] == 9.0  # input not modified
    assert apply_allowed_ids(logits, [SamplingOptions()] * 2) is logits
    assert apply_min_tokens(logits, [SamplingOptions()] * 2, [0, 0], None) is logits
    seeded = [SamplingOptions(temperature=1.0, seed=s, allowed_token_ids=[0, 1]) for s in range(16)]
    drawn = Sampler().sample(torch.zeros(16, 4), seeded, None, [0] * 16).token_ids.tolist()
    assert set(drawn) == {0, 1}


def test_a_ban_that_would_leave_nothing_yields() -> None:
    """allowed_token_ids (or a grammar) leaving only eos while min_tokens bans it: the row samples
    eos rather than from nothing (token 0 and NaN logprobs)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [0.0, 1.0, 2.0, 9.0]])
    only_eos = SamplingOptions(
        temperature=0.0, logprobs=0, allowed_token_ids=[EOS], min_tokens=4, min_tokens_ban=[EOS]
    )
    other = SamplingOptions(temperature=0.0, logprobs=0, min_tokens=4, min_tokens_ban=[EOS])
    out = PROCESSED.sample(logits, [only_eos, other], None, [5, 5], prompt_lens=[5, 5])
    assert out.token_ids.tolist() == [EOS, 2]
    assert all(lp == lp and lp > -1 for lp in out.logprobs)  # finite, no NaN


def test_validation_wire_and_mtp() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    options = SamplingParams(max_tokens=8, min_tokens=4, allowed_token_ids=[7, 5, 7]).to_options()
    assert options.min_tokens == 4 and options.allowed_token_ids == [5, 7]
    assert decoder(SamplingOptions).decode(encode(options)) == options
    assert needs_edits(options, 10) and not needs_edits(SamplingParams().to_options(), 0)
    banning = msgspec.structs.replace(
        SamplingParams(max_tokens=8, min_tokens=2).to_options(), min_tokens_ban=[EOS]
    )
    assert needs_edits(banning, 1) and not needs_edits(banning, 2)  # the ban is over at 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_min_tokens_and_allowed_token_ids_on_the_gpu(tiny_dense) -> None:
    """The same through the served GPU path: CUDA graphs for decode, the Triton sampling kernel
    for sampled rows, the router's ban filled at admission."""
    from appliance import LLM

    llm = LLM(str(tiny_dense), device="cuda", max_num_seqs=4, num_kv_slots=2048, max_model_len=256)
    prompt = [11, 300, 42, 7, 99]
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
        stopped = SamplingParams(max_tokens=12, stop_token_ids=[first], min_tokens=6, **sampling)
        [out] = llm.generate(prompt, stopped)
        assert len(out.token_ids) >= 6 and first not in out.token_ids[:6], sampling
        allowed = SamplingParams(max_tokens=8, allowed_token_ids=[50, 60, 70], **sampling)
        [only] = llm.generate([prompt, prompt], allowed)[:1]
        assert len(only.token_ids) == 8 and set(only.token_ids) <= {50, 60, 70}, sampling


def test_top_logprobs_past_what_can_be_sampled_do_not_depend_on_the_batch() -> None:
    """Fewer allowed ids than top logprobs asked: the rest of the list reads the floor, and which
    ids fill it is the row's own top-k (not the batch's widest), so the same request lists the
    same tokens alone and beside one asking for more (as with MTP on and off)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 64)
    narrow = SamplingOptions(temperature=0.0, logprobs=4, allowed_token_ids=[7, 9])
    wide = SamplingOptions(temperature=0.0, logprobs=20)
    alone = PROCESSED.sample(logits[:1], [narrow], None, [0])
    batched = PROCESSED.sample(logits, [narrow, wide], None, [0, 0])
    assert alone.top_logprobs[0] == batched.top_logprobs[0]
    assert [v for _, v in alone.top_logprobs[0][2:]] == [-9999.0, -9999.0]
    assert len(batched.top_logprobs[1]) == 20


def test_a_row_left_nothing_to_sample_reports_the_floor_not_nan() -> None:
    """allowed ids that a grammar mask forbids: every logit is -inf; JSON has no NaN."""
    row = SamplingOptions(temperature=0.0, logprobs=2, allowed_token_ids=[1])
    mask = torch.tensor([[1 << 2]], dtype=torch.int32)  # the grammar allows only id 2
    out = PROCESSED.sample(torch.zeros(1, 8), [row], None, [0], token_bitmask=mask)
    assert out.logprobs[0] == -9999.0 and all(v == -9999.0 for _, v in out.top_logprobs[0])


def test_bad_words_ban_the_token_that_would_complete_them() -> None:
    """vLLM's bad_words: a one-token word is never sampled; a longer word's last token only where
    the output (not the prompt) ends with the rest of it; several words of one row at once; a ban
    that would leave nothing to sample yields."""
    from appliance.engine.sampler import apply_bad_words, needs_history

    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 7.0]]).repeat(5, 1)
    words = [[3], [1, 2, 4], [2, 5]]
    row = SamplingOptions(temperature=0.0, bad_words=words)
    history = [
        torch.tensor([7, 1, 2]),  # output [1, 2]: [1, 2, 4] -> 4 banned, [2, 5] -> 5
        torch.tensor([1, 2, 2]),  # prompt [1, 2], output [2]: [1, 2] spans the prompt; [2] -> 5
        torch.tensor([0, 0, 0]),  # nothing matches: only the one-token word
        torch.tensor([9, 1]),  # one output token: [1, 2, 4] cannot be completed yet
        torch.tensor([9, 9, 1, 2]),  # output [1, 2] -> 4; the tail also ends "2" -> 5
    ]
    prompt_lens = [1, 2, 3, 1, 2]
    out = apply_bad_words(logits, [row] * 5, history, prompt_lens)
    inf = float("-inf")
    assert out[0].tolist() == [0.0, 1.0, 2.0, inf, inf, inf]
    assert out[1].tolist() == [0.0, 1.0, 2.0, inf, 8.0, inf]
    assert out[2].tolist() == [0.0, 1.0, 2.0, inf, 8.0, 7.0]
    assert out[3].tolist() == out[2].tolist()
    assert out[4].tolist() == [0.0, 1.0, 2.0, inf, inf, inf]
    assert (
        logits[0, 3] == 9.0
        and apply_bad_words(logits, [SamplingOptions()] * 5, None, None) is logits
    )
    assert needs_history(row) and not needs_history(SamplingOptions(bad_words=[[3]]))
    # through the sampler (greedy: the best allowed), and nothing left to sample yields
    sampled = Sampler().sample(logits, [row] * 5, history, [9] * 5, prompt_lens)
    assert sampled.token_ids.tolist() == [2, 4, 4, 4, 2]
    only = SamplingOptions(temperature=0.0, allowed_token_ids=[3], bad_words=[[3]])
    assert Sampler().sample(logits[:1], [only], history[:1], [3], [1]).token_ids.tolist() == [3]
    with pytest.raises(ValueError, match="token_history"):
        Sampler().sample(logits[:1], [row], None, [3], [1])


def test_bad_words_tokenized_as_vllm_reads_them() -> None:
    """Each word alone and after a space (a word mid-text), when the space makes another first
    token in as many tokens; the wire carries the sequences; not tokenized is an error."""
    vocab = {"cat": [10], " cat": [11], "big dog": [12, 13], " big dog": [14, 13], "ox": [15]}
    vocab[" ox"] = [16, 15]  # the space adds a token: not another spelling of the word
    params = SamplingParams(bad_words=["cat", "  big dog", "ox"]).tokenize_bad_words(vocab.get)
    assert params.bad_words_token_ids == [[10], [11], [12, 13], [14, 13], [15]]
    options = params.to_options()
    assert options.bad_words == [[10], [11], [12, 13], [14, 13], [15]]
    assert decoder(SamplingOptions).decode(encode(options)) == options
    assert needs_edits(options, 0)
    with pytest.raises(ValueError, match="bad_words: not tokenized"):
        SamplingParams(bad_words=["cat"]).to_options()
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
