"""Bad input gets the right 4xx in OpenAI format (and the server keeps serving); guards; engine
failure and rejection paths."""

from __future__ import annotations

import json
import threading
import time

import pytest

MSG = [{"role": "user", "content": "hi"}]


def assert_error(r, status: int, param=None, code=None, contains: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert contains in err["message"]
    return err


def assert_serving(client):
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


BAD_BODIES = [
    # (body, status, param, message fragment)
    ({"model": "tiny"}, 400, "messages", "field required"),
    ({"messages": "hi"}, 400, "messages", ""),
    ({"messages": []}, 400, "messages", ""),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", ""),
    # a union field: the member the value was meant for names the problem, not "not a string"
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages",
        "messages.0.content.0.text: field required",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
        "messages.0.content.0.image_url.url: field required",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages.0.content: "),
    ({"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens", ""),
    ({"messages": MSG, "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
    ({"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", ""),
    ({"messages": MSG, "temperature": -0.5}, 400, "temperature", ""),
    ({"messages": MSG, "top_p": 0}, 400, "top_p", ""),
    ({"messages": MSG, "n": 0}, 400, "n", ""),
    ({"messages": MSG, "n": 17}, 400, "n", "at most 16"),
    ({"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", ""),
    ({"messages": MSG, "stop": [""]}, 400, "stop", "non-empty string"),
    ({"messages": MSG, "stop": 5}, 400, "stop", ""),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format", ""),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        "messages",
        "image input",
    ),
]


@pytest.mark.parametrize("body,status,param,fragment", BAD_BODIES)
def test_bad_chat_bodies(make_server, body, status, param, fragment):
    client, engine, _ = make_server()
    assert_error(client.post("/v1/chat/completions", json=body), status, param, contains=fragment)
    assert engine.received == []
    assert_serving(client)


def test_malformed_json_and_unknown_model(make_server):
    client, engine, _ = make_server()
    r = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400, None, contains="Malformed JSON")
    assert_serving(client)
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG})
    err = assert_error(r, 404, "model", "model_not_found", "gpt-9")
    assert err["type"] == "invalid_request_error"
    assert_serving(client)
    # an empty model name is the served model, as in vLLM
    r = client.post("/v1/chat/completions", json={"model": "", "messages": MSG})
    assert r.status_code == 200, r.text
    assert_error(client.get("/v1/nothing"), 404)
    assert_serving(client)


def test_completion_bad_prompts(make_server):
    client, _, _ = make_server()
    for body, param in [
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),  # fewer candidates than answers
        ({"prompt": "x", "best_of": 2}, "best_of"),  # more: not supported, rather than ignored
        ({"prompt": "x", "best_of": 0}, "best_of"),
    ]:
        assert_error(client.post("/v1/completions", json=body), 400, param)
        assert_serving(client)
    r = client.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_chat_answers_it_cannot_give_are_refused(make_server):
    """The deprecated functions / function_call and audio output are 400s naming the field, not
    a text answer that silently leaves them out; empty or text-only values are fine."""
    client, engine, _ = make_server()
    fn = {"name": "f", "parameters": {"type": "object"}}
    for extra, param in [
        ({"functions": [fn]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ]:
        r = client.post("/v1/chat/completions", json={"messages": MSG, **extra})
        assert_error(r, 400, param)
    assert engine.received == []
    ok = {"messages": MSG, "functions": [], "modalities": ["text"], "audio": None}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200


def test_context_guards(make_server, tokenizer):
    client, engine, state = make_server()
    long_text = "hello world " * 150  # > 256 tokens, < 8 x 256 characters
    n_tokens = len(tokenizer.encode(long_text, add_special_tokens=False))
    r = client.post("/v1/completions", json={"prompt": long_text})
    err = assert_error(r, 400, "prompt", "context_length_exceeded")
    assert err["message"] == (
        f"This model's maximum context length is 256 tokens. However, your request has "
        f"{n_tokens} input tokens. Please reduce the length of the input messages."
    )
    # Character limit, before tokenization.
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a" * (8 * 256 + 1)}]},
    )
    err = assert_error(r, 400, "messages", "context_length_exceeded", "input characters")
    assert err["message"].startswith("This model's maximum context length is 256 tokens.")
    # max_tokens beyond what the prompt leaves.
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 300})
    prompt_len = len(tokenizer.encode("hello", add_special_tokens=False))
    err = assert_error(r, 400, "max_tokens", "context_length_exceeded")
    assert err["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 300. This model's maximum context "
        f"length is 256 tokens and your request has {prompt_len} input tokens "
        f"(300 > 256 - {prompt_len})."
    )
    assert engine.received == []
    assert_serving(client)


def test_char_limit_configurable(make_server):
    client, _, _ = make_server(max_prompt_chars=10)
    r = client.post("/v1/completions", json={"prompt": "x" * 11})
    assert_error(r, 400, "prompt", "context_length_exceeded", "more than the 10 characters")


