"""A response's output items, its stream events and the Response object, built from one choice's
parsed text (serving_chat.ChoiceParser: reasoning, content and tool-call deltas).

Used by serving_responses.py for both answers: the JSON body is the Response the stream's last
event carries, built by the same calls from the same deltas (only the events go unsent).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from appliance.messages import TextDelta
from appliance.parsers.reasoning import reasoning_token_count
from appliance.server.request_metrics import ChoiceMetrics, MetricsReport
from appliance.server.responses_request import ResponsesRequest, flat_tools
from appliance.server.serving_chat import ChoiceParser

Event = dict[str, Any]  # one stream event: {"type": "response....", "sequence_number", ...}

# item type -> (its delta event, its done event)
_GROWTH = {
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
    "message": ("response.output_text.delta", "response.output_text.done"),
    "function_call": (
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ),
}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response as its text arrives, and the events that tell a stream how
    they grow (unnumbered: ResponseRun numbers them). One item is open at a time: text of another
    kind closes it (reasoning, then a message, then function calls, as a model writes them)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # in output order; the last one may be open
        self.events: list[Event] = []  # not yet taken
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []  # the open item's text (or arguments) so far

    def reasoning(self, text: str) -> None:
        if text and not self.is_open("reasoning"):
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": []}
            self._start(item, {"type": "reasoning_text", "text": ""})
        self._grow(text)

    def text(self, text: str) -> None:
        if text and not self.is_open("message"):
            item = {"type": "message", "id": item_id("msg"), "role": "assistant", "content": []}
            self._start(
                item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            )
        self._grow(text)

    def call(self, fragment: dict[str, Any]) -> None:
        """One fragment of a chat `tool_calls` delta: the first names the call (id and name)."""
        function = fragment["function"]
        if fragment.get("id") is not None:
            item = {
                "type": "function_call",
                "id": item_id("fc"),
                "call_id": fragment["id"],
                "name": function["name"],
                "arguments": "",
            }
            self._start(item, None)
        assert self.is_open("function_call"), "a call's arguments before its name"
        self._grow(function.get("arguments") or "")

    def close(self, status: str) -> None:
        """Ends the open item (if any) with `status`: "completed", or "incomplete" (cut short)."""
        item, self._open = self._open, None
        if item is None:
            return
        whole, self._pieces = "".join(self._pieces), []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        done = _GROWTH[item["type"]][1]
        if item["type"] == "function_call":
            item["arguments"] = whole
            self._emit(done, **where, arguments=whole)
        else:
            part = item["content"][0]
            part["text"] = whole
            logprobs = {"logprobs": []} if item["type"] == "message" else {}
            self._emit(done, **where, content_index=0, text=whole, **logprobs)
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        self.close("completed")
        item["status"] = "in_progress"
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=item)
        if part is not None:
            item["content"].append(part)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self._emit("response.content_part.added", **where, part=part)

    def _grow(self, text: str) -> None:
        item = self._open
        if not text or item is None:
            return
        self._pieces.append(text)
        fields: dict[str, Any] = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] != "function_call":
            fields["content_index"] = 0
        if item["type"] == "message":
            fields["logprobs"] = []
        self._emit(_GROWTH[item["type"]][0], **fields, delta=text)

    def _emit(self, kind: str, **fields: Any) -> None:
        # a copy: the items go on changing after the event that shows them
        self.events.append({"type": kind, **copy.deepcopy(fields)})


class ResponseRun:
    """One response on its way: the choice's deltas through its parser into OutputItems, the token
    counts, the events numbered in order and the Response object at any point."""

    def __init__(
        self,
        shell: dict[str, Any],
        parser: ChoiceParser,
        prompt_tokens: int,
        think_end: int | None,
        report: MetricsReport | None = None,  # vLLM's per-request `metrics` (request_metrics.py)
    ) -> None:
        self.shell = shell  # the Response's other fields (response_shell)
        self.report = report
        self.tally = ChoiceMetrics()
        self.parser = parser
        self.output = OutputItems()
        self.prompt_tokens = prompt_tokens
        self.think_end = think_end  # the `</think>` token id: where reasoning tokens stop
        self.output_ids: list[int] = []
        self.num_output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.sequence_number = 0  # of the next event

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def opening(self) -> list[Event]:
        created = self.response()
        return self._numbered(
            [
                {"type": "response.created", "response": created},
                {"type": "response.in_progress", "response": created},
            ]
        )

    def feed(self, delta: TextDelta) -> list[Event]:
        self.tally.feed(delta)
        self.output_ids += delta.token_ids
        self.num_output_tokens = delta.num_output_tokens
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        final = delta.finish_reason is not None
        reasoning, text, calls = self.parser.feed(delta.text, final)
        self.output.reasoning(reasoning)
        self.output.text(text)
        for fragment in calls:
            self.output.call(fragment)
        if final:
            self.finish_reason = delta.finish_reason
            self.output.close(self._last_item_status())
        return self._numbered(self.output.take_events())

    def _last_item_status(self) -> str:
        """The open item's status at the end: "incomplete" only where the length limit cut it, so
        not reasoning that ended (`</think>`) before the limit came."""
        ended = self.output.is_open("reasoning") and self.think_end in self.output_ids
        return "completed" if ended else self.status

    def closing(self) -> list[Event]:
        """The last event: response.completed or response.incomplete, with the whole response."""
        return self._numbered([{"type": f"response.{self.status}", "response": self.response()}])

    def response(self) -> dict[str, Any]:
        status = self.status
        body = {**self.shell, "status": status, "output": copy.deepcopy(self.output.items)}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status != "in_progress":
            body["usage"] = self.usage()
            if self.report is not None:
                body.update(self.report.field([self.tally]))
        return body

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            # nothing is billed for writing the prefix cache: cache_write_tokens (which the SDK
            # requires) is 0
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
            "total_tokens": self.prompt_tokens + self.num_output_tokens,
        }

    def reasoning_tokens(self) -> int:
        has_reasoning = any(item["type"] == "reasoning" for item in self.output.items)
        return reasoning_token_count(self.output_ids, self.think_end, has_reasoning)

    def _numbered(self, events: list[Event]) -> list[Event]:
        for event in events:
            event["sequence_number"] = self.sequence_number
            self.sequence_number += 1
        return events


def response_shell(
    body: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    sampling_defaults: dict[str, Any],
    stored: bool = False,
) -> dict[str, Any]:
    """A Response's fields that echo the request (as OpenAI echoes them), around the placeholders
    ResponseRun.response fills: status, output, usage. Unset temperature and top_p echo the values
    sampling used (the model's generation_config.json, else OpenAI's 1.0). `stored`: the response
    is kept once it ends (its request's `store` with --responses-store on)."""
    reasoning = body.reasoning
    text_format = body.text.format if body.text is not None else None  # checked by chat_request
    verbosity = {"verbosity": body.text.verbosity} if body.text and body.text.verbosity else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": stored,
        "temperature": _echo(body.temperature, sampling_defaults.get("temperature", 1.0)),
        "text": {"format": text_format or {"type": "text"}, **verbosity},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": flat_tools(body.tools),
        "top_p": _echo(body.top_p, sampling_defaults.get("top_p", 1.0)),
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
    }


def _echo(value: float | None, default: float) -> float:
    return value if value is not None else default
