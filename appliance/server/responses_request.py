"""/v1/responses requests: the schema (vLLM's subset of OpenAI's Responses API) and its translation
into the chat route's request, so that a response is rendered, guided, sampled and parsed exactly as
/v1/chat/completions does it.

Used by app.py (the route's body) and serving_responses.py (`chat_request`). The `input` items
become chat messages in responses_input.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from appliance.server.errors import BadRequest
from appliance.server.protocol import (
    ChatCompletionRequest,
    _SamplingFields,
    _Schema,
    check_unsupported,
)
from appliance.server.responses_input import chat_messages

# reasoning.effort -> the chat template's enable_thinking (Qwen's thinking is on or off)
THINKING_OFF = ("none", "minimal")
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# OpenAI's fields this server does not do: a 400 naming the field when one is set
REFUSED = {
    # with --responses-store the stored conversation replaces it first (serving_responses.py)
    "previous_response_id": "not supported: this server stores no responses (start it with "
    "--responses-store N to keep them); send the whole conversation (earlier output items "
    "included) in `input`",
    "conversation": "not supported: this server stores no conversations; send the whole "
    "conversation in `input`",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported; send the text in `input`",
    "max_tool_calls": "not supported",
    "use_beam_search": "beam search is served by /v1/chat/completions and /v1/completions",
    "top_logprobs": "logprobs are not supported on /v1/responses; /v1/chat/completions has them",
    "prompt_logprobs": "not supported on /v1/responses; /v1/chat/completions has them",
    "response_format": "the Responses API takes the output format as `text.format`",
}


class Reasoning(_Schema):
    effort: Effort | None = None  # none / minimal: thinking off; low and up: thinking on
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summaries here
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class TextConfig(_Schema):
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", ...}
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses. The sampling fields (and vLLM's extras: top_k, repetition_penalty,
    stop, guided_*, ...) are the chat route's, with its rules; `n` must stay 1."""

    input: str | list[dict[str, Any]]  # a user message, or items (responses_input.py)
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | a function
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None  # echoed in the response
    store: bool = True  # kept for previous_response_id and GET with --responses-store, else not
    include: list[str] | None = None  # accepted and ignored (no encrypted reasoning, no logprobs)
    truncation: Literal["auto", "disabled"] | None = None  # "auto" refused: input is never cut
    previous_response_id: str | None = None  # refused without --responses-store (REFUSED)
    # refused when set (REFUSED)
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def check_refused(body: ResponsesRequest) -> None:
    check_unsupported(body, REFUSED)
    if body.n != 1:
        raise BadRequest("n: a response has one output; ask /v1/chat/completions for n > 1.", "n")
    if body.truncation == "auto":
        raise BadRequest(
            "truncation: 'auto' is not supported (the input is never cut); use 'disabled'.",
            "truncation",
        )


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: name, description, parameters, strict at the top) in the
    chat form the template, the tool parser and the tool grammar read; any other tool type is a
    400 naming it (built-in tools such as web_search run at OpenAI, not here)."""
    if tools is None:
        return None
    others = [str(t.get("type")) for t in tools if t.get("type") != "function"]
    if others:
        kinds = ", ".join(repr(kind) for kind in dict.fromkeys(others))
        raise BadRequest(
            f"tools: tool type {kinds} is not supported; only 'function' tools are.", "tools"
        )
    out = []
    for tool in tools:
        if isinstance(tool.get("function"), dict):  # the chat form, as sent to chat routes
            out.append(tool)
            continue
        keys = ("name", "description", "parameters", "strict")
        function = {key: tool[key] for key in keys if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as a Response echoes them: function tools in the flat form (a tool sent in the
    chat form, which chat_tools also takes, is flattened)."""
    out = []
    for tool in tools or []:
        function = tool.get("function")
        if isinstance(function, dict):
            tool = {"type": "function", **function}
        out.append({"parameters": None, "strict": None, **tool})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """{"type": "function", "name"} in the chat form; the strings are the chat route's."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            message = "tool_choice: a function choice needs 'name', a string."
            raise BadRequest(message, "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(
        "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; "
        f"{choice.get('type')!r} choices are not supported.",
        "tool_choice",
    )


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format as the chat route's response_format (its structured outputs)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise BadRequest(
            f"text.format: type {kind!r} is not one of 'text', 'json_object', 'json_schema'.",
            "text",
        )
    if not isinstance(fmt.get("name"), str) or "schema" not in fmt:
        raise BadRequest("text.format: json_schema needs 'name' and 'schema'.", "text")
    keys = ("name", "schema", "description", "strict")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def template_switches(reasoning: Reasoning | None) -> dict[str, Any] | None:
    """reasoning.effort as the chat route's chat_template_kwargs: none / minimal render the prompt
    with thinking off, low and up with it on; unset leaves the template's default."""
    if reasoning is None or reasoning.effort is None:
        return None
    return {"enable_thinking": reasoning.effort not in THINKING_OFF}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that produces this response: one choice, the same sampling fields."""
    check_refused(body)
    sampling = {name: getattr(body, name) for name in _SamplingFields.model_fields}
    return ChatCompletionRequest.model_validate(
        {
            **sampling,
            "messages": chat_messages(body.input, body.instructions),
            "max_completion_tokens": body.max_output_tokens,
            "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body.text),
            "chat_template_kwargs": template_switches(body.reasoning),
        }
    )
