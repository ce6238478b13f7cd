"""A response built from one choice's deltas (responses_output.py): reasoning, message and
function_call items in the order the model writes them, the stream's event grammar (numbered,
one item open at a time, deltas that add up to the final item), usage with reasoning tokens, and
the incomplete status of an answer cut by its length."""

from __future__ import annotations

import json
from typing import Any

from appliance.messages import TextDelta
from appliance.server.protocol import ChatCompletionRequest
from appliance.server.responses_output import ResponseRun, response_shell
from appliance.server.responses_request import ResponsesRequest
from appliance.server.serving_chat import ChoiceParser

THINK_END = 99  # the `</think>` token id of these tests
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>"
)


def check_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Asserts a Responses stream's event grammar; returns the response of its last event."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    final = last["response"]
    assert last["type"] == f"response.{final['status']}"
    opened: dict[int, bool] = {}  # output index -> still open
    grown: dict[int, str] = {}  # output index -> the deltas' text
    for event in events[2:-1]:
        kind, index = event["type"], event["output_index"]
        if kind == "response.output_item.added":
            assert index == len(opened) and not any(opened.values()), "one item open at a time"
            opened[index], grown[index] = True, ""
            assert event["item"]["status"] == "in_progress"
            continue
        assert opened.get(index), (kind, index)
        if kind.endswith(".delta"):
            grown[index] += event["delta"]
        if kind == "response.output_item.done":
            opened[index] = False
            assert event["item"] == final["output"][index]
    assert len(opened) == len(final["output"]) and not any(opened.values())
    for index, item in enumerate(final["output"]):
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert grown[index] == whole, item
    return final


def make_run(**request: Any) -> ResponseRun:
    """A run over a prompt that opens `<think>` (the parser starts in reasoning)."""
    body = ResponsesRequest.model_validate({"input": "hi", **request})
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    )
    parser = ChoiceParser(chat, "<|im_start|>assistant\n<think>\n", "auto", 0)
    shell = response_shell(body, "resp_1", 1700000000, "tiny", {"temperature": 0.6})
    return ResponseRun(shell, parser, 12, THINK_END)


def feed(run: ResponseRun, *deltas: tuple[str, list[int], str | None]) -> list[dict[str, Any]]:
    events = run.opening()
    count = 0
    for text, token_ids, finish in deltas:
        count += len(token_ids)
        events += run.feed(TextDelta("r", text, token_ids, count, finish, cached_tokens=4))
    return events + run.closing()


def test_reasoning_text_and_a_call_in_order_with_their_events():
    run = make_run(instructions="Be brief.", metadata={"k": "v"}, tools=[], top_p=0.5)
    events = feed(
        run,
        ("Let me ", [1, 2], None),
        ("think.</think>\n\nSure", [3, THINK_END, 4], None),
        ("." + CALL, [5, 6, 7, 8], "stop"),
    )
    response = check_events(events)
    assert response == run.response()  # the JSON answer is the stream's last response
    reasoning, message, call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert reasoning["summary"] == [] and reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"] == "Sure." and message["role"] == "assistant"
    assert message["id"].startswith("msg_") and message["content"][0]["annotations"] == []
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert [item["status"] for item in response["output"]] == ["completed"] * 3
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4},  # up to and with </think>
        "total_tokens": 21,
    }
    # the request's echoes; unset temperature: the sampling default it ran with
    assert (response["id"], response["object"], response["model"]) == ("resp_1", "response", "tiny")
    assert (response["instructions"], response["metadata"]) == ("Be brief.", {"k": "v"})
    assert (response["temperature"], response["top_p"]) == (0.6, 0.5)
    assert response["text"] == {"format": {"type": "text"}} and response["store"] is False
    assert run.parser.finish_reason("stop") == "tool_calls"  # as the chat route labels it
    kinds = [e["type"] for e in events]
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 1


def test_an_answer_cut_by_its_length_is_incomplete():
    run = make_run(max_output_tokens=3, reasoning={"effort": "high"})
    assert run.response()["status"] == "in_progress" and run.response()["usage"] is None
    response = check_events(feed(run, ("Hmm, ", [1, 2], None), ("so", [3], "length")))
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    (reasoning,) = response["output"]
    assert reasoning["status"] == "incomplete"
    assert reasoning["content"][0]["text"] == "Hmm, so"
    usage = response["usage"]
    assert usage["output_tokens"] == usage["output_tokens_details"]["reasoning_tokens"] == 3
    assert response["reasoning"] == {"effort": "high", "summary": None}
    assert response["max_output_tokens"] == 3


def test_no_text_no_items():
    run = make_run()
    response = check_events(feed(run, ("</think>\n\n", [THINK_END], "stop")))
    assert response["output"] == [] and response["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0
    }


def test_reasoning_that_ended_before_the_limit_is_complete():
    """The length limit cut the answer after `</think>`: the reasoning item is completed, the
    response incomplete."""
    run = make_run(max_output_tokens=3)
    response = check_events(
        feed(run, ("Hmm.", [1], None), ("</think>\n\n", [THINK_END, 2], "length"))
    )
    assert response["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in response["output"]] == [("reasoning", "completed")]


def test_the_response_validates_as_the_sdk_types_it():
    """Every field the openai SDK's Response requires (usage's cache_write_tokens included) and
    the tools echoed in the flat form, a chat-form tool included."""
    from openai.types.responses import Response

    flat = {"type": "function", "name": "get_time", "parameters": PARAMETERS, "strict": True}
    run = make_run(tools=[*TOOLS, flat], text={"format": {"type": "text"}, "verbosity": "low"})
    response = check_events(feed(run, ("Hmm.</think>\n\nHi.", [1, THINK_END, 2], "stop")))
    parsed = Response.model_validate(response)
    assert parsed.usage.input_tokens_details.cache_write_tokens == 0
    assert [t.name for t in parsed.tools] == ["get_weather", "get_time"]
    assert response["text"]["verbosity"] == "low" and parsed.output_text == "Hi."
