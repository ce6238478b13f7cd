"""The chat route's own 400s, by OpenAI's rules: tool messages name their call, tools are
well-formed functions whose `parameters` are a JSON Schema object, tool_choice fits the tools; and
a request's own chat template only where the server trusts them (vLLM's rule).

Called by serving_chat.ChatEndpoint.check before anything is tokenized.
"""

from __future__ import annotations

import re
from typing import Any

from appliance.config import TEMPLATE_SWITCHES
from appliance.parsers.schema import tool_name
from appliance.server.errors import BadRequest
from appliance.server.protocol import ChatCompletionRequest, ChatMessage

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
PARAMETER_NAME = re.compile(r"^[^<>\r\n]+$")  # what `<parameter=KEY>` can carry
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "additionalProperties",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
)
SWITCHES = TEMPLATE_SWITCHES  # template switches: booleans only
_NUMBERS = ("minimum", "maximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def template_kwargs(
    body: ChatCompletionRequest, trusted: bool, defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The keyword arguments the chat template renders with: chat_template_kwargs over the
    server's `defaults` (--default-chat-template-kwargs), and a request's own template
    (`chat_template`, or the same key inside chat_template_kwargs) only where the server was
    started with --trust-request-chat-template: a template is code the server runs."""
    kwargs = {**(defaults or {}), **(body.chat_template_kwargs or {})}
    for switch in SWITCHES:
        if switch in kwargs and not isinstance(kwargs[switch], bool):
            # the template tests `enable_thinking is false`: "false" or 0 would think anyway
            raise BadRequest(
                f"chat_template_kwargs.{switch}: expected true or false, got {kwargs[switch]!r}.",
                "chat_template_kwargs",
            )
    own = body.chat_template if body.chat_template is not None else kwargs.get("chat_template")
    param = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
    if own is None:
        kwargs.pop("chat_template", None)
        return kwargs
    if not trusted:
        raise BadRequest(
            f"{param}: this server renders only its model's chat template; a request's own "
            "template needs the server started with --trust-request-chat-template.",
            param,
        )
    if not isinstance(own, str):
        raise BadRequest(f"{param}: the chat template must be a string.", param)
    kwargs["chat_template"] = own
    return kwargs


def check_messages(messages: list[ChatMessage]) -> None:
    for index, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise BadRequest(
                f"messages.{index}: a message with role 'tool' needs 'tool_call_id' (the id of "
                "the call it answers).",
                "messages",
            )


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool is {"type": "function", "function": {"name", "description"?, "parameters"?}},
    its name not another tool's, its parameter names writable in the XML call format."""
    seen: set[str] = set()
    for index, tool in enumerate(tools or []):
        where = f"tools.{index}"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(
                f"{where}: expected {{'type': 'function', 'function': {{'name': ...}}}}.", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise BadRequest(
                f"{where}.function.name: expected 1 to 64 letters, digits, '_' or '-', got "
                f"{name!r:.80}.",
                "tools",
            )
        if name in seen:  # a call names its function: two schemas for one name are ambiguous
            raise BadRequest(f"{where}.function.name: {name!r} names another tool too.", "tools")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise BadRequest(f"{where}.function.description: expected a string.", "tools")
        if "parameters" in function:
            problem = parameters_problem(function["parameters"])
            if problem is None:
                properties = function["parameters"].get("properties") or {}
                bad = [key for key in properties if not PARAMETER_NAME.match(key)]
                if bad:  # `<parameter=KEY>` ends at the first '>': the call could not be read
                    problem = f"parameter name {bad[0]!r:.80} has '<', '>' or a line break."
            if problem is not None:
                raise BadRequest(f"Invalid schema for function '{name}': {problem}", "tools")


def parameters_problem(schema: Any) -> str | None:
    """Why `schema` is not a function's parameters (a JSON Schema of type object), or None."""
    if not isinstance(schema, dict):
        return f"expected a JSON Schema object, got {type(schema).__name__}."
    if schema.get("type", "object") != "object":
        return f"schema must be a JSON Schema of 'type: \"object\"', got {schema['type']!r}."
    return schema_problem(schema, "parameters")


def schema_problem(schema: Any, path: str) -> str | None:
    """Why `schema` is not a JSON Schema (the keywords tools use, checked structurally), or None.
    Unknown keywords are allowed, as JSON Schema allows them."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path}: expected a schema (an object or a boolean)."
    problem = _keyword_problem(schema, path)
    if problem is not None:
        return problem
    children: list[tuple[Any, str]] = []
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{path}.{key}: expected an object of schemas."
            children += [(sub, f"{path}.{key}.{name}") for name, sub in schema[key].items()]
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                return f"{path}.{key}: expected a non-empty array of schemas."
            children += [(sub, f"{path}.{key}.{i}") for i, sub in enumerate(schema[key])]
    children += [(schema[key], f"{path}.{key}") for key in _SCHEMA_ONE if key in schema]
    items = schema.get("items", True)
    children += [(sub, f"{path}.items") for sub in (items if isinstance(items, list) else [items])]
    for sub, sub_path in children:
        problem = schema_problem(sub, sub_path)
        if problem is not None:
            return problem
    return None


def _keyword_problem(schema: dict[str, Any], path: str) -> str | None:
    """The value keywords: type names, required, enum, numbers and counts."""
    if "type" in schema:
        kind = schema["type"]
        names = kind if isinstance(kind, list) else [kind]
        if not names or not all(isinstance(n, str) and n in _TYPES for n in names):
            return f"{path}.type: {kind!r:.80} is not one of {', '.join(sorted(_TYPES))}."
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{path}.required: expected an array of property names."
    if not isinstance(schema.get("enum", []), list):
        return f"{path}.enum: expected an array."
    for key in _NUMBERS:
        if key in schema and not _is_number(schema[key]):
            return f"{path}.{key}: expected a number."
    for key in _COUNTS:
        value = schema.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return f"{path}.{key}: expected a non-negative integer."
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_tool_choice(choice: str | dict | None, tools: list | None) -> None:
    """OpenAI's rules: "none" | "auto" | "required", or a named function that is among `tools`;
    "required" and a named function need tools."""
    param = "tool_choice"
    if choice is None or choice in ("none", "auto"):
        return
    if isinstance(choice, str) and choice != "required":
        raise BadRequest(
            f"tool_choice: {choice!r} is not one of 'none', 'auto', 'required'.", param
        )
    if not tools:
        raise BadRequest("tool_choice: is only allowed when tools are specified.", param)
    if isinstance(choice, dict):
        name = tool_name(choice)
        if name is None:
            raise BadRequest(
                "tool_choice: expected {'type': 'function', 'function': {'name'}}.", param
            )
        if name not in {tool_name(t) for t in tools}:
            raise BadRequest(f"tool_choice: function {name!r} is not among the tools.", param)
