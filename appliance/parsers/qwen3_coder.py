r"""Qwen3-coder XML tool-call parser: model text deltas in, content and OpenAI tool-call deltas out.

The chat endpoint makes one `ToolCallParser` per choice and feeds it the content that comes out of
the reasoning parser; `parse_tool_calls()` is the whole-response view. Format parsed:
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`.

Stream contract. Each call's streamed `arguments`, concatenated, are at every moment a prefix of the
final `arguments`, which is exactly `json.dumps(final_arguments_dict)` with Python's defaults
(separators ", " and ": ", ensure_ascii=True, keys in the order the model wrote them):
- the first delta of a call carries id, name and `{`; a string value streams as it arrives, escaped
  per character and never with a partial escape; a value that could still turn out to be `null`
  (or `None`: schema.null_spellings), a trailing newline that may belong to the closer and a
  partial closing tag are held back (a partial tag that ends the output, where max_tokens cut the
  call short, is dropped);
- non-string values are emitted whole once their parameter closes; the last value's tail (closing
  quote or whole value) is held until the function closes, so `}` comes in the same delta;
- `</parameter>`, `</function>` and `</tool_call>` may be missing: the next `<parameter=`,
  `</function>`, `<function=`, `</tool_call>` or `finish()` closes what is open;
- a value may hold those tags as its own text (code, XML): inside a value `</parameter>` and
  `</function>` close only where a tag that may come next (or the end) follows them, and
  `<parameter=` / `<function=` only at the start of a line; a closer is held until that is decided;
- a function name not in `tools` (or not the named `tool_choice`, or a second call when
  `parallel_tool_calls` is false) is dropped with a warning: it gets no index and no content, and
  the calls after it are parsed normally (SGLang's behaviour; clients only see callable tools);
- a repeated parameter name keeps its first value (the later one is dropped), so the streamed JSON
  never has duplicate keys;
- text outside `<tool_call>` blocks is content, verbatim, except whitespace that touches a block
  (before it, or ending the output after one), which is dropped; text inside a block but outside
  the tags is dropped; a partial tag at a chunk edge is held until it is decided;
- a block with no `<function=` in it is held until it ends: a Hermes-style call in it (Qwen3's
  `{"name": ..., "arguments": {...}}`) is a call, emitted whole; anything else is content, as
  written (`<tool_call>` and all), so nothing the model wrote is lost.
Input is text: the detokenizer must hold back incomplete UTF-8 so a character never changes later.
"""

from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass, field
from typing import Any

from appliance.logging import get_logger
from appliance.parsers.schema import (
    convert_value,
    null_spellings,
    schema_types,
    streams_as_string,
    tool_name,
    tool_parameter_schemas,
)

logger = get_logger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"
_BLOCK_TAGS = (FUNCTION_START, TOOL_CALL_END, TOOL_CALL_START)
_BODY_TAGS = (PARAM_START, FUNCTION_END, FUNCTION_START, TOOL_CALL_END, TOOL_CALL_START)
_VALUE_ENDS = (PARAM_END, PARAM_START, FUNCTION_END, FUNCTION_START, TOOL_CALL_END)
_TEXT, _BLOCK, _BODY, _VALUE = "text", "block", "body", "value"  # parser states


class ParserFinishedError(RuntimeError):
    """feed() or finish() was called on a parser that has already finished."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One call's fragment in one delta; `id` and `name` only on the call's first fragment."""

    index: int  # position among this choice's emitted calls, from 0
    id: str | None
    name: str | None
    arguments: str  # append to the previous fragments of the same index

    def to_openai(self) -> dict[str, Any]:
        """The `delta.tool_calls[]` entry of a chat.completion.chunk."""
        function: dict[str, Any] = {"arguments": self.arguments}
        entry: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            entry.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        entry["function"] = function
        return entry


