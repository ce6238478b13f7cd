"""The OpenAI routes against the scripted engine: responses, streams, usage, stop, n, logprobs."""

from __future__ import annotations

import json

import openai
import pytest

from appliance.server import serving_chat

REPLY = "hello world héllo"


def sse_events(lines) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def chat(client, **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    return client.post("/v1/chat/completions", json=body)


def test_models_and_health(make_server):
    client, _, _ = make_server()
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == 256
    assert client.get("/health").status_code == 200


def test_unset_sampling_fields_take_the_generation_config_defaults(make_server):
    client, engine, state = make_server()
    state.sampling_defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert chat(client).status_code == 200
    assert chat(client, temperature=0, top_p=1.0).status_code == 200  # set fields win
    assert client.post("/v1/completions", json={"prompt": "x", "top_k": 5}).status_code == 200
    first, second, third = (r.sampling for r in engine.received)
    assert (first.temperature, first.top_k, first.top_p) == (0.6, 20, 0.95)
    assert (second.temperature, second.top_k, second.top_p) == (0.0, 20, 1.0)
    assert (third.temperature, third.top_k, third.top_p) == (0.6, 5, 0.95)
    state.sampling_defaults = {}  # --generation-config none: OpenAI's
    assert chat(client).status_code == 200
    last = engine.received[-1].sampling
    assert (last.temperature, last.top_k, last.top_p) == (1.0, -1, 1.0)


def test_max_new_tokens_caps_every_request(make_server):
    # generation_config.json's max_new_tokens: vLLM takes the least of it, the request's
    # max_tokens and the context's room
    client, engine, state = make_server()
    state.sampling_defaults = {"temperature": 0.6, "max_tokens": 5}
    assert chat(client).status_code == 200
    assert chat(client, max_tokens=3).status_code == 200
    assert chat(client, max_completion_tokens=50).status_code == 200
    assert [r.max_tokens for r in engine.received] == [5, 3, 5]
    assert chat(client, min_tokens=6).status_code == 400  # more than the cap leaves


def test_not_ready_is_503(make_server):
    client, _, _ = make_server(ready=False)
    assert client.get("/health").status_code == 503
    r = chat(client)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"


def test_chat_non_stream(make_server, tokenizer):
    client, engine, state = make_server()
    r = chat(client)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert engine.received[0].prompt_token_ids == prompt_ids
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(reply_ids) + 1,  # + eos
        "total_tokens": len(prompt_ids) + len(reply_ids) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    # The whole context is left for generation when max_tokens is not given.
    assert engine.received[0].max_tokens == 256 - len(prompt_ids)


def test_chat_stream_matches_non_stream(make_server, tokenizer):
    client, _, _ = make_server()
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert usage_chunk["usage"]["completion_tokens"] == len(reply_ids) + 1  # + eos
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"]
    )
    assert all(c["usage"] is None for c in chunks[:-1])


def test_max_tokens_length_and_alias(make_server):
    client, engine, _ = make_server()
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat(client, **{field: 3}).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3
    assert [r.max_tokens for r in engine.received] == [3, 3]
    # max_completion_tokens (OpenAI's current name) wins when both are set, as in vLLM.
    chat(client, max_tokens=2, max_completion_tokens=5)
    assert engine.received[-1].max_tokens == 5


def test_null_for_a_defaulted_field_is_its_default(make_server):
    """The OpenAI SDKs send an explicit None as null; OpenAI's spec marks n, stream, logprobs,
    echo ... nullable: null is the default, not a 400."""
    client, engine, _ = make_server()
    nulls = dict.fromkeys(["n", "stream", "logprobs", "parallel_tool_calls", "ignore_eos"])
    r = chat(client, max_tokens=3, **nulls, add_generation_prompt=None, skip_special_tokens=None)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": None, "n": None}
    )
    assert r.status_code == 200, r.text
    assert not r.json()["choices"][0]["text"].startswith("hi")  # no echo
    # a field with no default stays required
    r = client.post("/v1/completions", json={"prompt": None})
    assert r.status_code == 400 and "prompt" in r.text


def test_stop_string(make_server):
    client, engine, _ = make_server()
    body = chat(client, stop=["world"]).json()
    assert body["choices"][0]["message"]["content"] == "hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.finished_by_detok == [engine.received[0].req_id]
    body = chat(client, stop="wor", include_stop_str_in_output=True).json()
    assert body["choices"][0]["message"]["content"] == "hello wor"


def test_n_choices_and_sampling_fields(make_server):
    client, engine, _ = make_server()
    body = chat(
        client,
        n=2,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
        max_tokens=4,
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 8
    a, b = engine.received
    assert a.req_id != b.req_id and (a.sampling.seed, b.sampling.seed) == (11, 12)
    s = a.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 5, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert a.ignore_eos and s.logprobs is None


def test_chat_logprobs(make_server, tokenizer):
    client, engine, _ = make_server()
    body = chat(client, logprobs=True, top_logprobs=2, max_tokens=3).json()
    content = body["choices"][0]["logprobs"]["content"]
    ids = tokenizer.encode(REPLY, add_special_tokens=False)[:3]
    assert [e["token"] for e in content] == [tokenizer.decode([i]) for i in ids]
    assert all(e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2 for e in content)
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]
    assert engine.received[0].sampling.logprobs == 2


def test_completions_prompts(make_server, tokenizer):
    client, engine, _ = make_server()
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 50}
    ).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["finish_reason"] == "stop"
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    body = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True}
    ).json()
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert body["choices"][0]["text"] == "hello world" + tokenizer.decode(reply_ids[:2])
    assert engine.received[-1].prompt_token_ids == ids
    body = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1}
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 4
    body = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 1}
    ).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 1


