"""POST /v1/responses against the scripted engine, through the `openai` SDK where it can: the same
prompt and sampling as the chat route, streamed and collected answers that agree, reasoning and
tool calls as output items, multi-turn tool use, the 400s naming the Responses fields, the HTTP
metric's route, errors mid-stream and a client that leaves."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.appliance.server.test_first_contact import (  # noqa: F401 (access_lines: a fixture)
    _stream_then_leave,
    access_lines,
    finished,
    logged_server,
    sdk_for,
)
from tests.appliance.server.test_responses_output import CALL, PARAMETERS, check_events

REPLY = "hello world héllo"
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": True}


def stream_events(client, body: dict) -> list[dict]:
    """The raw events of a streamed response; each `event:` line names its data's type."""
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: ") :] for line in lines[0::2]]
    events = [json.loads(line[len("data: ") :]) for line in lines[1::2]]
    assert names == [e["type"] for e in events]
    return events


def test_the_same_request_as_the_chat_route_and_stream_agrees(make_server):
    client, engine, _ = make_server()
    sdk = sdk_for(client)
    response = sdk.responses.create(
        model="tiny", input="hi", instructions="Be brief.", temperature=0, extra_body={"seed": 5}
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = sdk.chat.completions.create(model="tiny", messages=messages, temperature=0, seed=5)
    answered, chatted = engine.received[-2:]
    assert answered.prompt_token_ids == chatted.prompt_token_ids
    assert answered.sampling == chatted.sampling and answered.max_tokens == chatted.max_tokens
    assert response.output_text == chat.choices[0].message.content == REPLY
    assert response.id.startswith("resp_") and response.status == "completed"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
        chat.usage.total_tokens,
    )
    with sdk.responses.stream(model="tiny", input="hi", instructions="Be brief.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == REPLY
    assert final.usage.output_tokens == usage.output_tokens
    raw = check_events(stream_events(client, {"input": "hi", "max_output_tokens": 3}))
    assert raw["status"] == "incomplete" and raw["usage"]["output_tokens"] == 3


def test_reasoning_and_a_tool_call_then_the_next_turn(make_server, tokenizer):
    script = tokenizer.encode("<think>Weather.</think>" + CALL, add_special_tokens=False)
    client, engine, state = make_server(script=lambda prompt: script, reasoning="on")
    sdk = sdk_for(client)
    question = {"role": "user", "content": "Weather in Paris?"}
    response = sdk.responses.create(model="tiny", input=[question], tools=[TOOL])
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Weather."
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and response.output_text == ""
    assert finished(state, "tool_calls") == 1  # the metrics label the chat route gives it
    streamed = check_events(stream_events(client, {"input": [question], "tools": [TOOL]}))
    assert [item["type"] for item in streamed["output"]] == ["reasoning", "function_call"]
    assert streamed["output"][1]["arguments"] == call.arguments
    # the next turn sends the output back with the call's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}
    sdk.responses.create(model="tiny", input=[question, *response.output, result], tools=[TOOL])
    prompt = tokenizer.decode(engine.received[-1].prompt_token_ids)
    assert "18 degrees" in prompt and prompt.index("Weather in Paris?") < prompt.index("18 deg")
    metrics = client.get("/metrics").text
    assert 'route="/v1/responses",status="200"' in metrics


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_output_tokens": 1000}, "max_output_tokens", "'max_output_tokens' is too large"),
        (
            {"text": {"format": {"type": "json_schema", "name": "o", "schema": {"not": {}}}}},
            "text",
            "text.format: schema keyword 'not'",
        ),
        ({"tools": [{**TOOL, "name": "no spaces"}]}, "tools", "tools.0.name:"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"use_beam_search": True}, "use_beam_search", "/v1/chat/completions"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"model": "other"}, "model", "does not exist"),
    ],
)
def test_errors_name_the_responses_fields(make_server, fields, param, words):
    client, engine, _ = make_server()
    r = client.post("/v1/responses", json={"input": "hi", **fields})
    assert r.status_code in (400, 404)
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert engine.received == []


def test_an_error_mid_stream_is_an_error_event_the_sdk_raises(make_server, tokenizer):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, _ = make_server(script=lambda prompt: ids, request_timeout=0.3)
    engine.step_s = 0.05  # 40 tokens take 2 s
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error"
    error = json.loads(lines[-1][len("data: ") :])
    assert error["type"] == "error" and error["code"] == "request_timeout"
    assert error["sequence_number"] == len(lines) // 2 - 1
    with pytest.raises(openai.APIError, match="did not finish"):
        for _ in sdk_for(client).responses.create(model="tiny", input="hi", stream=True):
            pass


def test_a_client_that_leaves_mid_stream_aborts_the_request(
    make_server,
    tokenizer,
    access_lines,  # noqa: F811 (the fixture imported above)
):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = logged_server(make_server, script=lambda prompt: ids)
    engine.step_s = 0.05  # 40 tokens take 2 s: the client leaves long before the end
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 40, "stream": True}
    messages = client.portal.call(_stream_then_leave, client.app, "/v1/responses", body)
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    (line,) = [x for x in access_lines if " id=gone1" in x]
    assert " completion=resp_" in line and line.endswith(" aborted=client_gone")
    deadline = time.monotonic() + 3
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == 1 and state.client.num_open == 0
    assert finished(state, "abort") == 1
