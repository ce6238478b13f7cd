"""/v1/responses (OpenAI's Responses API, the subset vLLM serves for chat models) on the handler
skeleton: the request becomes the chat route's request (responses_request.py) and goes through the
chat endpoint's checks, prompt, structured outputs, sampling and parsers; only the answer is worded
otherwise (a `serving.Reply`): one Response object, or its typed events (responses_output.py).
With --responses-store, a request continues a kept response and its own is kept
(responses_store.py).

Called by app.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from appliance.messages import TextDelta
from appliance.server.errors import APIError
from appliance.server.responses_output import Event, ResponseRun, response_shell
from appliance.server.responses_request import ResponsesRequest, chat_request
from appliance.server.responses_store import ResponseStore, Turn
from appliance.server.serving import Answer, serve
from appliance.server.serving_chat import ChatEndpoint, ChatFormatter
from appliance.server.state import ServerState, abort_on_disconnect, iterate_deltas

# the chat request's fields that 400s of the chat path name -> (the Responses field they came
# from, how the message spells the chat field, how it spells the Responses one)
_RENAMED = {
    "messages": ("input", r"^messages:", "input:"),
    "response_format": ("text", r"^response_format:", "text.format:"),
    "max_tokens": (
        "max_output_tokens",
        r"'max_tokens' or 'max_completion_tokens'",
        "'max_output_tokens'",
    ),
    "tools": ("tools", r"^tools\.(\d+)\.function\.", r"tools.\1."),
}


class ResponsesEndpoint(ChatEndpoint):
    """The chat endpoint's checks, prompt and parsers under response ids (serving.Endpoint)."""

    id_prefix = "resp"
    object_name = "response"
    chunk_object_name = "response"  # unused: a Responses stream sends events (ResponsesReply)


RESPONSES = ResponsesEndpoint()


def sse_event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def error_event(err: APIError, sequence_number: int) -> Event:
    """OpenAI's `error` event; its `error` object is the chat streams' error body, so the SDKs raise
    it as they raise a chat stream's error."""
    body = err.body()["error"]
    return {
        "type": "error",
        "code": body["code"],
        "message": body["message"],
        "param": body["param"],
        "sequence_number": sequence_number,
        "error": body,
    }


class ResponsesReply:
    """Words the one choice of a Responses request (serving.Reply); holds the request for the
    Response's echoed fields and, when it is to be kept, the store and the request's turn."""

    def __init__(
        self, body: ResponsesRequest, store: ResponseStore | None = None, turn: Turn | None = None
    ) -> None:
        self.body = body
        self.store = store
        self.turn = turn

    async def collect(self, state: ServerState, request: Request, answer: Answer) -> dict[str, Any]:
        run = self._run(state, request, answer)
        async for _, delta in iterate_deltas(answer.group):
            _feed(state, answer, run, delta)
        response = run.response()
        self._keep(run, response)
        return response

    async def stream(
        self, state: ServerState, request: Request, answer: Answer, first: tuple[int, TextDelta]
    ) -> AsyncIterator[str]:
        run = self._run(state, request, answer)
        async with abort_on_disconnect(request, state.client, answer.group):
            try:
                for event in run.opening():
                    yield sse_event(event)
                async for _, delta in iterate_deltas(answer.group, first):
                    for event in _feed(state, answer, run, delta):
                        yield sse_event(event)
                closing = run.closing()
                # kept before the last event is sent: a client that continues the response as soon
                # as it reads response.completed finds it
                self._keep(run, closing[-1]["response"])
                for event in closing:
                    yield sse_event(event)
            except APIError as err:
                yield sse_event(error_event(err, run.sequence_number))

    def _run(self, state: ServerState, request: Request, answer: Answer) -> ResponseRun:
        head = answer.head
        response_id = head["id"].replace("-", "_", 1)  # OpenAI's spelling: resp_<hex>
        request.state.completion_id = response_id  # the access log names the id the client sees
        shell = response_shell(
            self.body,
            response_id,
            head["created"],
            head["model"],
            state.sampling_defaults,
            stored=self.store is not None,
        )
        formatter = answer.formatter
        assert isinstance(formatter, ChatFormatter)  # RESPONSES.formatter's
        return ResponseRun(
            shell,
            formatter.parsers[0],
            answer.num_prompt_tokens,
            formatter.think_end,
            state.metrics_report,
        )

    def _keep(self, run: ResponseRun, response: dict[str, Any]) -> None:
        """Keeps a response that ended (completed, or incomplete: OpenAI keeps those too); not one
        that failed or whose client left (its deltas stopped before the last)."""
        if self.store is None or self.turn is None or run.finish_reason not in ("stop", "length"):
            return
        self.store.keep(response, self.turn)


def _feed(state: ServerState, answer: Answer, run: ResponseRun, delta: TextDelta) -> list[Event]:
    """The delta's events; at the end, the metrics' finish reason of the choice, as the chat
    route labels it ("tool_calls" where it made calls)."""
    events = run.feed(delta)
    if delta.finish_reason is not None:
        reason = run.parser.finish_reason(delta.finish_reason)
        state.client.label_finish(answer.group, 0, reason)
    return events


def renamed(err: APIError) -> APIError:
    """A 400 of the chat path, naming the Responses field the client sent."""
    if err.param in _RENAMED:
        param, said, spelled = _RENAMED[err.param]
        err.param = param
        err.message = re.sub(said, spelled, err.message, count=1)
    return err


async def serve_responses(
    state: ServerState, store: ResponseStore | None, body: ResponsesRequest, request: Request
) -> Response:
    """POST /v1/responses end to end (serving.serve with the chat endpoint's pieces). With the
    store on, a previous_response_id's conversation comes before the request's input, and the
    response is kept when the request asks to `store` it."""
    try:
        chat_body, reply = body, ResponsesReply(body)
        if store is not None and (body.store or body.previous_response_id is not None):
            turn = store.turn(body)  # OpenAI's 400 for a previous response not kept
            if body.previous_response_id is not None:
                update = {"input": turn.input_items, "previous_response_id": None}
                chat_body = body.model_copy(update=update)
            reply = ResponsesReply(body, store if body.store else None, turn)
        return await serve(RESPONSES, state, chat_request(chat_body), request, reply)
    except APIError as err:
        raise renamed(err) from None
