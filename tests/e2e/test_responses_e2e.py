"""POST /v1/responses on a live appliance (tiny random checkpoint) through the `openai` SDK: greedy
text and usage equal to /v1/chat/completions' for the same request, streaming (deltas, event order,
the SDK's stream helper), reasoning.effort switching thinking, a function call forced by tool_choice
(random weights call no tool on their own: the grammar makes the call), the next turn after a call,
json_schema output, max_output_tokens -> incomplete, and stored responses (--responses-store 16):
turns chained with previous_response_id, then retrieved, listed and deleted.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.appliance.server.test_responses_output import check_events
from tests.e2e.live import start_appliance
from tests.e2e.test_structured_outputs_sdk import SCHEMA

INSTRUCTIONS = "Answer briefly."
QUESTION = "Write a function that adds two numbers."
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def appliance(tiny_dense, tmp_path_factory):
    """conftest's, keeping 16 responses (previous_response_id, GET, DELETE)."""
    log = tmp_path_factory.mktemp("responses") / "appliance.log"
    app = start_appliance(tiny_dense, log, "--max-num-seqs", "16", "--responses-store", "16")
    yield app
    assert app.stop() == 0, app.log()[-4000:]


def _chat(sdk, model, thinking: bool, **kw):
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
    return sdk.chat.completions.create(
        model=model, messages=messages, temperature=0, extra_body=extra, **kw
    )


def _respond(sdk, model, effort: str, **kw):
    return sdk.responses.create(
        model=model,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        temperature=0,
        reasoning={"effort": effort},
        **kw,
    )


def test_greedy_text_and_usage_are_the_chat_routes(sdk, model):
    response = _respond(sdk, model, "none", max_output_tokens=24, metadata={"run": "e2e"})
    chat = _chat(sdk, model, thinking=False, max_tokens=24)
    choice = chat.choices[0]
    assert response.output_text and response.output_text == choice.message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == model and response.metadata == {"run": "e2e"}
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 24
    expected = "incomplete" if choice.finish_reason == "length" else "completed"
    assert response.status == expected
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
        chat.usage.total_tokens,
    )
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_stream_deltas_events_and_the_sdk_helper(sdk, model):
    collected = _respond(sdk, model, "none", max_output_tokens=24)
    raw = _respond(sdk, model, "none", max_output_tokens=24, stream=True)
    events = [event.model_dump(mode="json") for event in raw]
    final = check_events(events)  # numbered, one item open at a time, deltas add up
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == collected.output_text
    assert final["output"][0]["content"][0]["text"] == collected.output_text
    usage = collected.usage
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    with sdk.responses.stream(
        model=model,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        temperature=0,
        reasoning={"effort": "none"},
        max_output_tokens=24,
    ) as stream:
        seen = list(stream)
    # cut by max_output_tokens (random weights rarely stop sooner): the last event is
    # response.incomplete, which the helper passes on with the whole response
    snapshots = [e.snapshot for e in seen if e.type == "response.output_text.delta"]
    assert seen[-1].type == f"response.{collected.status}"
    assert snapshots[-1] == seen[-1].response.output_text == collected.output_text


def test_reasoning_effort_turns_thinking_on(sdk, model):
    response = _respond(sdk, model, "high", max_output_tokens=16)
    chat = _chat(sdk, model, thinking=True, max_tokens=16)
    message = chat.choices[0].message
    reasoning = [item for item in response.output if item.type == "reasoning"]
    thought = message.model_extra.get("reasoning_content")
    assert thought, "the tiny model thinks first when thinking is on"
    assert [item.content[0].text for item in reasoning] == [thought]
    assert response.output_text == (message.content or "")
    details = response.usage.output_tokens_details
    assert 0 < details.reasoning_tokens <= response.usage.output_tokens == 16
    # the chat route counts them alike (OpenAI's completion_tokens_details)
    assert chat.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["req", "named"]
)
def test_a_forced_function_call_and_the_next_turn(sdk, model, tool_choice):
    question = {"role": "user", "content": "Weather in Paris?"}
    kwargs = dict(model=model, tools=[TOOL], tool_choice=tool_choice, temperature=0)
    kwargs |= dict(reasoning={"effort": "none"}, parallel_tool_calls=False, max_output_tokens=120)
    response = sdk.responses.create(input=[question], **kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and call.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    with sdk.responses.stream(input=[question], **kwargs) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert "".join(pieces) == streamed_call.arguments == call.arguments
    # the next turn: the output sent back with the call's result, free text this time
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}
    follow = sdk.responses.create(
        model=model,
        input=[question, *response.output, result],
        tools=[TOOL],
        temperature=0,
        reasoning={"effort": "none"},
        max_output_tokens=4,
    )
    assert follow.usage.input_tokens > response.usage.input_tokens + 10


def test_json_schema_output_is_valid_json(sdk, model):
    response = sdk.responses.create(
        model=model,
        input="Fill it in.",
        text={"format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}},
        reasoning={"effort": "none"},
        max_output_tokens=60,
        extra_body={"seed": 6},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_makes_the_response_incomplete(sdk, model):
    response = _respond(sdk, model, "none", max_output_tokens=4, extra_body={"ignore_eos": True})
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 4


def test_previous_response_id_chains_turns_then_retrieve_and_delete(sdk, model, appliance):
    greedy = dict(model=model, temperature=0, reasoning={"effort": "none"}, max_output_tokens=8)
    first = sdk.responses.create(input=QUESTION, instructions=INSTRUCTIONS, **greedy)
    assert first.store is True and first.output_text
    follow = "And in Python?"
    second = sdk.responses.create(input=follow, previous_response_id=first.id, **greedy)
    assert second.previous_response_id == first.id and second.store is True
    # the same prompt (without the first's instructions) and greedy text as the whole
    # conversation sent in `input`
    turns = [
        {"role": "user", "content": QUESTION},
        *first.output,
        {"role": "user", "content": follow},
    ]
    whole = sdk.responses.create(input=turns, store=False, **greedy)
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    retrieved = sdk.responses.retrieve(second.id)
    assert retrieved.output_text == second.output_text
    assert (retrieved.previous_response_id, retrieved.status) == (first.id, second.status)
    items = sdk.responses.input_items.list(second.id, order="asc").data
    assert [item.role for item in items] == ["user", "assistant", "user"]
    assert items[0].content[0].text == QUESTION and items[2].content[0].text == follow
    sdk.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(input="Hi.", previous_response_id=second.id, **greedy)
    assert info.value.body["code"] == "previous_response_not_found"
    assert sdk.responses.retrieve(first.id).id == first.id  # the others stay


def test_unsupported_tools_are_refused(sdk, model, appliance):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=model, input="Hi.", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools" and "'web_search'" in info.value.body["message"]
    router = appliance.wait_idle()["router"]
    assert (router["num_running"], router["num_waiting"], router["kv_used"]) == (0, 0, 0)
