"""Issue 17 items 5 and 6 against the scripted engine, through the `openai` SDK where it can:
the model routes agree with /health, stream_options / logit_bias / logprobs=0 as OpenAI has them,
client errors counted apart from server errors, and the access log's completion id and aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import openai
import pytest

from tests.appliance.server.conftest import asgi_scope

MSG = [{"role": "user", "content": "hi"}]


def sdk_for(client) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0
    )


def finished(state, reason: str) -> float:
    return state.metrics.registry.get_sample_value(
        "appliance_requests_finished_total", {"model_name": "tiny", "finish_reason": reason}
    )


# ---------------------------------------------------------------- /v1/models and readiness


def test_model_routes_through_the_sdk(make_server):
    client, _, _ = make_server()
    sdk = sdk_for(client)
    card = sdk.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "appliance"
    assert card.model_extra["max_model_len"] == 256
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("no/such-model")
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "no/such-model" in err["message"]
    r = client.get("/v1/models/no-such-model")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def _not_serving(state, how: str) -> None:
    if how == "starting":
        state.ready = False
    elif how == "draining":
        state.draining = True
    else:
        state.client.failure = "The worker died."


@pytest.mark.parametrize("how", ["starting", "draining", "failed"])
def test_model_routes_answer_what_health_answers(make_server, how):
    client, _, state = make_server()
    assert client.get("/v1/models").status_code == 200
    _not_serving(state, how)
    health = client.get("/health")
    assert health.status_code == (500 if how == "failed" else 503)
    for path in ("/v1/models", "/v1/models/tiny"):
        r = client.get(path)
        assert (r.status_code, r.json()) == (health.status_code, health.json()), path
    with pytest.raises(openai.APIStatusError) as info:
        sdk_for(client).models.list()
    assert info.value.status_code == health.status_code
    # a loading server says when to come back; one shutting down or failed does not
    assert health.headers.get("retry-after") == ("5" if how == "starting" else None)


# ---------------------------------------------------------------- stream_options


def test_stream_options_only_with_stream_and_only_known_keys(make_server):
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    for route, extra in (("chat", {"messages": MSG}), ("completions", {"prompt": "hi"})):
        create = sdk.chat.completions.create if route == "chat" else sdk.completions.create
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny", stream_options={"include_usage": True}, **extra)
        assert info.value.body["param"] == "stream_options"
        assert "only allowed when stream is true" in info.value.body["message"]
        for bad in ({"include_usage": "yes"}, {"include_usage": True, "continuous": True}):
            with pytest.raises(openai.BadRequestError) as info:
                create(model="tiny", stream=True, stream_options=bad, **extra)
            assert info.value.body["param"] == "stream_options", bad
    assert engine.received == []  # every refusal came before the engine
    chunks = list(
        sdk.completions.create(
            model="tiny", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats (guidellm asks for it): every chunk counts the tokens so far
    options = {"include_usage": True, "continuous_usage_stats": True}
    routes = ((sdk.chat.completions.create, {"messages": MSG}), (sdk.completions.create, {}))
    for create, extra in routes:
        extra = extra or {"prompt": "hi"}
        chunks = list(create(model="tiny", stream=True, stream_options=options, **extra))
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[0] <= 1 < counts[-1], counts
        assert chunks[-1].choices == [] and counts[-2] == counts[-1]
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    # with n > 1 each choice's chunks count that choice's tokens (vLLM's per-choice counts);
    # the last, choice-less chunk counts them all
    chunks = list(
        sdk.completions.create(
            model="tiny", prompt="hi", n=2, stream=True, stream_options=options, max_tokens=4
        )
    )
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        per_choice[c.choices[0].index].append(c.usage.completion_tokens)
    assert per_choice[0] == sorted(per_choice[0]) and per_choice[0][-1] == 4, per_choice
    assert per_choice[1] == sorted(per_choice[1]) and per_choice[1][-1] == 4, per_choice
    assert chunks[-1].usage.completion_tokens == 8
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}  # once


# ---------------------------------------------------------------- logit_bias and logprobs=0


def test_logit_bias_validated_and_sent_to_the_worker(make_server, tokenizer):
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    vocab = len(tokenizer)
    out = sdk.chat.completions.create(
        model="tiny", messages=MSG, logit_bias={"5": -100, "7": 2.5, "9": 0}
    )
    assert out.choices[0].finish_reason == "stop"
    # ints as given, the no-op 0 dropped (so it does not cost the request its MTP drafts)
    assert engine.received[-1].sampling.logit_bias == {5: -100.0, 7: 2.5}
    sdk.completions.create(model="tiny", prompt="hi", logit_bias={str(vocab - 1): 100})
    assert engine.received[-1].sampling.logit_bias == {vocab - 1: 100.0}
    count = len(engine.received)
    for bias, words in (
        ({str(vocab): 1}, f"token id {vocab} is outside the vocabulary [0, {vocab})"),
        ({"12abc": 1}, "'12abc'"),
        ({"-3": 1}, "'-3'"),
        ({"5": 100.5}, "100.5"),
        ({"5": -101}, "-101"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="tiny", messages=MSG, logit_bias=bias)
        assert info.value.body["param"] == "logit_bias", bias
        assert words in info.value.body["message"], info.value.body
    assert len(engine.received) == count


def test_completions_logprobs_zero_is_the_sampled_token_only(make_server):
    client, engine, _ = make_server()
    out = sdk_for(client).completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=0)
    assert engine.received[-1].sampling.logprobs == 0
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.25] * 3
    assert lp.top_logprobs == [{t: -0.25} for t in lp.tokens]
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_echo_with_logprobs_leads_with_the_prompt_entries(make_server, tokenizer):
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    prompt = "hello world"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = sdk.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=2)
    assert engine.received[-1].sampling.prompt_logprobs == 1
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and lp.tokens[: len(ids)] == [
        tokenizer.decode([i]) for i in ids
    ]
    assert lp.token_logprobs == [None] + [-1.0] * (len(ids) - 1) + [-0.25, -0.25]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {lp.tokens[1]: -1.0}
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(prompt)
    assert "".join(lp.tokens) == choice.text
    # streamed: the same entries, the prompt's in the first chunk
    stream = sdk.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=2, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(prompt) and chunks[0].logprobs.token_logprobs[0] is None
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    offsets = [x for c in chunks if c.logprobs for x in c.logprobs.text_offset]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset
    # without echo the prompt is not scored; chat never scores it
    sdk.completions.create(model="tiny", prompt=prompt, logprobs=1, max_tokens=2)
    assert engine.received[-1].sampling.prompt_logprobs is None


def test_max_tokens_0_with_echo_answers_the_scored_prompt(make_server, tokenizer):
    client, engine, _ = make_server()
    prompt = "hello world"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = sdk_for(client).completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=0, max_tokens=0
    )
    assert engine.received[-1].max_tokens == 0
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == [None] + [-1.0] * (len(ids) - 1)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    plain = sdk_for(client).completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert plain.choices[0].text == "" and plain.choices[0].logprobs is None


# ---------------------------------------------------------------- conformance: metrics, log


def test_router_refusals_count_as_rejected_not_error(make_server):
    client, engine, state = make_server()
    engine.reject_status = 429
    with pytest.raises(openai.RateLimitError):
        sdk_for(client).chat.completions.create(model="tiny", messages=MSG, n=2)
    engine.reject_status = 400
    with pytest.raises(openai.BadRequestError):
        sdk_for(client).chat.completions.create(model="tiny", messages=MSG)
    engine.reject_status = 0
    deadline = time.monotonic() + 3
    while finished(state, "rejected") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished(state, "rejected") == 3
    assert finished(state, "error") == 0
    sdk_for(client).chat.completions.create(model="tiny", messages=MSG)
    assert finished(state, "stop") == 1
    assert 'finish_reason="rejected"' in client.get("/metrics").text
    # the refusals are not served requests: only the one answer is in the per-request histograms
    e2e = state.metrics.registry.get_sample_value(
        "appliance_e2e_request_latency_seconds_count", {"model_name": "tiny"}
    )
    assert e2e == 1


def test_prompt_tokens_count_each_prompt_once_like_usage(make_server):
    """n choices share their prompt: appliance_prompt_tokens_total rises by usage.prompt_tokens
    (each prompt once), prompt by prompt, with or without tokens generated."""
    client, _, state = make_server()

    def prompt_total() -> float:
        return state.metrics.registry.get_sample_value(
            "appliance_prompt_tokens_total", {"model_name": "tiny"}
        )

    sdk = sdk_for(client)
    for kw in ({"max_tokens": 3}, {"max_tokens": 0, "echo": True, "logprobs": 1}):
        before = prompt_total()
        out = sdk.completions.create(model="tiny", prompt=["hi there", "a b c d"], n=3, **kw)
        assert len(out.choices) == 6
        assert prompt_total() - before == out.usage.prompt_tokens, kw


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines():
    logger = logging.getLogger("appliance.access")
    handler, level = AccessLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def logged_server(make_server, **config):
    client, engine, state = make_server(**config)
    state.config = dataclasses.replace(state.config, access_log=True)
    return client, engine, state


def test_access_log_carries_the_completion_id(make_server, access_lines):
    client, _, _ = logged_server(make_server)
    r = client.post("/v1/chat/completions", json={"messages": MSG}, headers={"x-request-id": "r1"})
    completion_id = r.json()["id"]
    assert completion_id.startswith("chatcmpl-")
    (line,) = [x for x in access_lines if " id=r1" in x]
    assert line.startswith("POST /v1/chat/completions 200 ")
    assert line.endswith(f" id=r1 completion={completion_id}")  # finished normally: no abort
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "r2"})
    (line,) = [x for x in access_lines if " id=r2" in x]
    assert line.endswith(f" completion={r.json()['id']}") and "cmpl-" in line
    client.post("/v1/completions", json={"prompt": "x", "n": 0}, headers={"x-request-id": "r3"})
    (line,) = [x for x in access_lines if " id=r3" in x]
    assert " 400 " in line and "completion=" not in line  # refused before any completion


def test_deadline_abort_is_logged_and_counted(make_server, tokenizer, access_lines):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = logged_server(
        make_server, script=lambda prompt: ids, request_timeout=0.3
    )
    engine.step_s = 0.05
    body = {"messages": MSG, "max_tokens": 40, "stream": True}
    headers = {"x-request-id": "d1"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert "request_timeout" in events[-2]  # read to the end: the server cut it, not the client
    (line,) = [x for x in access_lines if " id=d1" in x]
    assert " 200 " in line and line.endswith(" aborted=deadline")
    assert finished(state, "abort") == 1 and finished(state, "error") == 0


async def _stream_then_leave(app, path: str, body: dict) -> list[dict]:
    """Drives the ASGI app like a client that reads the first streamed chunk and disconnects."""
    raw = json.dumps(body).encode()
    first_chunk = asyncio.Event()
    messages: list[dict] = []
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    headers = [
        (b"host", b"testserver"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"x-request-id", b"gone1"),
    ]
    scope = asgi_scope("POST", path, headers)
    await asyncio.wait_for(app(scope, receive, send), 10)
    return messages


def test_client_disconnect_mid_stream_is_logged_and_counted(make_server, tokenizer, access_lines):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = logged_server(make_server, script=lambda prompt: ids)
    engine.step_s = 0.05  # 40 tokens take 2 s: the client leaves long before the end
    body = {"model": "tiny", "messages": MSG, "max_tokens": 40, "stream": True}
    messages = client.portal.call(_stream_then_leave, client.app, "/v1/chat/completions", body)
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    (line,) = [x for x in access_lines if " id=gone1" in x]
    assert " completion=chatcmpl-" in line and line.endswith(" aborted=client_gone")
    assert finished(state, "abort") == 1 and finished(state, "stop") == 0
    deadline = time.monotonic() + 3
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == 1 and state.client.num_open == 0


def test_completions_top_logprobs_hold_the_sampled_token_too():
    """A sampled token outside the top N still has its entry (OpenAI's up to N + 1), after them;
    one inside them is not repeated."""
    from appliance.messages import TokenLogprob
    from appliance.server.serving_completion import LegacyLogprobs

    items = [
        TokenLogprob(" Seoul", -3.5, list(b" Seoul"), [(" Paris", -0.3, list(b" Paris"))]),
        TokenLogprob(" is", -0.1, list(b" is"), [(" is", -0.1, list(b" is"))]),
    ]
    top = LegacyLogprobs(0).entries(items)["top_logprobs"]
    assert top == [{" Paris": -0.3, " Seoul": -3.5}, {" is": -0.1}]
    assert list(top[0]) == [" Paris", " Seoul"]


def test_completions_top_logprobs_keep_the_better_of_tokens_spelt_alike():
    """Byte-piece tokens all show as U+FFFD: their shared key keeps the best logprob, so the
    sampled (greedy) token is still the dict's best key (lm-eval's is_greedy check)."""
    from appliance.messages import TokenLogprob
    from appliance.server.serving_completion import LegacyLogprobs

    top = [("\ufffd", -0.2, [0xE4]), (" a", -1.0, list(b" a")), ("\ufffd", -3.0, [0xE5])]
    items = [TokenLogprob("\ufffd", -0.2, [0xE4], top)]
    (entry,) = LegacyLogprobs(0).entries(items)["top_logprobs"]
    assert entry == {"\ufffd": -0.2, " a": -1.0}
    assert max(entry, key=entry.get) == "\ufffd"


def test_vllm_min_tokens_and_allowed_token_ids_reach_the_worker(make_server, tokenizer):
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    sdk.completions.create(
        model="tiny",
        prompt="hi",
        max_tokens=6,
        extra_body={"min_tokens": 4, "allowed_token_ids": [9, 8]},
    )
    options = engine.received[-1].sampling
    assert options.min_tokens == 4 and options.allowed_token_ids == [8, 9]
    assert engine.received[-1].detok.min_tokens == 4  # stop strings are held too
    lone = '{"messages": [{"role": "user", "content": "hi"}], "bad_words": ["ok", "\\ud800"]}'
    r = client.post(
        "/v1/chat/completions", content=lone, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"  # not Unicode
    sdk.chat.completions.create(model="tiny", messages=MSG, extra_body={"bad_words": ["world"]})
    alone = tokenizer.encode("world", add_special_tokens=False)
    assert engine.received[-1].sampling.bad_words[0] == alone  # then " world" where it differs
    # max_tokens unset (the context's room): min_tokens alone is fine
    sdk.chat.completions.create(model="tiny", messages=MSG, extra_body={"min_tokens": 3})
    assert engine.received[-1].sampling.min_tokens == 3
    bad = [
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"allowed_token_ids": [len(tokenizer)]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),  # -1 or >= 1
        ({"prompt_logprobs": 21}, "prompt_logprobs"),  # top_logprobs' bound
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"min_tokens": 10**6}, "min_tokens"),  # more than the context leaves
    ]
    received = len(engine.received)
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="tiny", messages=MSG, extra_body=extra)
        assert info.value.body["param"] == param, extra
    assert len(engine.received) == received
    with pytest.raises(openai.BadRequestError) as info:  # 0: score the prompt, no tokens
        sdk.completions.create(
            model="tiny", prompt="hi", max_tokens=0, extra_body={"min_tokens": 5}
        )
    assert info.value.body["param"] == "min_tokens"
    # their defaults are accepted as not set
    sdk.chat.completions.create(
        model="tiny", messages=MSG, extra_body={"use_beam_search": False, "bad_words": []}
    )


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_tokenize_and_detokenize_as_vllm(make_server, tokenizer):
    """/tokenize counts what a request would be fed (a completion prompt, or a conversation
    through the chat template); /detokenize gives ids' text back."""
    client, engine, _ = make_server()
    r = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    # a conversation: the ids the chat route feeds the engine
    client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1})
    fed = engine.received[-1].prompt_token_ids
    chat = client.post("/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"] == fed and chat["token_strs"] is None
    # a prompt longer than the context is counted, not refused (what the count is for)
    long = client.post("/tokenize", json={"prompt": "hello world " * 600}).json()
    assert long["count"] > long["max_model_len"]
    back = client.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": "hello world"}
    for path, bad, param in [
        ("/tokenize", {"prompt": "a", "messages": MSG}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [len(tokenizer)]}, "tokens"),
        ("/tokenize", {"messages": MSG, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"messages": [*MSG, {"role": "tool", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages"),
    ]:
        r = client.post(path, json=bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (bad, r.text)


def test_tokenize_before_the_engine_is_ready_is_a_503(make_server):
    client, _, _ = make_server(ready=False)
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 503
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 503


def test_continue_final_message_through_the_chat_route(make_server, tokenizer):
    client, engine, _ = make_server()
    talk = [*MSG, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": talk, "add_generation_prompt": False, "continue_final_message": True}
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert tokenizer.decode(engine.received[-1].prompt_token_ids).endswith("Once upon")
    counted = client.post("/tokenize", json=body).json()
    assert counted["tokens"] == engine.received[-1].prompt_token_ids
    r = client.post("/v1/chat/completions", json={"messages": talk, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_priority_needs_the_priority_policy_and_reaches_the_router(make_server):
    """vLLM's `priority`: a 400 naming it on a first-come server (0 is fine); under
    --scheduling-policy priority it travels with every choice. SGLang's /generate priority is
    read SGLang's way (higher first): the router gets its negation."""
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="tiny", messages=MSG, extra_body={"priority": 3})
    assert info.value.body["param"] == "priority" and engine.received == []
    assert "--scheduling-policy priority" in info.value.body["message"]
    r = client.post("/generate", json={"text": "hi", "priority": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    sdk.chat.completions.create(model="tiny", messages=MSG, extra_body={"priority": 0})
    assert engine.received[-1].priority == 0
    client, engine, state = make_server()
    state.scheduling_policy = "priority"
    sdk = sdk_for(client)
    sdk.completions.create(model="tiny", prompt="hi", n=2, extra_body={"priority": -4})
    assert [r.priority for r in engine.received] == [-4, -4]
    assert client.post("/generate", json={"text": "hi", "priority": 7}).status_code == 200
    assert engine.received[-1].priority == -7