@dataclass
class ParsedDelta:
    """What one feed()/finish() produced: content text and at most one fragment per call index."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedMessage:
    """Whole-response view: `content` is None when empty; `tool_calls` in OpenAI message form."""

    content: str | None
    tool_calls: list[dict[str, Any]]

    @property
    def finish_reason_tool_calls(self) -> bool:
        """True when the choice's finish_reason must be "tool_calls"."""
        return bool(self.tool_calls)


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (all of
    which start with '<'): the part of a chunk to hold back until the next one decides it."""
    start = text.find("<", max(0, len(text) - max(len(t) for t in tags) + 1))
    while start >= 0:
        tail = text[start:]
        if any(len(t) > len(tail) and t.startswith(tail) for t in tags):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


def _escape(text: str) -> str:
    """JSON string-body escape, per character, identical to what json.dumps writes."""
    return json.dumps(text)[1:-1]


@dataclass
class _Call:
    index: int
    id: str
    name: str
    param_schemas: dict[str, Any]
    fragments: list[str] = field(default_factory=list)  # the arguments streamed so far
    values: dict[str, Any] = field(default_factory=dict)  # converted values, in order
    tail: str = ""  # the last parameter's closing bytes, held until the next key or `}`


@dataclass
class _Param:
    name: str
    types: frozenset[str]
    emit: bool  # False for parameters of a dropped call and repeated names
    started: bool = False  # first value character seen (the leading-newline decision is made)
    opened: bool = False  # opening quote emitted (string values only)
    sent: list[str] = field(default_factory=list)  # value text already streamed
    unsent: list[str] = field(default_factory=list)  # value text not streamed yet
    last_sent: str = ""  # the last non-empty piece of `sent`


class ToolCallParser:
    """Incremental Qwen3-coder tool-call parser for one choice of one request."""

    def __init__(
        self,
        tools: list[dict] | None,
        tool_choice: str | dict | None = "auto",
        parallel_tool_calls: bool = True,
        seed: int | None = None,
    ) -> None:
        """`tools`: the request's OpenAI tool entries. `tool_choice`: "auto" | "required" | "none" |
        {"type": "function", "function": {"name": …}}; "none" or no tools makes the parser a
        pass-through (all text is content). `seed` makes call ids deterministic (give each choice
        its own); otherwise they are random. Ids look like `call_<24 hex digits>`."""
        schemas = {tool_name(t): tool_parameter_schemas(t) for t in tools or [] if tool_name(t)}
        if isinstance(tool_choice, dict):
            named = tool_name(tool_choice)
            schemas = {named: schemas[named]} if named in schemas else {}
        self._schemas: dict[str, dict[str, Any]] = schemas
        self._enabled = bool(tools) and tool_choice != "none"
        self._parallel = parallel_tool_calls
        self._rng = random.Random(seed) if seed is not None else None
        self._state = _TEXT
        self._pending = ""  # input not yet consumed
        self._space = ""  # whitespace held in content until we know whether a block follows
        self._seen_block = False
        self._call: _Call | None = None  # the open call (None inside a dropped one, or none open)
        self._raw: list[str] | None = None  # the open block's text while it has no <function=
        self._param: _Param | None = None
        self._calls: list[_Call] = []
        self._content: list[str] = []
        self._finished = False
        self.ended_in_call = False  # finish() closed a block the text had left open (a cut call)
        self._out: ParsedDelta = ParsedDelta()
        self._out_args: dict[int, list[str]] = {}

    # ---- public API ----
    def feed(self, text_delta: str) -> ParsedDelta:
        """Consume the next text delta; return the content and tool-call fragments it completes."""
        if self._finished:
            raise ParserFinishedError("feed() after finish()")
        if not self._enabled:
            self._content.append(text_delta)
            return ParsedDelta(content=text_delta)
        self._pending += text_delta
        self._run(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of generation: release held text, close whatever is open (implicit closers)."""
        if self._finished:
            raise ParserFinishedError("finish() called twice")
        self._finished = True
        if not self._enabled:
            return ParsedDelta()
        self._run(final=True)
        self.ended_in_call = self._state != _TEXT
        if self._state == _BLOCK and self._raw is not None:  # ended in a block with no function
            self._end_raw_block()
        if self._state == _VALUE:
            self._close_param()
        if self._state in (_VALUE, _BODY):
            self._close_function()
        if not self._seen_block:
            self._emit_content(self._space)
        self._space = ""
        return self._take()

    def result(self) -> ParsedMessage:
        """Everything parsed so far, as a non-streaming message (finishes the parser if needed)."""
        if not self._finished:
            self.finish()
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": "".join(c.fragments)},
            }
            for c in self._calls
        ]
        return ParsedMessage(content="".join(self._content) or None, tool_calls=calls)

    @property
    def has_tool_calls(self) -> bool:
        """True once a call has been emitted: the choice's finish_reason is then "tool_calls"."""
        return bool(self._calls)

    # ---- output ----
    def _take(self) -> ParsedDelta:
        out = self._out
        for delta_index, call_delta in enumerate(out.tool_calls):
            pieces = self._out_args[call_delta.index]
            out.tool_calls[delta_index] = ToolCallDelta(
                call_delta.index, call_delta.id, call_delta.name, "".join(pieces)
            )
        self._out, self._out_args = ParsedDelta(), {}
        return out

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.content += text
            self._content.append(text)

    def _emit_args(self, call: _Call, text: str) -> None:
        if not text:
            return
        if call.index not in self._out_args:
            self._out_args[call.index] = []
            self._out.tool_calls.append(ToolCallDelta(call.index, None, None, ""))
        call.fragments.append(text)
        self._out_args[call.index].append(text)

    # ---- state machine ----
    def _run(self, final: bool) -> None:
        step = {
            _TEXT: self._step_text,
            _BLOCK: self._step_block,
            _BODY: self._step_body,
            _VALUE: self._step_value,
        }
        while step[self._state](final):
            pass

    def _step_text(self, final: bool) -> bool:
        if "<" not in self._pending:  # fast path: most content chunks hold no tag
            self._content_text(self._pending, block_follows=False)
            self._pending = ""
            return False
        at = self._pending.find(TOOL_CALL_START)
        if at >= 0:
            before = self._space + self._pending[:at]
            self._raw = [before[len(before.rstrip()) :], TOOL_CALL_START]  # whitespace, tag
            self._content_text(self._pending[:at], block_follows=True)
            self._pending = self._pending[at + len(TOOL_CALL_START) :]
            self._state, self._seen_block = _BLOCK, True
            return True
        keep = 0 if final else _held_suffix(self._pending, (TOOL_CALL_START,))
        self._content_text(self._pending[: len(self._pending) - keep], block_follows=False)
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _content_text(self, text: str, block_follows: bool) -> None:
        text = self._space + text
        body = text.rstrip()
        self._space = "" if block_follows else text[len(body) :]
        self._emit_content(body)

    def _next_tag(
        self, tags: tuple[str, ...], final: bool, dropped: list[str] | None = None
    ) -> str | None:
        """Drop text up to the next '<' (into `dropped`, if given); return the tag it starts, ''
        for no tag, None to wait."""
        at = self._pending.find("<")
        if dropped is not None:
            dropped.append(self._pending[:at] if at >= 0 else self._pending)
        self._pending = self._pending[at:] if at >= 0 else ""
        if not self._pending:
            return None
        for tag in tags:
            if self._pending.startswith(tag):
                return tag
        if not final and any(t.startswith(self._pending) for t in tags):
            return None
        self._pending = self._pending[1:]  # a '<' that starts no tag: junk between tags
        if dropped is not None:
            dropped.append("<")
        return ""

    def _header(self, tag: str, final: bool) -> str | None:
        """The name in `<function=NAME>` / `<parameter=NAME>` at the front of the input, consumed;
        None while the '>' has not arrived (at the end of the output the header is dropped)."""
        end = self._pending.find(">")
        if end < 0:
            if final:
                self._pending = ""
            return None
        name = self._pending[len(tag) : end].strip()
        self._pending = self._pending[end + 1 :]
        return name

    def _step_block(self, final: bool) -> bool:
        tag = self._next_tag(_BLOCK_TAGS, final, self._raw)
        if tag == FUNCTION_START:
            self._raw = None  # a call, even one cut short in its header
            name = self._header(tag, final)
            if name is None:
                return False
            self._open_function(name)
            self._state = _BODY
        elif tag == TOOL_CALL_END:
            self._pending = self._pending[len(tag) :]
            self._state = _TEXT
            if self._raw is not None:
                self._raw.append(tag)
                self._end_raw_block()
        elif tag == TOOL_CALL_START:  # a repeated opener: nothing to do
            self._pending = self._pending[len(tag) :]
            if self._raw is not None:
                self._raw.append(tag)
        return tag is not None

    def _end_raw_block(self) -> None:
        """A block that opened no `<function=`: a Hermes-style JSON call, or content."""
        text, self._raw = "".join(self._raw), None
        inner = text.strip().removeprefix(TOOL_CALL_START).removesuffix(TOOL_CALL_END).strip()
        call = _hermes_call(inner)
        if call is None:
            self._emit_content(text)
            return
        name, arguments = call
        self._open_function(name)
        if self._call is not None:
            self._emit_args(self._call, json.dumps(arguments)[1:])  # after its "{"
            self._call = None

    def _step_body(self, final: bool) -> bool:
        tag = self._next_tag(_BODY_TAGS, final)
        if tag == PARAM_START:
            name = self._header(tag, final)
            if name is None:
                return False
            self._open_param(name)
            self._state = _VALUE
        elif tag == FUNCTION_END:
            self._pending = self._pending[len(tag) :]
            self._close_function()
        elif tag:  # <function=, </tool_call>, <tool_call>: close implicitly, let the block see it
            self._close_function()
        return tag is not None

    def _step_value(self, final: bool) -> bool:
        if "<" not in self._pending:  # fast path: most chunks of a value hold no tag
            self._value_text(self._pending)
            self._pending = ""
            return False
        search = 0
        while ends := [(at, t) for t in _VALUE_ENDS if (at := self._pending.find(t, search)) >= 0]:
            at, tag = min(ends)
            ends_value = self._ends_value(tag, at, final)
            if ends_value is None:  # the text that decides has not arrived: hold from the tag
                self._value_text(self._pending[:at])
                self._pending = self._pending[at:]
                return False
            if ends_value:
                self._value_text(self._pending[:at])
                skip = len(tag) if tag == PARAM_END else 0
                self._pending = self._pending[at + skip :]
                self._close_param()
                return True
            search = at + len(tag)  # the value's own text (code, XML): keep looking after it
        keep = _held_suffix(self._pending, _VALUE_ENDS)
        self._value_text(self._pending[: len(self._pending) - keep])
        # at the end (max_tokens cut the call short) a partial closing tag is the tag being
        # written, not the value's: dropped
        self._pending = "" if final else self._pending[len(self._pending) - keep :]
        return False

    def _ends_value(self, tag: str, at: int, final: bool) -> bool | None:
        """Whether the tag at `at` in the input closes the open value (None: undecided yet). A
        value may hold the tags as text (a file of code or XML), so a closer counts only where
        the model's layout follows it: `</parameter>` or `</function>` followed (after
        whitespace) by a tag that may come next or by the end of the output; `<parameter=` or
        `<function=` at the value's start or a line's (a missing `</parameter>`);
        `</tool_call>` always."""
        if tag in (PARAM_START, FUNCTION_START):
            before = self._pending[:at] or "".join(self._param.unsent) or self._param.last_sent
            return before[-1:] in ("", "\n")
        if tag == TOOL_CALL_END:
            return True
        follows = _BODY_TAGS if tag == PARAM_END else _BLOCK_TAGS
        after = self._pending[at + len(tag) :].lstrip()
        if any(after.startswith(t) for t in follows):
            return True
        if not after or any(t.startswith(after) for t in follows):
            return True if final else None
        return False

    # ---- calls and parameters ----
    def _new_id(self) -> str:
        digits = f"{self._rng.getrandbits(96):024x}" if self._rng else secrets.token_hex(12)
        return f"call_{digits}"

    def _open_function(self, name: str) -> None:
        if name not in self._schemas:
            logger.warning("model called undefined function %.100r; call dropped", name)
            self._call = None
        elif self._calls and not self._parallel:
            logger.warning("second tool call %r with parallel_tool_calls=false; dropped", name)
            self._call = None
        else:
            call = _Call(len(self._calls), self._new_id(), name, self._schemas[name])
            self._calls.append(call)
            self._out.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, ""))
            self._out_args[call.index] = []
            self._emit_args(call, "{")
            self._call = call

    def _close_function(self) -> None:
        if self._call is not None:
            self._emit_args(self._call, self._call.tail + "}")
        self._call, self._state = None, _BLOCK

    def _open_param(self, name: str) -> None:
        call = self._call
        emit = call is not None and name not in call.values
        self._param = _Param(
            name,
            schema_types(call.param_schemas.get(name)) if call else frozenset({"string"}),
            emit,
        )
        if not emit:
            if call is not None:
                logger.warning(
                    "repeated parameter %r in call to %r; later value dropped", name, call.name
                )
            return
        call.values[name] = None  # reserves the key's position
        separator = ", " if len(call.values) > 1 else ""
        self._emit_args(call, call.tail + separator + json.dumps(name) + ": ")
        call.tail = ""

    def _value_text(self, text: str) -> None:
        param = self._param
        if not text:
            return
        if not param.started:
            param.started = True
            text = text[1:] if text.startswith("\n") else text
        param.unsent.append(text)
        if not (param.emit and streams_as_string(param.types)):
            return
        unsent = "".join(param.unsent)  # short: a held newline or a few held characters + text
        # a trailing newline may be Qwen's newline before the closer; hold it
        ready = unsent[:-1] if unsent.endswith("\n") else unsent
        if not param.opened:
            if len(ready) <= 4 and any(
                null.startswith(ready.lower()) for null in null_spellings(param.types)
            ):
                return  # could still be the JSON null
            param.opened = True
            self._emit_args(self._call, '"')
        self._emit_args(self._call, _escape(ready))
        param.sent.append(ready)
        param.last_sent = ready or param.last_sent
        param.unsent = [unsent[len(ready) :]]

    def _close_param(self) -> None:
        param, call = self._param, self._call
        self._param, self._state = None, _BODY
        if not param.emit:
            return
        rest = "".join(param.unsent)
        rest = rest[:-1] if rest.endswith("\n") else rest  # Qwen's newline before the closer
        if param.opened:  # a streamed string: only its rest and the quote are left
            call.values[param.name] = "".join(param.sent) + rest
            call.tail = _escape(rest) + '"'
        else:
            value = convert_value(rest, param.types)
            call.values[param.name] = value
            call.tail = json.dumps(value)


def _hermes_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of `{"name": ..., "arguments": {...}}` (or "parameters", or arguments
    as JSON text), the JSON call format of Qwen3 and Hermes; None for anything else."""

    def strict(raw: str) -> Any:  # JSON only: NaN / Infinity would make the arguments invalid
        return json.loads(raw, parse_constant=lambda constant: float("x" + constant))

    try:
        value = strict(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = strict(arguments)
        except (ValueError, RecursionError):
            return None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(
    text: str,
    tools: list[dict] | None,
    tool_choice: str | dict | None = "auto",
    parallel_tool_calls: bool = True,
    seed: int | None = None,
) -> ParsedMessage:
    """Whole-response parse: the same result as streaming `text` through a ToolCallParser."""
    parser = ToolCallParser(tools, tool_choice, parallel_tool_calls, seed)
    parser.feed(text)
    return parser.result()
