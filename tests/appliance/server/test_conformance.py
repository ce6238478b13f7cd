"""OpenAI accepts what OpenAI accepts: strict field types, every numeric range, tool messages and
tool schemas, at most 4 stop strings, an empty prompt, top_logprobs 0 without logprobs."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from appliance.sampling_params import SamplingParams
from appliance.server.chat_checks import parameters_problem
from appliance.server.errors import BadRequest
from appliance.server.prompts import PromptBuilder
from appliance.server.protocol import ChatCompletionRequest
from tests.appliance.server.test_errors import MSG, assert_error, assert_serving


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **fields})


def complete(client, **fields):
    return client.post("/v1/completions", json={"max_tokens": 2, **fields})


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("chat", {"n": True}, "n"),
        ("chat", {"n": "2"}, "n"),
        ("chat", {"max_tokens": 2.0}, "max_tokens"),
        ("chat", {"stream": "yes"}, "stream"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"temperature": "0.5"}, "temperature"),
        ("chat", {"stop_token_ids": [True]}, "stop_token_ids"),
        ("completion", {"prompt": [[False]]}, "prompt"),
        ("completion", {"prompt": [True, 1]}, "prompt"),
        ("completion", {"prompt": [1.0]}, "prompt"),
        ("completion", {"prompt": "x", "seed": 1.5}, "seed"),
        ("completion", {"prompt": "x", "echo": 1}, "echo"),
    ],
)
def test_types_are_strict(make_server, path, fields, param):
    client, engine, _ = make_server()
    r = chat(client, **fields) if path == "chat" else complete(client, **fields)
    assert_error(r, 400, param)
    assert engine.received == []


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_every_numeric_field_is_range_checked(make_server, fields, param):
    client, engine, state = make_server()
    assert_error(chat(client, **fields), 400, param)
    assert engine.received == [] and state.client.num_open == 0


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_completion_logprobs_range(make_server, logprobs):
    client, _, _ = make_server()
    assert_error(complete(client, prompt="x", logprobs=logprobs), 400, "logprobs")


def test_the_largest_seed_with_several_choices_is_served(make_server):
    client, engine, _ = make_server()
    assert chat(client, seed=2**63 - 1, n=3).status_code == 200
    seeds = [req.sampling.seed for req in engine.received]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]  # wrapped, each a distinct 64-bit int


def test_top_logprobs_0_without_logprobs_is_accepted(make_server):
    client, engine, _ = make_server()
    r = chat(client, top_logprobs=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    assert engine.received[0].sampling.logprobs is None
    assert_error(chat(client, top_logprobs=2), 400, "top_logprobs", contains="requires logprobs")


def test_at_most_4_stop_sequences(make_server):
    client, _, _ = make_server()
    assert chat(client, stop=["a", "b", "c", "d"]).status_code == 200
    assert_error(chat(client, stop=["a", "b", "c", "d", "e"]), 400, "stop", contains="4")


def test_completions_take_more_stop_sequences_as_vllm(make_server):
    """lm-eval's local-completions sends a task's `until` plus eos uncapped (humaneval: 6), which
    vLLM takes; /v1/completions bounds them at 64, not at OpenAI's 4."""
    client, engine, _ = make_server()
    until = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|im_end|>"]
    r = client.post("/v1/completions", json={"prompt": "def f():", "stop": until})
    assert r.status_code == 200, r.json()
    assert engine.received[-1].detok.stop == until
    many = [f"s{i}" for i in range(65)]
    r = client.post("/v1/completions", json={"prompt": "x", "stop": many})
    assert_error(r, 400, "stop", contains="64")


def test_a_tool_message_needs_its_call_id(make_server):
    client, engine, _ = make_server()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": turns})
    assert_error(r, 400, "messages", contains="tool_call_id")
    assert engine.received == []
    turns[2]["tool_call_id"] = "call_1"
    r = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2})
    assert r.status_code == 200, r.text


def function(parameters=None, name="get_weather", **extra):
    body = {"name": name, **extra}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


VALID_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "pattern": "^[A-Z]"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": ["integer", "null"], "minimum": 1, "exclusiveMaximum": 15},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "where": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "string"}]},
    },
    "required": ["city"],
    "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}}},
}


@pytest.mark.parametrize(
    "tool, fragment",
    [
        (function({"type": "string"}), 'type: "object"'),
        (function("not a schema"), "JSON Schema object"),
        (function({"type": "object", "properties": []}), "properties"),
        (function({"type": "object", "properties": {"x": {"type": "strnig"}}}), "strnig"),
        (function({"type": "object", "properties": {"x": 5}}), "parameters.properties.x"),
        (function({"type": "object", "required": "x"}), "required"),
        (function({"type": "object", "properties": {"x": {"anyOf": []}}}), "anyOf"),
        (function({"type": "object", "properties": {"x": {"items": "str"}}}), "items"),
        (function({"type": "object", "properties": {"x": {"maxLength": -1}}}), "maxLength"),
        (function({"type": "object", "properties": {"x": {"minimum": "1"}}}), "minimum"),
        (function({}, name="get weather"), "function.name"),
        (function({}, name="f" * 65), "function.name"),
        (function({}, description=5), "description"),
        ({"type": "function"}, "expected"),
        ({"type": "retrieval", "function": {"name": "f"}}, "expected"),
        ({"name": "bare", "parameters": {}}, "expected"),
    ],
)
def test_tools_are_well_formed_functions_with_json_schemas(make_server, tool, fragment):
    client, engine, _ = make_server()
    assert_error(chat(client, tools=[tool]), 400, "tools", contains=fragment)
    assert engine.received == []
    assert_serving(client)