def test_queue_full_429(make_server, tokenizer):
    long_reply = tokenizer.encode("hello world " * 40, add_special_tokens=False)
    client, engine, state = make_server(script=lambda prompt: long_reply, max_open=2)
    engine.step_s = 0.01
    # More sequences than the server ever holds: 400, not a 429 an SDK would retry forever.
    r = client.post("/v1/chat/completions", json={"messages": MSG, "n": 3})
    assert_error(r, 400, None, contains="at most 2")
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
    assert_error(r, 400, None, contains="asks for 3 sequences")
    # Full for now (a request of n = 2 is running): 429, with Retry-After.
    body = {"messages": MSG, "n": 2, "max_tokens": 200}
    answers = []
    busy = threading.Thread(
        target=lambda: answers.append(client.post("/v1/chat/completions", json=body))
    )
    busy.start()
    deadline = time.monotonic() + 10
    while state.client.num_open < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert_error(r, 429, None, "rate_limit_exceeded", "at capacity")
    assert r.headers["Retry-After"] == "1"
    busy.join()
    assert answers[0].status_code == 200, answers[0].text
    assert_serving(client)
    # The router's own refusal (its queue is full) reaches the client as 429, with the same code.
    engine.reject_status = 429
    r = client.post("/v1/chat/completions", json={"messages": MSG})
    assert_error(r, 429, None, "rate_limit_exceeded")
    engine.reject_status = 0
    assert_serving(client)


@pytest.mark.parametrize("status", [400, 429])
def test_router_rejection_of_a_stream_keeps_its_status(make_server, status):
    # The stream waits for its first delta before sending headers, so a refusal is a real 4xx.
    client, engine, _ = make_server()
    engine.reject_status = status
    for path, body in [
        ("/v1/chat/completions", {"messages": MSG, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
    ]:
        assert_error(client.post(path, json=body), status)
    engine.reject_status = 0
    assert_serving(client)


def test_engine_failure_fails_open_streams_and_health(make_server, tokenizer):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = make_server(script=lambda p: ids)
    engine.step_s = 0.05  # slow enough to fail it mid-stream
    got: list[str] = []

    def consume():
        with client.stream(
            "POST", "/v1/chat/completions", json={"messages": MSG, "stream": True}
        ) as r:
            for line in r.iter_lines():
                got.append(line)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.time() + 5
    while not any('"content": "h' in x for x in got) and time.time() < deadline:
        time.sleep(0.01)  # the stream has started (headers sent, tokens flowing)
    # As the server's control task does on a Fatal from the launcher (on the serving loop).
    client.portal.call(
        state.client.engine_failed, "The appliance failed: worker 1 (pid 7) exited with code -9."
    )
    reader.join(5)
    assert not reader.is_alive()
    events = [x[6:] for x in got if x.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert "worker 1" in error["message"] and error["type"] == "server_error"
    assert events[-1] == "[DONE]"
    assert_error(client.get("/health"), 500, contains="worker 1")
    assert_error(client.post("/v1/chat/completions", json={"messages": MSG}), 500)


def test_broken_engine_link_fails_requests_instead_of_hanging(make_server, tokenizer):
    import zmq

    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = make_server(script=lambda p: ids)
    engine.step_s = 0.05
    result: dict = {}

    def request():
        result["r"] = client.post("/v1/chat/completions", json={"messages": MSG})

    waiter = threading.Thread(target=request)
    waiter.start()
    deadline = time.time() + 5
    while state.client.num_open == 0 and time.time() < deadline:
        time.sleep(0.01)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(state.client._inbox_addr)
    push.send(b"\x01not msgpack of a DetokOutput")  # what a bug in the pipeline would look like
    waiter.join(10)
    push.close()
    assert not waiter.is_alive()
    assert_error(result["r"], 500, contains="engine link failed")
    assert_error(client.get("/health"), 500)


HUGE = 2**70  # does not fit any wire integer


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 16, "top_k": HUGE}, "top_k"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": [5, 999999]}, "stop_token_ids"),  # outside the vocabulary
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": HUGE}, "seed"),
        ({"max_tokens": HUGE}, "max_tokens"),
    ],
)
def test_out_of_range_integers_are_400_and_leave_nothing_open(make_server, extra, param):
    # Once such a request got a 500 after being counted open, and 68 of them made every later
    # request 429 forever.
    client, _, state = make_server(max_open=16)
    for _ in range(3):
        r = client.post("/v1/chat/completions", json={"messages": MSG, **extra})
        assert_error(r, 400, param)
    assert state.client.num_open == 0
    assert_serving(client)


