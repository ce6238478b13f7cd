"""The handler skeleton (serving.py) with its two formatters: streamed and collected answers agree,
echo and logprob offsets, n choices per prompt, usage without placeholder fields, the submitted
TokenizedRequests."""

from __future__ import annotations

import json

from appliance.messages import TextDelta, TokenLogprob
from appliance.server.protocol import ChatCompletionRequest
from appliance.server.serving_chat import ChatFormatter, ChoiceParser
from appliance.server.serving_completion import CompletionFormatter

REPLY = "hello world héllo"


def stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_usage_reports_cached_tokens(make_server):
    client, _, _ = make_server()
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ]:
        usage = client.post(path, json=body).json()["usage"]
        # chat's also counts reasoning tokens, as OpenAI's chat usage does
        details = {"completion_tokens_details"} if "messages" in body else set()
        assert set(usage) == {
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "prompt_tokens_details",
            *details,
        }
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # the fake engine caches none
        chunks = stream(client, path, {**body, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"] == usage


def test_completion_stream_matches_collect_with_echo_and_n(make_server, tokenizer):
    client, engine, _ = make_server()
    body = {"prompt": ["hello", "world"], "n": 2, "max_tokens": 3, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    chunks = stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    texts, finishes = ["", "", "", ""], [None] * 4
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    reply = tokenizer.decode(tokenizer.encode(REPLY, add_special_tokens=False)[:3])
    assert texts == ["hello" + reply] * 2 + ["world" + reply] * 2
    assert [c["text"] for c in whole["choices"]] == texts
    assert finishes == [c["finish_reason"] for c in whole["choices"]] == ["length"] * 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 12
    # Choice k of the group is req_id "<id>-k": prompt index x n + choice number.
    ids = [r.req_id.rsplit("-", 1) for r in engine.received[:4]]
    assert [int(k) for _, k in ids] == [0, 1, 2, 3] and len({g for g, _ in ids}) == 1
    hello = tokenizer.encode("hello", add_special_tokens=False)
    assert [r.prompt_token_ids == hello for r in engine.received[:4]] == [True, True, False, False]


def test_chat_stream_opens_every_choice_with_its_role(make_server):
    client, _, _ = make_server()
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}
    chunks = stream(client, "/v1/chat/completions", body)
    openings = [c["choices"][0] for c in chunks[:2]]
    assert [o["index"] for o in openings] == [0, 1]
    assert all(o["delta"] == {"role": "assistant", "content": ""} for o in openings)
    assert all("usage" not in c for c in chunks)  # without include_usage
    last = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks}
    assert last == {0: "length", 1: "length"}


def test_submitted_requests(make_server, tokenizer):
    client, engine, _ = make_server()
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 3, "stop": ["zz"]}
    client.post("/v1/chat/completions", json={**body, "stop_token_ids": [7], "max_tokens": 5})
    a, b = engine.received
    assert (a.sampling.seed, b.sampling.seed) == (3, 4)
    assert a.max_tokens == b.max_tokens == 5 and a.stop_token_ids == [7]
    assert a.detok.stop == ["zz"] and not a.detok.logprobs
    assert a.images == [] and a.arrival_time > 0
    # the generation prompt's <|im_start|>: the state there is a prefix-cache point (router)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert a.turn_start > 0 and a.prompt_token_ids[a.turn_start] == im_start
    assert im_start not in a.prompt_token_ids[a.turn_start + 1 :]
    assert tokenizer.decode(a.prompt_token_ids[a.turn_start :]).startswith("<|im_start|>assistant")
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert engine.received[-1].turn_start == -1


def entry(token: str) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=-0.5, bytes=list(token.encode()), top=[])


def delta(text: str, finish: str | None = None, logprobs=None) -> TextDelta:
    return TextDelta(
        req_id="r",
        text=text,
        token_ids=[],
        num_output_tokens=1,
        finish_reason=finish,
        logprobs=logprobs,
    )


