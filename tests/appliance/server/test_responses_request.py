"""/v1/responses requests as the chat route's requests (responses_request.py, responses_input.py):
input items as one conversation, tools / tool_choice / text.format / reasoning.effort as the chat
fields, the sampling fields carried over, and the 400s for what is refused, naming the field."""

from __future__ import annotations

import json

import pytest

from appliance.server.errors import BadRequest
from appliance.server.protocol import ImagePart, TextPart
from appliance.server.responses_request import ResponsesRequest, chat_request

PIXEL = "data:image/png;base64,iVBORw0KGgo="
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}


def translate(**fields):
    return chat_request(ResponsesRequest.model_validate({"input": "hi", **fields}))


def refused(**fields) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        translate(**fields)
    return info.value


def test_a_string_input_is_one_user_message_after_the_instructions():
    chat = translate(input="Hello.", instructions="Be brief.")
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hello."),
    ]
    assert chat.n == 1 and chat.tools is None and chat.response_format is None


ARGUMENTS = json.dumps({"a": 1})
# fmt: off
ITEMS = [
    {"role": "developer", "content": "Use tools."},
    {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Look:"},
            {"type": "input_image", "image_url": PIXEL, "detail": "low"},
        ],
    },
    # a response's output sent back: reasoning, text and two calls are one turn
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
        {"type": "reasoning_text", "text": "Two calls."}
    ]},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
     "arguments": ARGUMENTS, "status": "completed"},
    {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "one"},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "two"}]},
    {"role": "assistant", "content": "Done."},
    {"role": "assistant", "content": "Anything else?"},  # text after text: a new turn
    {"role": "user", "content": "No."},
]
# fmt: on


def test_input_items_become_one_conversation_with_the_turns_merged():
    chat = translate(instructions="Be brief.", input=ITEMS)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "developer", "user", "assistant", "tool", "tool"] + [
        "assistant",
        "assistant",
        "user",
    ]
    developer, user, turn = chat.messages[1:4]
    assert developer.content == "Use tools."  # developer is rendered as system by the prompt
    assert [type(part) for part in user.content] == [TextPart, ImagePart]
    assert user.content[1].image_url.url == PIXEL and user.content[1].image_url.detail == "low"
    assert (turn.reasoning_content, turn.content) == ("Two calls.", "Calling.")
    assert turn.tool_calls == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": ARGUMENTS}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    outputs = [(m.tool_call_id, m.content) for m in chat.messages[4:6]]
    assert outputs == [("call_1", "one"), ("call_2", "two")]
    assert [m.content for m in chat.messages[6:]] == ["Done.", "Anything else?", "No."]


@pytest.mark.parametrize(
    ("item", "where"),
    [
        ({"type": "item_reference", "id": "msg_1"}, "input.0.type: item type 'item_reference'"),
        ({"role": "tool", "content": "x"}, "input.0.role"),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            "input.0.content.0: part type 'input_file'",
        ),
        (
            {"role": "user", "content": [{"type": "input_image", "file_id": "f"}]},
            "file_id is not supported",
        ),
        ({"role": "user", "content": [{"type": "input_text"}]}, "input.0.content.0.text"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0.output"),
        # list members that are not parts: a 400, never an AttributeError's 500
        ({"type": "function_call_output", "call_id": "c", "output": [1]}, "input.0.output.0"),
        ({"type": "reasoning", "content": [1]}, "input.0.content.0: expected an object"),
        ({"type": "reasoning", "summary": ["x"]}, "input.0.summary.0: expected an object"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": 5}]},
            "input.0.content.0.image_url: expected a URL or a data URL string, got int",
        ),
    ],
)
def test_a_bad_item_is_a_400_naming_where_it_is(item, where):
    err = refused(input=[item])
    assert err.param == "input" and where in err.message, err.message


def test_tools_tool_choice_text_and_sampling_reach_the_chat_fields():
    chat = translate(
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}},
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        top_k=5,
        repetition_penalty=1.1,
        stream=True,
        metadata={"k": "v"},
        store=True,
        user="u",
        include=["reasoning.encrypted_content"],
        unknown_field=1,  # ignored, as the chat route ignores unknown fields
    )
    function = {"name": "get_weather", "parameters": SCHEMA, "strict": True}
    assert chat.tools == [{"type": "function", "function": function}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    spec = {"name": "o", "schema": SCHEMA, "strict": True}
    assert chat.response_format == {"type": "json_schema", "json_schema": spec}
    assert chat.requested_max_tokens() == 7
    assert (chat.temperature, chat.top_p, chat.seed, chat.top_k) == (0.5, 0.9, 3, 5)
    assert chat.repetition_penalty == 1.1 and chat.stream is True
    assert translate(text={"format": {"type": "json_object"}}).response_format == {
        "type": "json_object"
    }
    assert translate(text={"format": {"type": "text"}}).response_format is None


def test_mm_processor_kwargs_reach_the_chat_request():
    """vLLM's per-request image range rides along to the chat route, which sizes the images."""
    kwargs = {"size": {"shortest_edge": 1024, "longest_edge": 4096}}
    assert translate(mm_processor_kwargs=kwargs).mm_processor_kwargs == kwargs


@pytest.mark.parametrize(
    ("effort", "switches"),
    [
        (None, None),
        ("none", {"enable_thinking": False}),
        ("minimal", {"enable_thinking": False}),
        ("low", {"enable_thinking": True}),
        ("high", {"enable_thinking": True}),
    ],
)
def test_reasoning_effort_switches_thinking(effort, switches):
    assert translate(reasoning={"effort": effort}).chat_template_kwargs == switches


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
        ({"n": 2}, "n", "one output"),
        ({"truncation": "auto"}, "truncation", "never cut"),
        (
            {"tools": [TOOL, {"type": "web_search"}, {"type": "mcp"}]},
            "tools",
            "'web_search', 'mcp'",
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
        ({"text": {"format": {"type": "xml"}}}, "text", "'xml'"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text", "'name'"),
    ],
)
def test_refused_fields_are_400s_naming_the_field(fields, param, words):
    err = refused(**fields)
    assert err.param == param and words in err.message, err.message


def test_schema_types_are_checked_as_the_chat_route_checks_them():
    for fields in ({"input": 3}, {"reasoning": {"effort": "max"}}, {"metadata": {"k": 1}}):
        with pytest.raises(ValueError):
            ResponsesRequest.model_validate({"input": "hi", **fields})


def test_a_function_choice_without_a_string_name_says_so():
    err = refused(tools=[TOOL], tool_choice={"type": "function", "name": 3})
    assert err.param == "tool_choice" and "needs 'name', a string" in err.message