def test_an_unencodable_request_is_refused_before_it_is_counted_open(make_server):
    from appliance.messages import SamplingOptions, TokenizedRequest
    from appliance.server.errors import BadRequest

    _, _, state = make_server()
    req = TokenizedRequest(
        req_id="r-0",
        prompt_token_ids=[1, 2],
        sampling=SamplingOptions(top_k=HUGE),  # past validation, e.g. from a new field
        max_tokens=4,
    )
    with pytest.raises(BadRequest, match="cannot carry"):
        state.client.submit("r", [req], time.monotonic())
    assert state.client.num_open == 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_400(make_server, path, body, param):
    client, _, state = make_server()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param, contains="not valid Unicode")
    assert state.client.num_open == 0
    assert_serving(client)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"tool_choice": "required"}, "only allowed when tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "not one of"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "only allowed"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "not among the tools",
        ),
        ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "expected"),
    ],
)
def test_tool_choice_is_validated_like_openai(make_server, extra, fragment):
    client, _, _ = make_server()
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **extra})
    assert_error(r, 400, "tool_choice", contains=fragment)
    for ok in (
        "none",
        "auto",
        "required",
        {"type": "function", "function": {"name": "get_weather"}},
    ):
        body = {"messages": MSG, "max_tokens": 2, "tools": TOOLS, "tool_choice": ok}
        assert client.post("/v1/chat/completions", json=body).status_code == 200


def _function(name: str, **properties) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


@pytest.mark.parametrize(
    "tools, fragment",
    [
        ([_function("f", a={"type": "integer"}), _function("f")], "'f' names another tool"),
        ([_function("f", **{"a>b": {"type": "string"}})], "parameter name 'a>b'"),
        ([_function("f", **{"</parameter>": {}})], "has '<', '>' or a line break"),
        ([_function("f", **{"a\nb": {}})], "has '<', '>' or a line break"),
    ],
)
def test_tools_a_call_could_not_name_are_refused(make_server, tools, fragment):
    """Two tools of one name, or a parameter name the XML call format cannot carry (`<parameter=
    KEY>` ends at the first '>'), would give calls typed against the wrong schema or mangled."""
    client, engine, _ = make_server()
    body = {"messages": MSG, "max_tokens": 2, "tools": tools, "tool_choice": "required"}
    assert_error(client.post("/v1/chat/completions", json=body), 400, "tools", contains=fragment)
    assert engine.received == []


def test_error_codes_are_strings_or_null_and_headers_follow_the_status(make_server):
    client, engine, _ = make_server(max_open=1)
    r = client.get("/v1/chat/completions")
    err = assert_error(r, 405, None, code="method_not_allowed")
    assert "POST" in r.headers["allow"]
    assert_error(client.post("/v1/chat/completions", json={"messages": "x"}), 400, "messages")
    r = client.post("/v1/chat/completions", json={"messages": "x"})
    assert r.json()["error"]["code"] == "invalid_type"  # OpenAI's code for a wrong JSON type
    r = client.post("/v1/chat/completions", json={"messages": MSG, "n": 2})
    assert_error(r, 400, None)  # more sequences than the server ever holds
    assert "retry-after" not in r.headers
    engine.reject_status = 429  # the router's refusal: code and header as the server's own 429
    r = client.post("/v1/chat/completions", json={"messages": MSG})
    assert_error(r, 429, None, "rate_limit_exceeded")
    assert r.headers["retry-after"] == "1"
    for code in (err["code"], r.json()["error"]["code"]):
        assert code is None or isinstance(code, str)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"chat_template": "X{{ messages[0]['content'] }}"}, "chat_template"),
        (
            {"chat_template_kwargs": {"chat_template": "X{{ messages[0]['content'] }}"}},
            "chat_template_kwargs",
        ),
    ],
)
def test_a_request_template_needs_the_servers_trust(make_server, extra, param):
    """A chat template is code the server runs: a request's own is refused (400, nothing sent to
    the engine) unless the server trusts them; trusted, it is what renders the prompt."""
    client, engine, _ = make_server()
    body = {"messages": MSG, "max_tokens": 2, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param, contains="--trust-request-chat-template")
    assert engine.received == []
    assert_serving(client)

    trusting, engine, state = make_server(trust_request_chat_template=True)
    r = trusting.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (request,) = engine.received
    rendered = state.prompts.tokenizer.encode("Xhi", add_special_tokens=False)
    assert request.prompt_token_ids == rendered


@pytest.mark.parametrize("value", ["false", "no", 0, None, {"x": 1}])
def test_a_thinking_switch_that_is_not_a_boolean_is_refused(make_server, value):
    """Qwen's template tests `enable_thinking is false`: the string "false" or 0 would leave
    thinking on without a word, so anything but true / false is a 400 naming the key."""
    client, engine, _ = make_server()
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": value}}
    r = client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "chat_template_kwargs", contains="enable_thinking")
    assert engine.received == []
    body["chat_template_kwargs"]["enable_thinking"] = False
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_a_model_without_a_chat_template_says_so(make_server, tokenizer, monkeypatch):
    """No template in the checkpoint: chat requests get a 400 naming that (not the messages),
    nothing reaches the engine, and completions still serve."""
    client, engine, _ = make_server()
    monkeypatch.setattr(tokenizer, "chat_template", None)
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert_error(r, 400, None, contains="This model has no chat template")
    assert engine.received == []
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_a_stop_string_that_is_not_unicode_is_a_400_naming_stop(make_server):
    import json

    client, _, state = make_server()
    body = json.dumps({"messages": MSG, "stop": ["ok", "\ud800"]})  # a lone surrogate escape
    r = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "stop")
    assert state.client.num_open == 0
