"""The response store (responses_store.py) on its own: the count and byte bounds (least recently
used out first), chains of previous_response_id, instructions not carried over, delete, the
input items a request adds and their listing."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.config import ServerConfig
from appliance.server.responses_request import ResponsesRequest, chat_request
from appliance.server.responses_store import (
    PreviousResponseNotFound,
    ResponseStore,
    json_size,
    new_store,
    own_items,
)


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def answer(response_id: str, text: str, instructions: str | None = None) -> dict[str, Any]:
    """A finished Response with one message item."""
    message = {
        "type": "message",
        "id": f"msg_{response_id}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    return {
        "id": response_id,
        "object": "response",
        "instructions": instructions,
        "output": [message],
    }


def keep(store: ResponseStore, response_id: str, text: str = "ok", **fields: Any) -> bool:
    body = request(**fields)
    return store.keep(answer(response_id, text, body.instructions), store.turn(body))


def texts(items: list[dict[str, Any]]) -> list[str]:
    """Each item's text, for comparing conversations."""
    out = []
    for item in items:
        content = item["content"]
        out.append(content if isinstance(content, str) else content[0]["text"])
    return out


def test_the_count_bound_evicts_the_least_recently_used():
    store = ResponseStore(2)
    keep(store, "resp_1")
    keep(store, "resp_2")
    assert store.get("resp_1") is not None  # used: resp_2 is now the least recent
    keep(store, "resp_3")
    assert ("resp_1" in store, "resp_2" in store, "resp_3" in store) == (True, False, True)
    # continuing a response uses it too
    store.turn(request(previous_response_id="resp_1"))
    keep(store, "resp_4")
    assert ("resp_1" in store, "resp_3" in store, len(store)) == (True, False, 2)


def test_the_byte_bound_evicts_and_a_response_over_it_alone_is_not_kept():
    one = ResponseStore(100)
    keep(one, "resp_0", "x" * 100, input="y" * 100)
    size = one.nbytes
    # the input items' JSON and the whole Response's
    assert size == json_size(own_items("y" * 100)) + json_size(answer("resp_0", "x" * 100)) > 200
    store = ResponseStore(100, max_bytes=3 * size)
    for n in range(5):
        assert keep(store, f"resp_{n}", "x" * 100, input="y" * 100)
        assert store.nbytes <= 3 * size
    assert [f"resp_{n}" in store for n in range(5)] == [False, False, True, True, True]
    assert not keep(store, "resp_big", "x" * 10 * size)  # alone over the bound
    assert "resp_big" not in store and len(store) == 3  # and nothing evicted for it
    assert store.delete("resp_4") and store.nbytes == 2 * size
    assert not store.delete("resp_4") and not store.delete("resp_unknown")
    assert store.get("resp_4") is None


def test_a_chain_carries_each_turns_input_and_output_but_not_instructions():
    store = ResponseStore(8)
    keep(store, "resp_1", "Four.", input="Two plus two?", instructions="Be terse.")
    second = request(input="And times three?", previous_response_id="resp_1")
    turn = store.turn(second)
    assert texts(turn.input_items) == ["Two plus two?", "Four.", "And times three?"]
    store.keep(answer("resp_2", "Twelve."), turn)
    third = request(
        input=[{"role": "user", "content": "Minus one?"}], previous_response_id="resp_2"
    )
    items = store.turn(third).input_items
    assert texts(items) == ["Two plus two?", "Four.", "And times three?", "Twelve.", "Minus one?"]
    assert [item["type"] for item in items] == ["message"] * 5
    assert store.get("resp_2").input_items == turn.input_items  # its own input after the chain
    # the chat request the third turn becomes: the conversation, no system message from resp_1
    chat = chat_request(third.model_copy(update={"input": items, "previous_response_id": None}))
    assert [m.role for m in chat.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert "Be terse." not in str(chat.messages)
    # a chain's bytes grow with its conversation
    assert store.get("resp_2").conversation_bytes > store.get("resp_1").conversation_bytes


def test_an_unknown_previous_response_is_openais_400():
    store = ResponseStore(4)
    with pytest.raises(PreviousResponseNotFound) as info:
        store.turn(request(previous_response_id="resp_nope"))
    err = info.value
    assert (err.status, err.param, err.code) == (
        400,
        "previous_response_id",
        "previous_response_not_found",
    )
    assert err.message == "Previous response with id 'resp_nope' not found."
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_own_items_are_typed_and_given_ids_without_touching_the_request():
    sent = [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18"},
        {"type": "message", "id": "msg_mine", "role": "user", "content": "more"},
    ]
    body = request(input=sent)
    items = own_items(body.input)
    assert [item["type"] for item in items] == ["message", "function_call_output", "message"]
    assert items[0]["id"].startswith("msg_") and items[1]["id"].startswith("fco_")
    assert items[2]["id"] == "msg_mine"
    assert "id" not in body.input[0] and "type" not in body.input[0]
    (text,) = own_items("hello")
    assert text["role"] == "user" and text["content"] == [{"type": "input_text", "text": "hello"}]


def test_the_input_items_listing_pages_newest_first():
    store = ResponseStore(4)
    keep(store, "resp_1", input=[{"role": "user", "content": str(n)} for n in range(5)])
    page = store.input_items_page("resp_1", 2, "desc", None)
    assert texts(page["data"]) == ["4", "3"] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"], page["data"][1]["id"])
    rest = store.input_items_page("resp_1", 20, "desc", page["last_id"])
    assert texts(rest["data"]) == ["2", "1", "0"] and rest["has_more"] is False
    assert texts(store.input_items_page("resp_1", 20, "asc", None)["data"]) == list("01234")


def test_the_flag_makes_the_store():
    assert new_store(ServerConfig()) is None
    store = new_store(ServerConfig(responses_store=3))
    assert store is not None and store.max_responses == 3
    with pytest.raises(ValueError, match="responses_store"):
        ServerConfig(responses_store=-1)
