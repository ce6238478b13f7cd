"""Stored responses (`--responses-store N`): the Responses kept in this server process's memory, so
that a request may continue one with `previous_response_id` and clients may GET or DELETE them.

Built by app.py (one store per server process, None when the flag is 0); used by
serving_responses.py (resolving a request's chain, keeping its Response) and app.py's routes.
Every call runs on the server's event loop and none awaits, so no lock is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from appliance.config import ServerConfig
from appliance.logging import get_logger
from appliance.server.errors import BadRequest, NotFound
from appliance.server.responses_output import item_id
from appliance.server.responses_request import ResponsesRequest

logger = get_logger(__name__)

# the JSON characters (json_size) the kept responses may count together; past it the least
# recently used go
MAX_STORE_BYTES = 1 << 30
Item = dict[str, Any]  # one input or output item, as the Responses API spells it
# the prefix of the id an input item sent without one is given (items of other types are refused
# before anything is kept: responses_input.py)
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}
OFF = "this server stores no responses (start it with --responses-store N to keep N of them)"


class PreviousResponseNotFound(BadRequest):
    """OpenAI's answer to a previous_response_id it does not have (or no longer has): a 400."""

    def __init__(self, response_id: str) -> None:
        message = f"Previous response with id '{response_id}' not found."
        super().__init__(message, "previous_response_id", "previous_response_not_found")


class ResponseNotFound(NotFound):
    def __init__(self, response_id: str, store_on: bool) -> None:
        why = "" if store_on else f" ({OFF})"
        super().__init__(f"Response with id '{response_id}' not found.{why}", "response_id")


def json_size(value: Any) -> int:
    """About the characters of `value` as JSON (strings by their length, unescaped), counted in
    time that grows with its number of values, not its bytes: an image's data URL is one string,
    and this runs on the event loop."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, dict):
        return 2 + sum(len(str(key)) + 4 + json_size(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return 2 + sum(json_size(item) + 1 for item in value)
    return len(str(value))  # numbers, booleans, None


@dataclass
class StoredResponse:
    """A kept response and the conversation that produced it."""

    response: dict[str, Any]  # the Response object, as the JSON answer or the stream's last event
    input_items: list[Item]  # its resolved input: the previous response's conversation, its own
    conversation_bytes: int  # JSON size of input_items and the output items
    nbytes: int  # what it counts against MAX_STORE_BYTES: input_items and the whole Response

    @property
    def conversation(self) -> list[Item]:
        """What a request continuing this one starts with: its input items, then its output (the
        request's `instructions` are not among them: OpenAI does not carry them over)."""
        return [*self.input_items, *self.response["output"]]


@dataclass
class Turn:
    """One request's place in a conversation: what it continues and its own input, as items."""

    history: list[Item]  # the previous response's conversation; [] without previous_response_id
    history_bytes: int
    own: list[Item]  # the request's `input` as items, each with an id
    own_bytes: int

    @property
    def input_items(self) -> list[Item]:
        return [*self.history, *self.own]


def own_items(input_: str | list[Item]) -> list[Item]:
    """A request's input as the items an input-items listing shows: a string is a user message
    of one input_text part (the chat template renders it as the string), an item without `type`
    is a message, an item without `id` gets one."""
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": [{"type": "input_text", "text": input_}]}]
    items = []
    for item in input_:
        kind = item.get("type", "message")
        item = {"type": kind, **item}  # a copy: the request's own items stay as they came
        if not item.get("id"):
            item["id"] = item_id(_ID_PREFIXES.get(kind, "item"))
        items.append(item)
    return items


class ResponseStore:
    """At most `max_responses` responses and MAX_STORE_BYTES of their JSON, least recently used
    (created, continued or retrieved) first out. A response counts its whole conversation's bytes,
    though the turns of one chain share those items in memory: the bound is an upper one."""

    def __init__(self, max_responses: int, max_bytes: int = MAX_STORE_BYTES) -> None:
        assert max_responses >= 1 and max_bytes >= 1
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._kept

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._kept.pop(response_id, None)
        if stored is None:
            return False
        self.nbytes -= stored.nbytes
        return True

    def turn(self, body: ResponsesRequest) -> Turn:
        """The request's turn: the stored conversation its previous_response_id names (a 400,
        OpenAI's, when it is not kept) and its own input items."""
        history, history_bytes = [], 0
        if body.previous_response_id is not None:
            previous = self.get(body.previous_response_id)
            if previous is None:
                raise PreviousResponseNotFound(body.previous_response_id)
            history, history_bytes = previous.conversation, previous.conversation_bytes
        own = own_items(body.input)
        return Turn(history, history_bytes, own, json_size(own))

    def keep(self, response: dict[str, Any], turn: Turn) -> bool:
        """Keeps a finished response (evicting the least recently used past the bounds); False
        when it alone is over the byte bound."""
        output_bytes = json_size(response["output"])
        response_bytes = json_size(response)
        input_bytes = turn.history_bytes + turn.own_bytes
        nbytes = input_bytes + response_bytes
        if nbytes > self.max_bytes:
            logger.warning(
                "response %s not stored: its conversation is %d bytes, over the store's %d",
                response["id"],
                nbytes,
                self.max_bytes,
            )
            return False
        self.delete(response["id"])
        conversation_bytes = input_bytes + output_bytes
        stored = StoredResponse(response, turn.input_items, conversation_bytes, nbytes)
        self._kept[response["id"]] = stored
        self.nbytes += nbytes
        while len(self._kept) > self.max_responses or self.nbytes > self.max_bytes:
            _, evicted = self._kept.popitem(last=False)
            self.nbytes -= evicted.nbytes
        return True

    def input_items_page(
        self, response_id: str, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: OpenAI's list object, newest first by default;
        `after` is the id of the item the page starts past."""
        stored = self.get(response_id)
        if stored is None:
            raise ResponseNotFound(response_id, True)
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise BadRequest(f"after: no input item with id '{after}'.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


def new_store(config: ServerConfig) -> ResponseStore | None:
    """The server's store, None when --responses-store is 0."""
    if config.responses_store == 0:
        return None
    logger.info(
        "responses store: up to %d responses and %d MiB in the server process's memory (LRU)",
        config.responses_store,
        MAX_STORE_BYTES >> 20,
    )
    return ResponseStore(config.responses_store)
