"""Stored responses (--responses-store) against the scripted engine: turns chained with
previous_response_id (the earlier input and output in the next prompt, instructions not carried),
GET / DELETE / input_items, streamed responses kept, `store: false`, failed and abandoned
responses not kept, unknown ids, the bound, and the flag off (today's 400, naming the flag)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.appliance.server.test_first_contact import _stream_then_leave, sdk_for
from tests.appliance.server.test_responses_output import check_events
from tests.appliance.server.test_serving_responses import REPLY, stream_events

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def prompt_of(engine, tokenizer) -> str:
    return tokenizer.decode(engine.received[-1].prompt_token_ids)


def not_found(client, response_id: str) -> None:
    """The previous_response_id 400 (OpenAI's) and the 404s of the store's routes."""
    r = client.post("/v1/responses", json={"input": "hi", "previous_response_id": response_id})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": f"Previous response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    for method, path in [
        ("GET", f"/v1/responses/{response_id}"),
        ("DELETE", f"/v1/responses/{response_id}"),
        ("GET", f"/v1/responses/{response_id}/input_items"),
    ]:
        r = client.request(method, path)
        assert r.status_code == 404, (method, path)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "response_id"
        assert f"'{response_id}' not found" in error["message"]


def test_two_turns_chained_with_previous_response_id(make_server, tokenizer):
    client, engine, _ = make_server(responses_store=8)
    sdk = sdk_for(client)
    first = sdk.responses.create(model="tiny", input="What is two?", instructions="Be brief.")
    assert first.store is True and first.output_text == REPLY
    second = sdk.responses.create(model="tiny", input="And three?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.store is True
    prompt = prompt_of(engine, tokenizer)
    assert prompt.index("What is two?") < prompt.index(REPLY) < prompt.index("And three?")
    assert "Be brief." not in prompt  # a previous response's instructions are not inherited
    # the prompt of the whole conversation sent in `input`
    question = {"role": "user", "content": "What is two?"}
    follow = {"role": "user", "content": "And three?"}
    sdk.responses.create(model="tiny", input=[question, *first.output, follow], store=False)
    assert engine.received[-1].prompt_token_ids == engine.received[-2].prompt_token_ids
    # a third turn carries both earlier ones; its own instructions are rendered
    sdk.responses.create(
        model="tiny", input="Four?", previous_response_id=second.id, instructions="Be kind."
    )
    prompt = prompt_of(engine, tokenizer)
    assert prompt.count(REPLY) == 2 and prompt.index("And three?") < prompt.index("Four?")
    assert prompt.startswith("<|im_start|>system\nBe kind.") and "Be brief." not in prompt
    # the input items of the second: its own, then the first's output, then the first's input
    page = sdk.responses.input_items.list(second.id)
    kinds = [(item.type, item.role) for item in page.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert page.data[0].content[0].text == "And three?" and page.data[1].id == first.output[0].id
    assert page.data[2].content[0].text == "What is two?"


def test_get_delete_and_their_route_labels(make_server):
    client, _, _ = make_server(responses_store=8, api_key=KEY)
    body = {"input": "hi", "metadata": {"run": "1"}}
    created = client.post("/v1/responses", json=body, headers=AUTH).json()
    path = f"/v1/responses/{created['id']}"
    assert client.get(path).status_code == 401  # behind the API key as every /v1 route
    got = client.get(path, headers=AUTH)
    assert got.status_code == 200 and got.json() == created and created["store"] is True
    sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0
    )
    assert sdk.responses.retrieve(created["id"]).output_text == REPLY
    items = client.get(f"{path}/input_items", headers=AUTH).json()
    assert items["object"] == "list" and items["data"][0]["content"][0]["text"] == "hi"
    assert client.delete(path).status_code == 401
    deleted = client.delete(path, headers=AUTH)
    assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
    assert client.get(path, headers=AUTH).status_code == 404
    other = sdk.responses.create(model="tiny", input="hi")
    assert sdk.responses.delete(other.id) is None  # the SDK reads no body
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(other.id)
    metrics = client.get("/metrics").text
    for label in ('{response_id}",status="200"', '{response_id}",status="404"'):
        assert f'route="/v1/responses/{label}' in metrics
    assert 'route="/v1/responses/{response_id}/input_items",status="200"' in metrics


def test_a_streamed_response_is_kept_and_continued(make_server, tokenizer):
    client, engine, _ = make_server(responses_store=8)
    events = stream_events(client, {"input": "What is two?"})
    final = check_events(events)
    assert events[0]["response"]["store"] is True and final["store"] is True
    assert client.get(f"/v1/responses/{final['id']}").json() == final
    sdk = sdk_for(client)
    kwargs = dict(model="tiny", input="And three?", previous_response_id=final["id"])
    with sdk.responses.stream(**kwargs) as stream:
        second = stream.get_final_response()
    prompt = prompt_of(engine, tokenizer)
    assert prompt.index("What is two?") < prompt.index(REPLY) < prompt.index("And three?")
    assert client.get(f"/v1/responses/{second.id}").json()["output"][0]["id"] == second.output[0].id
    # cut by max_output_tokens: incomplete, kept as OpenAI keeps it
    cut = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    assert cut["status"] == "incomplete"
    assert client.get(f"/v1/responses/{cut['id']}").json()["status"] == "incomplete"


def test_store_false_unknown_failed_and_abandoned_responses_are_not_kept(make_server, tokenizer):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, _ = make_server(script=lambda p: ids, responses_store=8, request_timeout=0.5)
    unstored = client.post("/v1/responses", json={"input": "hi", "store": False}).json()
    assert unstored["status"] == "completed" and unstored["store"] is False
    received = len(engine.received)
    not_found(client, unstored["id"])
    not_found(client, "resp_unknown")
    assert len(engine.received) == received  # refused before reaching the engine
    engine.step_s = 0.05  # 40 tokens take 2 s: past the deadline, and long after a client leaves
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error"
    timed_out = json.loads(lines[1][len("data: ") :])["response"]["id"]
    body = {"model": "tiny", "input": "hi", "stream": True}
    messages = client.portal.call(_stream_then_leave, client.app, "/v1/responses", body)
    first = next(m["body"] for m in messages if m["type"] == "http.response.body" and m["body"])
    left = json.loads(first.decode().split("data: ")[1])["response"]["id"]
    for response_id in (timed_out, left):
        assert client.get(f"/v1/responses/{response_id}").status_code == 404


def test_the_least_recently_used_response_goes_first(make_server):
    client, _, _ = make_server(responses_store=2)
    sdk = sdk_for(client)
    first, second = (sdk.responses.create(model="tiny", input="hi") for _ in range(2))
    sdk.responses.retrieve(first.id)  # used: the second is now the least recent
    third = sdk.responses.create(model="tiny", input="hi")
    not_found(client, second.id)
    for kept in (first, third):  # continued without keeping another (which would evict)
        kwargs = dict(model="tiny", input="hi", previous_response_id=kept.id, store=False)
        assert sdk.responses.create(**kwargs).previous_response_id == kept.id


def test_off_by_default_refusing_previous_response_id_and_naming_the_flag(make_server):
    client, engine, _ = make_server()
    created = client.post("/v1/responses", json={"input": "hi"}).json()
    assert created["store"] is False
    r = client.post("/v1/responses", json={"input": "hi", "previous_response_id": created["id"]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "previous_response_id"
    assert "--responses-store" in error["message"] and len(engine.received) == 1
    for method in ("GET", "DELETE"):
        r = client.request(method, f"/v1/responses/{created['id']}")
        assert r.status_code == 404 and "--responses-store" in r.json()["error"]["message"]
