"""Structured outputs through the `openai` SDK's own helpers on one live tiny appliance (random
weights: the grammar alone makes the output valid): `parse` with pydantic models (strict schemas
with $defs/$ref, enums, Literal, Optional, lists of models), `pydantic_function_tool` with
tool_choice required/named, the streaming helper, logprobs under a grammar, `response_format` on
/v1/completions, Lark grammars, and the 400s for schemas the engine would leave unenforced.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.live import start_appliance

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Fill it in."}]


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=6)
    zip: int = pydantic.Field(ge=1000, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    color: Color
    kind: Literal["a", "b"]
    home: Address
    nick: str | None = pydantic.Field(max_length=4)
    others: list[Address] = pydantic.Field(max_length=2)
    score: float = pydantic.Field(ge=0, le=1)


class GetWeather(pydantic.BaseModel):
    """The weather at an address."""

    city: Literal["Paris", "Oslo"]
    unit: Color | None
    address: Address
    days: int = pydantic.Field(ge=1, le=5)


TOOL = openai.pydantic_function_tool(GetWeather)


@pytest.fixture(scope="module")
def appliance(tiny_dense, tmp_path_factory):
    """conftest's, with room for the tool prompt (346 tokens) and a ~170-token XML call; its
    logprobs are those of what is sampled (--logprobs-mode processed_logprobs), so a grammar's
    forbidden tokens show."""
    log = tmp_path_factory.mktemp("so_sdk") / "appliance.log"
    args = ("--max-num-seqs", "8", "--logprobs-mode", "processed_logprobs")
    app = start_appliance(tiny_dense, log, *args, max_model_len=1024)
    yield app
    assert app.stop() == 0, app.log()[-4000:]


@pytest.mark.parametrize("seed", [0, 1])
def test_parse_with_pydantic_models(sdk, model, seed):
    parse = sdk.beta.chat.completions.parse if seed % 2 else sdk.chat.completions.parse
    response = parse(
        model=model,
        messages=MESSAGES,
        response_format=Person,
        max_tokens=200,
        seed=seed,
        extra_body=NO_THINK,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}]
)
def test_pydantic_function_tool_with_defs(sdk, model, stream, tool_choice):
    # the parameters carry $defs (Address, Color) that properties $ref: each property compiles
    # with them beside it
    assert "$defs" in TOOL["function"]["parameters"]
    kwargs = dict(
        model=model,
        messages=MESSAGES,
        tools=[TOOL],
        tool_choice=tool_choice,
        max_tokens=300,
        seed=3,
        extra_body=NO_THINK,
    )
    if tool_choice == "required":  # one call: random weights may chain calls to max_tokens
        kwargs["parallel_tool_calls"] = False
    if stream:
        with sdk.beta.chat.completions.stream(**kwargs) as events:
            for _ in events:
                pass
            completion = events.get_final_completion()
    else:
        completion = sdk.beta.chat.completions.parse(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_response_format_stream_helper(sdk, model):
    with sdk.beta.chat.completions.stream(
        model=model,
        messages=MESSAGES,
        response_format=Person,
        max_tokens=200,
        seed=4,
        extra_body=NO_THINK,
    ) as events:
        for _ in events:
            pass
        completion = events.get_final_completion()
    assert isinstance(completion.choices[0].message.parsed, Person)


def test_top_logprobs_under_a_grammar_are_finite(sdk, model):
    # two allowed tokens at most per step, five alternatives asked: under processed_logprobs the
    # forbidden ones read -9999
    choices = ["alpha", "beta"]
    chat = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=5,
        seed=5,
        extra_body={**NO_THINK, "guided_choice": choices},
    )
    assert chat.choices[0].message.content in choices
    entries = chat.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == 5 for e in entries)
    assert min(t.logprob for e in entries for t in e.top_logprobs) == -9999.0
    text = sdk.completions.create(
        model=model, prompt="Pick:", logprobs=5, seed=5, extra_body={"guided_choice": choices}
    )
    assert text.choices[0].text in choices
    assert all(v >= -9999.0 for top in text.choices[0].logprobs.top_logprobs for v in top.values())


SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "y"]},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_completions_take_response_format_and_lark(sdk, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}
    response = sdk.completions.create(
        model=model, prompt="Data:", max_tokens=60, n=2, seed=6, extra_body={"response_format": fmt}
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    lark = 'start: "(" NUM ")"\nNUM: /[0-9]{1,4}/'
    response = sdk.completions.create(
        model=model, prompt="Data:", max_tokens=20, seed=6, extra_body={"guided_grammar": lark}
    )
    assert re.fullmatch(r"\([0-9]{1,4}\)", response.choices[0].text)


BAD = [
    ({"allOf": [{"type": "object"}, {"required": []}]}, "allOf"),
    ({"type": "string", "format": "uri", "maxLength": 20}, "maxLength"),
    ({"type": "string", "pattern": "(?!x)[a-z]+"}, "lookahead"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "'a'"),
]


@pytest.mark.parametrize(("schema", "words"), BAD)
def test_unenforceable_schemas_are_400s_and_leave_nothing(sdk, model, appliance, schema, words):
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=model, messages=MESSAGES, response_format=fmt, extra_body=NO_THINK
        )
    assert words in err.value.message
    assert err.value.body["param"] == "response_format"
    router = appliance.wait_idle()["router"]
    assert (router["num_running"], router["num_waiting"], router["kv_used"]) == (0, 0, 0)
