"""Detokenizer: UTF-8-safe incremental text, stop strings across token boundaries, length/eos
finishes, logprob entries, rejected requests."""

from __future__ import annotations

import pytest

from appliance.detokenizer.detokenizer import Detokenizer
from appliance.messages import DetokParams, DetokRegister, RouterOutput, TokenUpdate

TEXT = "héllo 你好 🙂 world, STOP here"


def _stream(
    detok: Detokenizer,
    req_id: str,
    ids: list[int],
    params: DetokParams,
    finish_at_end: str | None = "length",
    per_update: int = 1,
):
    """Feeds ids `per_update` at a time; returns (deltas, finishes sent to the router)."""
    out, fin = detok.process(RouterOutput(registers=[DetokRegister(req_id, 3, params)]))
    assert out.deltas == [] and fin == []
    deltas, finishes = [], []
    chunks = [ids[i : i + per_update] for i in range(0, len(ids), per_update)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        reason = finish_at_end if last else None
        out, fin = detok.process(RouterOutput(updates=[TokenUpdate(req_id, chunk, reason)]))
        deltas += out.deltas
        finishes += fin
    return deltas, finishes


def test_utf8_never_broken(hf_tokenizer, text_tokenizer):
    ids = hf_tokenizer.encode(TEXT)
    # The multibyte characters really are split over several byte tokens.
    assert len(ids) > len(TEXT.split())
    assert any("\ufffd" in hf_tokenizer.decode([i]) for i in ids)
    detok = Detokenizer(text_tokenizer)
    deltas, finishes = _stream(detok, "r", ids, DetokParams())
    for d in deltas:
        assert "\ufffd" not in d.text
        d.text.encode("utf-8")  # a lone surrogate would raise
    assert "".join(d.text for d in deltas) == TEXT
    assert sum(len(d.token_ids) for d in deltas) == len(ids)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == len(ids)
    assert finishes == []  # the router finished it (length): nothing to send back
    assert detok.num_live == 0


def test_invalid_bytes_flushed_at_finish(hf_tokenizer, text_tokenizer):
    # A lone lead byte never completes: it is held, then released as U+FFFD when the request ends.
    lead = hf_tokenizer.encode("你")[0]
    ids = hf_tokenizer.encode("ab") + [lead]
    deltas, _ = _stream(Detokenizer(text_tokenizer), "r", ids, DetokParams())
    assert all("\ufffd" not in d.text for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == "ab\ufffd"
    assert deltas[-1].text == "\ufffd"


def test_stop_string_across_tokens(hf_tokenizer, text_tokenizer):
    ids = hf_tokenizer.encode(TEXT)
    for stop in (["STOP"], ["TO"], ["ld, S"], ["🙂"], ["nomatch", "好 "]):
        detok = Detokenizer(text_tokenizer)
        deltas, finishes = _stream(detok, "r", ids, DetokParams(stop=stop), finish_at_end=None)
        cut = min(TEXT.find(s) for s in stop if s in TEXT)
        assert "".join(d.text for d in deltas) == TEXT[:cut], stop
        assert deltas[-1].finish_reason == "stop"
        # The router is told to finish (free slots) exactly once.
        assert [f.req_id for f in finishes] == ["r"]
        # Tokens after the one that completed the stop string are not counted.
        assert deltas[-1].num_output_tokens < len(ids)
        # Held-back text never leaked a partial stop string before the stop.
        for d in deltas:
            assert stop[0] not in d.text
        assert detok.num_live == 0


def test_stop_included_and_multi_token_updates(hf_tokenizer, text_tokenizer):
    ids = hf_tokenizer.encode(TEXT)
    params = DetokParams(stop=["world"], include_stop_str_in_output=True)
    deltas, finishes = _stream(Detokenizer(text_tokenizer), "r", ids, params, None, per_update=4)
    assert "".join(d.text for d in deltas) == TEXT[: TEXT.find("world") + 5]
    consumed = sum(len(d.token_ids) for d in deltas)
    assert hf_tokenizer.decode(ids[:consumed]).endswith("world")
    assert len(finishes) == 1


@pytest.mark.parametrize("per_update", [1, 3])
def test_min_tokens_holds_stop_strings(hf_tokenizer, text_tokenizer, per_update):
    # vLLM: a stop string counts only once more than min_tokens tokens are generated, i.e. the
    # first match that ends past the text of the first min_tokens tokens
    text = "a STOP b STOP c STOP end"
    ids = hf_tokenizer.encode(text)
    for min_tokens in range(len(ids) + 1):
        floor = len(hf_tokenizer.decode(ids[:min_tokens]))
        ends = [i + 4 for i in range(len(text)) if text.startswith("STOP", i) and i + 4 > floor]
        expected = text[: ends[0] - 4] if ends else text
        params = DetokParams(stop=["STOP"], min_tokens=min_tokens)
        deltas, finishes = _stream(
            Detokenizer(text_tokenizer), "r", ids, params, "length", per_update=per_update
        )
        assert "".join(d.text for d in deltas) == expected, min_tokens
        assert deltas[-1].finish_reason == ("stop" if ends else "length"), min_tokens
        assert len(finishes) == (1 if ends else 0)


def test_held_prefix_released_when_no_stop(hf_tokenizer, text_tokenizer):
    # "STO" could start "STOX": held back until the end of the request, then released.
    ids = hf_tokenizer.encode("abc STO") + [hf_tokenizer.eos_token_id]
    deltas, finishes = _stream(
        Detokenizer(text_tokenizer), "r", ids, DetokParams(stop=["STOX"]), finish_at_end="stop"
    )
    assert "".join(d.text for d in deltas) == "abc STO"
    assert deltas[-1].finish_reason == "stop" and finishes == []


def test_special_tokens_skipped_or_kept(hf_tokenizer, text_tokenizer):
    ids = hf_tokenizer.encode("hi") + [hf_tokenizer.eos_token_id]
    deltas, _ = _stream(Detokenizer(text_tokenizer), "a", ids, DetokParams(), "stop")
    assert "".join(d.text for d in deltas) == "hi"
    assert deltas[-1].num_output_tokens == len(ids)
    # the eos that stopped the request is left out even as text, unless stops are kept
    for keep, text in ((False, "hi"), (True, "hi<|im_end|>")):
        params = DetokParams(skip_special_tokens=False, include_stop_str_in_output=keep)
        deltas, _ = _stream(Detokenizer(text_tokenizer), f"b{keep}", ids, params, "stop")
        assert "".join(d.text for d in deltas) == text
        assert deltas[-1].num_output_tokens == len(ids)


@pytest.mark.parametrize("per_update", [1, 3])
def test_a_stop_token_counts_but_its_text_is_left_out(hf_tokenizer, text_tokenizer, per_update):
    """The router's "stop" ends on the stop_token_ids token that matched (a plain word here): it
    counts and keeps its logprob entry, its text is not in the output unless stops are kept, as
    vLLM and SGLang do; a "length" finish keeps every token's text."""
    ids = hf_tokenizer.encode("The quick brown")
    head = hf_tokenizer.decode(ids[:-1])
    for finish, keep, text in (
        ("stop", False, head),
        ("stop", True, "The quick brown"),
        ("length", False, "The quick brown"),
    ):
        params = DetokParams(include_stop_str_in_output=keep, logprobs=True)
        detok = Detokenizer(text_tokenizer)
        deltas, _ = _stream(detok, "r", ids, params, finish, per_update=per_update)
        assert "".join(d.text for d in deltas) == text, (finish, keep)
        assert deltas[-1].num_output_tokens == len(ids)
        assert [t for d in deltas for t in d.token_ids] == ids


def test_logprob_entries(hf_tokenizer, text_tokenizer):
    ids = hf_tokenizer.encode("hé")
    detok = Detokenizer(text_tokenizer)
    detok.process(RouterOutput(registers=[DetokRegister("r", 1, DetokParams(logprobs=True))]))
    update = TokenUpdate(
        "r",
        ids,
        "length",
        logprobs=[-0.5] * len(ids),
        top_logprobs=[[(i, -0.5), (ids[0], -1.0)] for i in ids],
    )
    out, _ = detok.process(RouterOutput(updates=[update]))
    (delta,) = out.deltas
    assert delta.text == "hé"
    assert [e.logprob for e in delta.logprobs] == [-0.5] * len(ids)
    assert b"".join(bytes(e.bytes) for e in delta.logprobs) == "hé".encode()
    assert delta.logprobs[0].top[1][0] == "h" and delta.logprobs[0].top[1][1] == -1.0


def test_rejection_and_stale_updates(text_tokenizer):
    detok = Detokenizer(text_tokenizer)
    out, _ = detok.process(
        RouterOutput(
            updates=[
                TokenUpdate("gone", [5], None),  # unknown request (already stopped): dropped
                TokenUpdate("rej", [], "error", error="queue full", error_status=429),
            ]
        )
    )
    (delta,) = out.deltas
    assert (delta.req_id, delta.finish_reason, delta.error, delta.error_status) == (
        "rej",
        "error",
        "queue full",
        429,
    )


def test_many_requests_in_one_batch(hf_tokenizer, text_tokenizer):
    detok = Detokenizer(text_tokenizer)
    texts = [f"request {i} says héllo" for i in range(16)]
    all_ids = [hf_tokenizer.encode(t) for t in texts]
    detok.process(
        RouterOutput(registers=[DetokRegister(f"r{i}", 1, DetokParams()) for i in range(16)])
    )
    got = {f"r{i}": "" for i in range(16)}
    for step in range(max(len(x) for x in all_ids)):
        updates = [
            TokenUpdate(f"r{i}", [ids[step]], "length" if step == len(ids) - 1 else None)
            for i, ids in enumerate(all_ids)
            if step < len(ids)
        ]
        out, _ = detok.process(RouterOutput(updates=updates))
        for d in out.deltas:
            got[d.req_id] += d.text
    assert got == {f"r{i}": t for i, t in enumerate(texts)}
    assert detok.num_live == 0
