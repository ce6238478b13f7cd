"""Structured outputs (issue 18) through the official `openai` SDK on two live tiny appliances with
random weights, one with MTP (`--mtp-step 2`) and one without: the grammar alone makes the output
valid. Every request runs on both, so each check is made with MTP on and off, and the two answer
identically (a draft the grammar rejects ends acceptance; seeded sampling is lossless).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.live import start_appliance

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WORKERS = 24  # concurrent requests per appliance (the tiny model batches them)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "[a-z]{1,6}@example\\.com"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["a", "b", "c"]},
                        "maxItems": 3,
                    },
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        },
        "required": ["user", "score"],
        "additionalProperties": False,
    },
    "points": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -5, "maximum": 5},
                        "y": {"type": "number", "minimum": -1, "maximum": 1},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "enum": [1, 2, 3]},
            "note": {"type": "string", "maxLength": 5},
            "flag": {"type": "boolean"},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {
                "type": "object",
                "properties": {"c": {"type": "string", "maxLength": 4}, "d": {"type": "boolean"}},
                "required": ["d"],
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
}


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool(
        "get_weather",
        {
            "city": {"type": "string", "enum": ["Paris", "São Paulo", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "units": {"type": "string", "pattern": "(metric|imperial)"},
        },
        ["city", "days"],
    ),
    _tool(
        "get_time",
        {
            "timezone": {"type": "string", "pattern": "[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}"},
            "offsets": {
                "type": "array",
                "items": {"type": "integer", "minimum": -12, "maximum": 12},
                "maxItems": 2,
            },
        },
        ["timezone"],
    ),
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _start(model_dir, tmp_path_factory, name: str, *args: str):
    log = tmp_path_factory.mktemp(name) / "appliance.log"
    return start_appliance(model_dir, log, "--max-num-seqs", "32", *args, max_model_len=1024)


@pytest.fixture(scope="module")
def apps(tiny_dense, tmp_path_factory):
    """{"plain": MTP off, "mtp": --mtp-step 2} on the same checkpoint."""
    started = {}
    try:
        started["plain"] = _start(tiny_dense, tmp_path_factory, "plain")
        started["mtp"] = _start(tiny_dense, tmp_path_factory, "mtp", "--mtp-step", "2")
        yield started
    finally:
        for app in started.values():
            assert app.stop() == 0, app.log()[-4000:]


def _clients(apps) -> dict[str, openai.OpenAI]:
    return {
        name: openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=600)
        for name, app in apps.items()
    }


def _on_both(apps, requests: list[dict]) -> dict[str, list]:
    """Every request (chat.completions.create kwargs) on both appliances, concurrently."""
    clients = _clients(apps)
    model = clients["plain"].models.list().data[0].id

    def call(args):
        client, kwargs = args
        extra = {**NO_THINK, **kwargs.pop("extra_body", {})}
        messages = [{"role": "user", "content": kwargs.pop("prompt", "Answer.")}]
        return client.chat.completions.create(
            model=model, messages=messages, extra_body=extra, **kwargs
        )

    out = {}
    with ThreadPoolExecutor(WORKERS) as pool:
        for name, client in clients.items():
            out[name] = list(pool.map(call, [(client, dict(r)) for r in requests]))
    return out


def _texts(responses) -> list[list[str | None]]:
    return [[c.message.content for c in r.choices] for r in responses]


def test_json_schema_outputs_validate_and_match_mtp_off(apps):
    names = sorted(SCHEMAS)
    requests = []
    for i in range(100):  # x 2 appliances = 200 requests
        schema = SCHEMAS[names[i % len(names)]]
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        fmt["json_schema"]["strict"] = True
        requests.append(
            {
                "prompt": f"Give me record {i}.",
                "response_format": fmt,
                "max_tokens": 120,
                "seed": i,
                "temperature": 1.0,
                "n": 2 if i % 10 == 0 else 1,
            }
        )
    out = _on_both(apps, requests)
    for name, responses in out.items():
        for i, response in enumerate(responses):
            schema = SCHEMAS[names[i % len(names)]]
            for choice in response.choices:
                assert choice.finish_reason == "stop", (name, i, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), schema)
    assert _texts(out["plain"]) == _texts(out["mtp"])


def test_json_object_parses(apps, tiny_dense):
    # Random weights almost never close a free string (1 token in 80 holds a quote): a bias
    # towards the closing characters makes the model end; the grammar alone makes it JSON.
    tok = AutoTokenizer.from_pretrained(str(tiny_dense))
    closers = [
        i for t, i in tok.get_vocab().items() if set(tok.convert_tokens_to_string([t])) & set('"}]')
    ]
    bias = {str(i): 6.0 for i in closers}
    requests = [
        {
            "response_format": {"type": "json_object"},
            "max_tokens": 200,
            "seed": i,
            "logit_bias": bias,
            "n": 2 if i % 4 == 0 else 1,
        }
        for i in range(12)
    ]
    out = _on_both(apps, requests)
    for responses in out.values():
        for response in responses:
            for choice in response.choices:
                assert choice.finish_reason == "stop", choice.message.content
                assert isinstance(json.loads(choice.message.content), dict)
    assert _texts(out["plain"]) == _texts(out["mtp"])


CHOICES = ["yes", "no", "maybe so", 'say "hi"']
REGEXES = [r"[a-z]{3,8}@(foo|bar)\.com", r"\d{3}-\d{4}", r"(ab|cd)+x?"]


def test_choice_and_regex_match(apps):
    requests = [
        {"extra_body": {"structured_outputs": {"choice": CHOICES}}, "seed": i, "n": 3}
        for i in range(4)
    ]
    requests += [{"extra_body": {"guided_choice": CHOICES}, "seed": 9}]
    requests += [
        {"extra_body": {"guided_regex": rx}, "seed": i, "n": 2, "max_tokens": 60}
        for i, rx in enumerate(REGEXES)
    ]
    requests += [
        {"extra_body": {"structured_outputs": {"regex": rx}}, "seed": 5, "max_tokens": 60}
        for rx in REGEXES
    ]
    out = _on_both(apps, requests)
    patterns = [None] * 5 + REGEXES + REGEXES
    for responses in out.values():
        for response, pattern in zip(responses, patterns, strict=True):
            for choice in response.choices:
                text = choice.message.content
                assert choice.finish_reason == "stop", text
                assert text in CHOICES if pattern is None else re.fullmatch(pattern, text), text
    assert _texts(out["plain"]) == _texts(out["mtp"])


def _check_call(call, function: str | None) -> None:
    name = call.function.name
    assert function is None or name == function
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(apps, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    # one call each ("required" without parallel calls: random weights would chain calls up to
    # max_tokens; one or more calls are tests/appliance/server/test_guides.py's random walks)
    requests = [
        {"tools": TOOLS, "tool_choice": choice, "seed": i, "n": 2, "max_tokens": 200}
        | ({"parallel_tool_calls": False} if choice == "required" else {})
        for i, choice in enumerate(["required", named, "required", named])
    ]
    expected = [None, "get_time", None, "get_time"]
    if not stream:
        out = _on_both(apps, requests)
        for responses in out.values():
            for response, function in zip(responses, expected, strict=True):
                for choice in response.choices:
                    assert choice.finish_reason == "tool_calls", choice.message
                    (call,) = choice.message.tool_calls
                    _check_call(call, function)
        calls = {
            name: [[c.message.tool_calls[0].function.model_dump() for c in r.choices] for r in rs]
            for name, rs in out.items()
        }
        assert calls["plain"] == calls["mtp"]
        return
    clients = list(_clients(apps).values())
    model = clients[0].models.list().data[0].id

    def streamed(args) -> tuple[dict, dict, dict]:
        client, request = args
        chunks = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Call a tool."}],
            stream=True,
            extra_body=NO_THINK,
            **request,
        )
        names, args_text, finish = {}, {}, {}
        for chunk in chunks:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    assert delta.index == 0
                    names[choice.index] = delta.function.name or names.get(choice.index)
                    text = args_text.get(choice.index, "") + (delta.function.arguments or "")
                    args_text[choice.index] = text
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        return names, args_text, finish

    work = [(client, request) for client in clients for request in requests]
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(streamed, work))
    for (names, args_text, finish), function in zip(results, expected * len(clients)):
        assert finish == {0: "tool_calls", 1: "tool_calls"}
        for index in (0, 1):
            assert function is None or names[index] == function
            jsonschema.validate(json.loads(args_text[index]), PARAMETERS[names[index]])


def test_length_ends_a_grammar_that_cannot_finish(apps):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 50}}}
    schema["required"] = ["a"]
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
    out = _on_both(apps, [{"response_format": fmt, "max_tokens": 6, "seed": 1}])
    for (response,) in out.values():
        choice = response.choices[0]
        assert choice.finish_reason == "length"
        text, head = choice.message.content, '{"a": "'  # compact JSON: ", " and ": "
        assert text.startswith(head) or head.startswith(text), text  # 6 tokens of the grammar
        assert response.usage.completion_tokens == 6


BAD = [
    ({"extra_body": {"guided_regex": "(abc"}}, "guided_regex", "parenthesis"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None, "schema"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format",
        "strin",
    ),
    (
        {"extra_body": {"guided_json": {"type": "array", "uniqueItems": True}}},
        "guided_json",
        "uniqueItems",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        None,
        "only one",
    ),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, None, "exactly one"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty"),
    ({"extra_body": {"guided_grammar": 'root ::= "a" | b'}}, "guided_grammar", "not defined"),
]


@pytest.mark.parametrize(("request_kwargs", "param", "words"), BAD)
def test_bad_input_is_a_400_naming_the_problem(apps, request_kwargs, param, words):
    client = _clients(apps)["plain"]
    kwargs = dict(request_kwargs)
    extra = {**NO_THINK, **kwargs.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body=extra,
            **kwargs,
        )
    assert words in err.value.message
    if param is not None:
        assert err.value.body["param"] == param


def test_compile_metrics_and_status(apps):
    app = apps["plain"]
    metrics = httpx.get(f"{app.url}/metrics").text
    compiled = re.search(r"^appliance_grammar_compile_seconds_count{[^}]*} (\S+)$", metrics, re.M)
    hits = re.search(r"^appliance_grammar_cache_hits_total{[^}]*} (\S+)$", metrics, re.M)
    assert compiled and float(compiled.group(1)) >= 1
    assert hits and float(hits.group(1)) >= 1  # the json_schema requests repeat five schemas
    grammar = app.status()["grammar"]
    assert grammar["compiled"] == float(compiled.group(1))
    assert grammar["cache_hits"] == float(hits.group(1))
    assert grammar["errors"] >= 1  # the bad-input cases