def test_completion_formatter_echo_once_and_offsets():
    fmt = CompletionFormatter(["ab", ""])
    assert fmt.opening(0) is None
    first = fmt.delta_choice(0, delta("c", logprobs=[entry("c")]))
    assert first["text"] == "abc" and first["logprobs"]["text_offset"] == [2]
    second = fmt.delta_choice(0, delta("de", logprobs=[entry("de")]))
    assert second["text"] == "de" and second["logprobs"]["text_offset"] == [3]
    assert fmt.delta_choice(1, delta("")) is None  # nothing to say, not finished
    assert fmt.delta_choice(1, delta("", "stop"))["finish_reason"] == "stop"
    final = fmt.final_choice(0, "cde", [entry("c"), entry("de")], "length")
    assert final["text"] == "abcde" and final["logprobs"]["text_offset"] == [2, 3]
    assert fmt.final_choice(1, "x", None, "stop")["logprobs"] is None


def test_chat_formatter_reasoning_and_logprobs():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    fmt = ChatFormatter([ChoiceParser(body, "<think>\n", "auto", 0)])
    streamed = fmt.delta_choice(0, delta("plan</think>\n\nok", "stop", [entry("ok")]))
    assert streamed["delta"] == {"reasoning_content": "plan", "content": "ok"}
    assert streamed["logprobs"]["content"][0]["token"] == "ok"
    assert streamed["finish_reason"] == "stop"
    fmt = ChatFormatter([ChoiceParser(body, "<think>\n", "auto", 0)])
    final = fmt.final_choice(0, "plan</think>\n\nok", None, "length")
    assert final["message"] == {
        "role": "assistant",
        "content": "ok",
        "reasoning_content": "plan",
    }
    assert final["logprobs"] is None and final["finish_reason"] == "length"


def test_seeded_call_ids_repeat_per_request_not_per_conversation():
    """A seeded request gets its call ids again; the next turn of a conversation run with one
    seed (a longer prompt) gets new ones, as vLLM's random ids would be."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=tools, seed=7, n=2
    )
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"

    def call_ids(prompt: str) -> list[str]:
        fmt = ChatFormatter([ChoiceParser(body, prompt, "off", i) for i in range(2)])
        return [
            fmt.final_choice(i, call, None, "stop")["message"]["tool_calls"][0]["id"]
            for i in range(2)
        ]

    first = call_ids("turn one")
    assert first == call_ids("turn one") and first[0] != first[1]
    assert set(call_ids("turn one, tool result, turn two")).isdisjoint(first)


def test_completion_formatter_generated_offsets_follow_the_echoed_text():
    """Prompt tokens that spell the echo otherwise ("e" + a combining accent the tokenizer
    normalised to "é"): the first generated token's offset is the echo's length, not the sum of
    the prompt tokens' lengths."""
    echo = "Ae\u0301"
    prompt = [
        TokenLogprob("A", None, list(b"A")),
        TokenLogprob("\u00e9", -1.0, list("\u00e9".encode())),
    ]
    fmt = CompletionFormatter([echo], echo_top_k=0)
    first = TextDelta("r", "x", [], 1, None, [entry("x")], prompt_logprobs=prompt)
    streamed = fmt.delta_choice(0, first)
    assert streamed["text"] == echo + "x" and streamed["logprobs"]["text_offset"] == [0, 1, 3]
    final = fmt.final_choice(0, "xy", [entry("x"), entry("y")], "length", prompt)
    assert final["text"] == echo + "xy" and final["logprobs"]["text_offset"] == [0, 1, 3, 4]


def test_tool_calls_finish_reason_when_max_tokens_cuts_after_a_closed_call():
    """max_tokens cutting right after `</tool_call>` is "tool_calls" (the calls are whole); a cut
    inside a call stays "length"; without calls "length" is kept."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    whole = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"

    def reason(text: str, finish: str) -> str:
        fmt = ChatFormatter([ChoiceParser(body, "hi", "off", 0)])
        return fmt.final_choice(0, text, None, finish)["finish_reason"]

    def streamed(pieces: list[str], finish: str) -> str:
        fmt = ChatFormatter([ChoiceParser(body, "hi", "off", 0)])
        for p in pieces[:-1]:
            fmt.delta_choice(0, delta(p))
        return fmt.delta_choice(0, delta(pieces[-1], finish))["finish_reason"]

    assert reason(whole, "length") == "tool_calls"
    assert reason(whole, "stop") == "tool_calls"
    assert reason(whole + "\n<tool_call>\n<function=ping>\n<parameter=", "length") == "length"
    assert reason("<tool_call>\n<function=ping>\n", "length") == "length"
    assert reason("just text", "length") == "length"
    assert streamed([whole[:20], whole[20:]], "length") == "tool_calls"
    assert streamed([whole[:20], whole[20:40]], "length") == "length"