def test_valid_tools_are_served(make_server):
    client, _, _ = make_server()
    for tool in [function(VALID_PARAMETERS), function(), function({})]:
        r = chat(client, tools=[tool])
        assert r.status_code == 200, (tool, r.text)
    assert parameters_problem(True) is not None  # a schema, but OpenAI wants an object schema


def test_an_empty_prompt_generates_from_the_start_of_a_document(make_server, tokenizer):
    client, engine, _ = make_server()
    r = complete(client, prompt="", echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 1
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert engine.received[0].prompt_token_ids == [separator]
    assert complete(client, prompt=["", "hi"]).status_code == 200


def test_an_empty_prompt_with_qwens_tokenizer(tokenizer):
    """Qwen's unk token is <|endoftext|> itself: the separator is still found."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.unk_token = "<|endoftext|>"
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.unk_token_id == separator
    assert PromptBuilder(tokenizer, 64).completion("").token_ids == [separator]


def test_an_empty_prompt_uses_bos_when_there_is_one():
    tok = SimpleNamespace(bos_token_id=7, unk_token_id=None, encode=lambda *a, **k: [])
    builder = PromptBuilder(tok, 64)
    assert builder.completion("").token_ids == [7]
    none = SimpleNamespace(
        bos_token_id=None,
        unk_token_id=0,
        encode=lambda *a, **k: [],
        convert_tokens_to_ids=lambda token: 0,  # unknown: the unk id
        convert_ids_to_tokens=lambda token_id: "<unk>",
    )
    with pytest.raises(BadRequest, match="neither a BOS token"):
        PromptBuilder(none, 64).completion("")


def test_the_ranges_in_the_openapi_schema_are_the_ones_enforced():
    """The schema documents SamplingParams' ranges: each bound is accepted, one step past it is
    refused (so the two cannot drift apart)."""
    properties = ChatCompletionRequest.model_json_schema()["properties"]
    documented = 0
    for name, prop in properties.items():
        if name not in SamplingParams.__dataclass_fields__ or "anyOf" not in prop:
            continue
        step = 1 if prop["anyOf"][0]["type"] == "integer" else 1e-6
        for key, inside, outside in [
            ("minimum", 0, -step),
            ("maximum", 0, step),
            ("exclusiveMinimum", step, 0),
        ]:
            if key in prop:
                documented += 1
                SamplingParams(**{name: prop[key] + inside})
                with pytest.raises(ValueError, match=name):
                    SamplingParams(**{name: prop[key] + outside})
    assert documented >= 12


def test_a_developer_message_is_rendered_as_the_system_message():
    """OpenAI's `developer` role (what newer SDK code sends) is `system` to Qwen's template, which
    refuses any role it does not know."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import appliance.assets
    from appliance.server.protocol import ChatMessage

    shipped = Path(appliance.assets.__file__).parent / "default"  # Qwen's template, in short
    builder = PromptBuilder(AutoTokenizer.from_pretrained(shipped), 4096)

    def render(role: str) -> str:
        messages = [
            ChatMessage(role=role, content="Be brief."),
            ChatMessage(role="user", content="hi"),
        ]
        return builder.chat(messages, None, None).text

    assert render("developer") == render("system")
    assert "<|im_start|>system\nBe brief." in render("developer")


def test_continue_final_message_leaves_the_assistant_turn_open():
    """vLLM's continue_final_message: the last (assistant) message is rendered without its end of
    turn, for the model to go on with; with a generation prompt, or after a user message, a 400."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import appliance.assets
    from appliance.server.errors import BadRequest
    from appliance.server.protocol import ChatMessage

    shipped = Path(appliance.assets.__file__).parent / "default"
    builder = PromptBuilder(AutoTokenizer.from_pretrained(shipped), 4096)
    talk = [
        ChatMessage(role="user", content="Name a colour."),
        ChatMessage(role="assistant", content="The colour is"),
    ]
    kwargs = {"enable_thinking": False}
    opened = builder.chat(talk, None, kwargs, False, continue_final_message=True)
    assert opened.text.endswith("The colour is") and opened.turn_start > 0
    closed = builder.chat(talk, None, kwargs, False)
    assert closed.text.rstrip().endswith("<|im_end|>")
    with pytest.raises(BadRequest, match="add_generation_prompt"):
        builder.chat(talk, None, kwargs, True, continue_final_message=True)
    with pytest.raises(BadRequest, match="assistant"):
        builder.chat(talk[:1], None, kwargs, False, continue_final_message=True)
