"""vLLM's use_beam_search through the real processes on the tiny dense checkpoint: completions
and chat answer n beams, the offline LLM's beam search's sequences, best first; what beam search
does not do is a 400 naming the field; streamed (the openai SDK), the same beams at the end, as
vLLM streams them; afterwards nothing is held."""

from __future__ import annotations

import json

import pytest

from appliance import LLM, BeamSearchParams


@pytest.fixture(scope="module")
def offline(tiny_dense):
    return LLM(str(tiny_dense), num_kv_slots=4096, max_num_seqs=16)


def test_completions_and_chat_answer_the_offline_beams(http, offline):
    prompt = [11, 300, 42, 7, 99]
    body = {"prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True}
    r = http.post("/completions", json={**body, "ignore_eos": True, "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    answer = r.json()
    [want] = offline.beam_search([prompt], BeamSearchParams(3, 5, True, length_penalty=0.5))
    assert [c["text"] for c in answer["choices"]] == [s.text for s in want.sequences]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 15,
        "total_tokens": 20,
        "prompt_tokens_details": answer["usage"]["prompt_tokens_details"],
    }
    two = http.post("/completions", json={**body, "prompt": [prompt, prompt[:3]], "n": 2}).json()
    assert len(two["choices"]) == 4 and [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    ids = http.post("/completions", json={**body, "ignore_eos": True, "return_token_ids": True})
    beams = ids.json()["choices"]  # vLLM's return_token_ids: each beam's ids, its prompt's
    assert [c["token_ids"] for c in beams] == [s.tokens[len(prompt) :] for s in want.sequences]
    assert all(c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 5 for c in beams)
    messages = [{"role": "user", "content": "hello"}]
    chat = http.post(
        "/chat/completions",
        json={"messages": messages, "max_tokens": 4, "n": 2, "use_beam_search": True},
    )
    assert chat.status_code == 200, chat.text
    choices = chat.json()["choices"]
    assert len(choices) == 2 and all(c["message"]["role"] == "assistant" for c in choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_what_beam_search_does_not_do_is_refused(http, extra, param):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, **extra}
    r = http.post("/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_streamed_beams_are_the_answers_beams(http, sdk, model):
    """A stream carries each choice's opening, its whole text and finish_reason, the usage chunk
    when asked, [DONE]; the texts and usage are those of the JSON answer."""
    body = {"prompt": [11, 300, 42, 7, 99], "max_tokens": 5, "n": 3, "use_beam_search": True}
    want = http.post("/completions", json={**body, "ignore_eos": True}).json()
    streamed = {**body, "ignore_eos": True, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    with http.stream("POST", "/completions", json={**streamed, **usage}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    texts = {}
    for c in chunks[:-1]:
        [choice] = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert choice["finish_reason"] == "length" and c["usage"] is None
    assert [texts[i] for i in range(3)] == [c["text"] for c in want["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == want["usage"]
    chat = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        n=2,
        stream=True,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    got, roles, finishes = {0: "", 1: ""}, set(), {}
    for chunk in chat:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.delta.role)
            got[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    answer = http.post(
        "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "n": 2,
            "use_beam_search": True,
            "ignore_eos": True,
        },
    ).json()
    assert [got[i] for i in range(2)] == [c["message"]["content"] for c in answer["choices"]]
    assert roles == {"assistant"} and finishes == {0: "length", 1: "length"}


def test_afterwards_nothing_is_held(appliance):
    router = appliance.status()["router"]
    assert router["kv_used"] == 0 and router["num_running"] == 0