def test_openai_sdk_against_app(make_server):
    client, _, _ = make_server()
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    out = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == REPLY
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    comp = sdk.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert comp.choices[0].finish_reason == "length"


def test_usage_counts_reasoning_tokens_as_openai(make_server, tokenizer, monkeypatch):
    """usage.completion_tokens_details.reasoning_tokens: the tokens up to and with </think> of
    each choice that reasoned (all of them when reasoning is cut short), JSON and streamed, over
    every choice; 0 without reasoning. (This tokenizer spells </think> a character a token: its
    "/", which the text has once, stands in for Qwen's one </think> token.)"""
    think = tokenizer.encode("<think>\nplan a b\n</think>", add_special_tokens=False)
    answer = tokenizer.encode("\n\nanswer", add_special_tokens=False)
    slash = tokenizer.convert_tokens_to_ids("/")
    assert (think + answer).count(slash) == 1
    monkeypatch.setattr(serving_chat, "think_end_id", lambda state: slash)
    reply = think + answer
    client, _, _ = make_server(script=lambda prompt: reply, reasoning="on")
    think = think[: think.index(slash) + 1]  # what counts as reasoning
    out = chat(client, n=2, seed=1).json()
    assert out["choices"][0]["message"]["reasoning_content"] == "plan a b"
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * len(think)}
    body = {"stream": True, "stream_options": {"include_usage": True}}
    assert _chunks(chat(client, **body))[-1]["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": len(think)
    }
    body["stream_options"]["continuous_usage_stats"] = True
    counts = [
        c["usage"]["completion_tokens_details"]["reasoning_tokens"]
        for c in _chunks(chat(client, **body))
    ]
    assert counts == sorted(counts) and counts[-1] == len(think)
    # cut inside the reasoning: every token is a reasoning token
    out = chat(client, max_tokens=10).json()
    assert out["choices"][0]["message"]["reasoning_content"] == "pl"
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}
    # no reasoning: the output is all content
    plain, _, _ = make_server(script=lambda prompt: answer, reasoning="on")
    out = chat(plain).json()
    assert "reasoning_content" not in out["choices"][0]["message"]
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    made = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert made.usage.completion_tokens_details.reasoning_tokens == len(think)


def _chunks(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line[:7] == "data: {"]


def test_debug_status_and_metrics(make_server):
    client, _, _ = make_server()
    chat(client)
    status = client.get("/debug/status").json()
    assert status["router"]["kv_total"] == 8 and status["router"]["num_running"] == 0
    assert status["server"]["open_sequences"] == 0
    metrics = client.get("/metrics").text
    assert (
        'appliance_requests_finished_total{finish_reason="stop",model_name="tiny"} 1.0' in metrics
    )
    assert "appliance_time_to_first_token_seconds_count" in metrics


@pytest.mark.parametrize("thinking", [False, True])
def test_reasoning_split(make_server, tokenizer, thinking):
    text = "<think>\nplan\n</think>\n\nanswer"
    ids = tokenizer.encode(text, add_special_tokens=False)
    client, _, _ = make_server(script=lambda prompt: ids, reasoning="on")
    msg = chat(client, chat_template_kwargs={"enable_thinking": thinking}).json()
    msg = msg["choices"][0]["message"]
    assert msg["content"] == "answer" and msg["reasoning_content"] == "plan"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
TOOL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_tool_calls_non_stream_and_stream(make_server, tokenizer):
    ids = tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    client, _, state = make_server(script=lambda prompt: ids)

    def finished(reason: str) -> float:
        labels = {"model_name": "tiny", "finish_reason": reason}
        return state.metrics.registry.get_sample_value("appliance_requests_finished_total", labels)

    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    out = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w"}], tools=TOOLS
    )
    # the metrics count the finish the answer gives, not the engine's "stop"
    assert (finished("tool_calls"), finished("stop")) == (1, 0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    stream = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w"}], tools=TOOLS, stream=True
    )
    args, names, finish = "", [], None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and args == call.function.arguments
    assert finish == "tool_calls"
    assert (finished("tool_calls"), finished("stop")) == (2, 0)
    # tool_choice "none": the same text is plain content.
    plain = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w"}], tools=TOOLS, tool_choice="none"
    )
    assert plain.choices[0].message.content == TOOL_TEXT
    assert plain.choices[0].finish_reason == "stop"
    assert (finished("tool_calls"), finished("stop")) == (2, 1)


def test_text_offsets_count_characters_split_over_tokens(make_server, tokenizer):
    """A character whose UTF-8 bytes span several tokens counts once in text_offset, at the token
    that completes it: each offset is the length of the text before its token."""
    reply = tokenizer.encode("héllo 😀 ok", add_special_tokens=False)
    client, _, _ = make_server(script=lambda prompt: reply)
    body = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": len(reply), "logprobs": 0}
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == "héllo 😀 ok"
    # the text before token i: a character still missing bytes decodes as U+FFFD, left out
    before = [len(tokenizer.decode(reply[:i]).rstrip("\ufffd")) for i in range(len(reply))]
    assert before[2] == before[1]  # "é" is two byte tokens (so is the emoji, four)
    assert choice["logprobs"]["text_offset"] == before


def test_echo_offsets_index_the_text_of_an_empty_prompt(make_server):
    """The empty prompt is scored as <|endoftext|> but echoed as "": the generated tokens'
    text_offset index the text the client got, collected and streamed."""
    client, _, _ = make_server()
    body = {"prompt": "", "echo": True, "logprobs": 0, "max_tokens": 3}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<|endoftext|>" and lp["token_logprobs"][0] is None
    generated = lp["tokens"][1:]
    assert choice["text"] == "".join(generated)
    assert lp["text_offset"] == [0] + [len("".join(generated[:i])) for i in range(len(generated))]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    offsets = [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
