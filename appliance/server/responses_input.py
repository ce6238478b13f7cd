"""The `input` of a /v1/responses request as chat messages: messages (easy or `type: message`),
earlier output items (reasoning, message, function_call) and function_call_output items.

Called by responses_request.chat_request. An assistant turn's items (reasoning, then text, then
calls: the order a model writes them) become one assistant message, as the chat template renders a
turn; a client that sends `response.output` back in `input` gets the same prompt as a chat client
that sends the assistant message back.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from appliance.server.errors import BadRequest
from appliance.server.protocol import ChatMessage

ROLES = ("user", "system", "developer", "assistant")
# content part types per role; input_image only where an image can be (a user's message)
PARTS = {
    "user": ("input_text", "input_image"),
    "system": ("input_text",),
    "developer": ("input_text",),
    "assistant": ("output_text", "input_text"),
}
ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _fail(where: str, problem: str) -> BadRequest:
    return BadRequest(f"{where}: {problem}", "input")


def _string(item: Any, key: str, where: str) -> str:
    """item[key], a string; `item` may be anything a client sent (a part of a list, ...)."""
    if not isinstance(item, dict):
        raise _fail(where, f"expected an object with {key!r}, got {type(item).__name__}.")
    value = item.get(key)
    if not isinstance(value, str):
        raise _fail(f"{where}.{key}", f"expected a string, got {type(value).__name__}.")
    return value


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]] | str:
    """A message's content, checked against its role's part types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where}.content", "expected a string or a list of content parts.")
    allowed = PARTS[role]
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise _fail(
                f"{where}.content.{index}",
                f"part type {kind!r} is not supported in a {role} message ({', '.join(allowed)}).",
            )
        if kind != "input_image":
            _string(part, "text", f"{where}.content.{index}")
        elif part.get("image_url") is None:
            raise _fail(
                f"{where}.content.{index}",
                "an input_image needs image_url (a URL or a data URL); file_id is not "
                "supported (this server stores no files).",
            )
        elif not isinstance(part["image_url"], str):
            raise _fail(
                f"{where}.content.{index}.image_url",
                f"expected a URL or a data URL string, got {type(part['image_url']).__name__}.",
            )
        elif part.get("detail") not in (None, "auto", "low", "high"):  # named where it was sent
            raise _fail(
                f"{where}.content.{index}.detail",
                f"expected 'auto', 'low' or 'high', got {part['detail']!r:.40}.",
            )
    return content


def _text(parts: list[dict[str, Any]] | str, where: str) -> str:
    """The text of assistant output (output_text / input_text parts)."""
    if isinstance(parts, str):
        return parts
    return "".join(_string(part, "text", f"{where}.content.{i}") for i, part in enumerate(parts))


class _Turn:
    """One assistant turn being gathered from consecutive output items."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def message(self) -> ChatMessage:
        return ChatMessage(
            role="assistant",
            content="".join(self.text),
            reasoning_content="\n".join(self.reasoning) or None,
            tool_calls=self.calls or None,
        )


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    role = item.get("role")
    if role not in ROLES:
        raise _fail(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r:.40}.")
    content = _parts(item.get("content"), role, where)
    try:
        return ChatMessage.model_validate({"role": role, "content": content})
    except ValidationError as exc:  # a union fails once per member: the deepest is the one meant
        error = max(exc.errors(), key=lambda e: len(e["loc"]))
        path = ".".join(str(p) for p in error["loc"] if "[" not in str(p) and p != "str")
        raise _fail(f"{where}.{path}", f"{error['msg']}.") from None


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    key = "content" if item.get("content") else "summary"
    parts = item.get(key) or []
    if not isinstance(parts, list):
        raise _fail(f"{where}.{key}", "expected a list of reasoning_text parts.")
    return "".join(_string(part, "text", f"{where}.{key}.{i}") for i, part in enumerate(parts))


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    function = {
        "name": _string(item, "name", where),
        "arguments": _string(item, "arguments", where),
    }
    return {"id": _string(item, "call_id", where), "type": "function", "function": function}


def _call_output(item: dict[str, Any], where: str) -> ChatMessage:
    output = item.get("output")
    if isinstance(output, list):  # input_text parts
        output = "".join(_string(p, "text", f"{where}.output.{i}") for i, p in enumerate(output))
    if not isinstance(output, str):
        raise _fail(f"{where}.output", "expected a string or a list of input_text parts.")
    return ChatMessage(role="tool", content=output, tool_call_id=_string(item, "call_id", where))


def chat_messages(
    input_: str | list[dict[str, Any]], instructions: str | None
) -> list[ChatMessage]:
    """The conversation the chat template renders: instructions as a leading system message."""
    messages = [] if instructions is None else [ChatMessage(role="system", content=instructions)]
    if isinstance(input_, str):
        return [*messages, ChatMessage(role="user", content=input_)]
    turn: _Turn | None = None
    for index, item in enumerate(input_):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind not in ITEMS:
            raise _fail(
                f"{where}.type", f"item type {kind!r:.40} is not supported ({', '.join(ITEMS)})."
            )
        spoken = kind == "message" and item.get("role") == "assistant"
        assistant = spoken or kind in ("function_call", "reasoning")
        # a turn is reasoning, then text, then calls: what comes out of that order starts another
        starts_turn = turn is not None and (
            (kind == "reasoning" and (turn.reasoning or turn.text or turn.calls))
            or (kind == "message" and (turn.text or turn.calls))
        )
        if turn is not None and (not assistant or starts_turn):
            messages.append(turn.message())
            turn = None
        if not assistant:
            is_output = kind == "function_call_output"
            messages.append(_call_output(item, where) if is_output else _message(item, where))
            continue
        turn = turn or _Turn()
        if kind == "reasoning":
            turn.reasoning.append(_reasoning_text(item, where))
        elif kind == "function_call":
            turn.calls.append(_call(item, where))
        else:
            turn.text.append(_text(_parts(item.get("content"), "assistant", where), where))
    if turn is not None:
        messages.append(turn.message())
    if not messages:
        raise BadRequest("input: expected at least one item.", "input")
    return messages
