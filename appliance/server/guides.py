"""Structured outputs in the server (issue 18): a request's constraint -> a `Guide` for the worker,
compiled once here before submitting (a bad schema, regex or grammar is a 400 naming the problem).

Sources, at most one per request: OpenAI `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` {json | regex | choice | grammar | json_object} and its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, SGLang's `regex` / `ebnf` / `json_schema`, and
`tool_choice` "required" or a named
function (a grammar over the Qwen3-coder XML tool-call format built from `tools`, so the tool-call
parser produces the calls as it does for free output). Called by serving.py's `_admit`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from appliance.grammars import (
    ENFORCED_FORMATS,
    GrammarCompiler,
    GrammarError,
    GrammarUnavailable,
)
from appliance.messages import Guide
from appliance.parsers import prompt_opens_reasoning
from appliance.server.errors import BadRequest
from appliance.server.limits import MAX_JSON_DEPTH, json_depth_exceeds
from appliance.server.tool_grammar import tool_call_tag

THINK_END = "</think>"
# JSON-schema keywords the grammar engine would silently ignore: refused rather than not enforced
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# the JSON-Schema standard's formats xgrammar would leave unenforced (refused; the enforced ones:
# grammars.ENFORCED_FORMATS); formats outside the standard's list are annotations, as the standard
# says (pydantic's "path", "password", "binary", ...: plain strings)
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
_MAY_BE_EMPTY = frozenset({"uri-reference", "uri-template", "json-pointer"})
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly"}
    | {"writeOnly", "$defs", "definitions", "$schema", "$id", "nullable"}  # OpenAPI's: ignored
)
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?<?[=!]")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_EXTRA_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY = {  # vLLM's older spellings, then SGLang's
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",
    "ebnf": "grammar",
    "json_schema": "json",
}


def check_regex(pattern: str, param: str, where: str = "") -> None:
    """400 for a regex lookaround, which xgrammar would drop (lookbehind it refuses itself)."""
    if _LOOKAROUND.search(pattern):
        where = f" at {where}" if where else ""
        message = f"{param}: regex lookahead (?=...) / (?!...){where} is not supported"
        raise BadRequest(message, param)


def _check_string_shape(schema: dict[str, Any], refuse: Callable[[str], None]) -> None:
    """xgrammar keeps one of pattern / format / length bounds and drops the others. A format's
    own minLength of 1 (pydantic's AnyUrl) holds anyway: its strings are never empty."""
    fmt = schema.get("format")
    fmt = fmt if fmt in ENFORCED_FORMATS else None
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if fmt and lengths == ["minLength"] and fmt not in _MAY_BE_EMPTY:
        if isinstance(schema["minLength"], int) and schema["minLength"] <= 1:
            lengths = []
    shapes = (["pattern"] if "pattern" in schema else []) + ([f"format {fmt!r}"] if fmt else [])
    if shapes and len(shapes + lengths) > 1:
        first, *rest = shapes + lengths
        refuse(f"{first} together with {', '.join(rest)}")


def _check_node(schema: dict[str, Any], param: str, path: str) -> None:
    """400 for combinations xgrammar 0.2.9 accepts but would not enforce (it only warns)."""

    def refuse(what: str) -> None:
        raise BadRequest(f"{param}: {what} at {path} is not supported", param)

    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        refuse("allOf with more than one schema")
    required = schema.get("required")
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    missing = [name for name in required or [] if name not in properties]
    if isinstance(required, list) and missing:
        refuse(f"required {missing[0]!r} without a property of that name")
    if "$ref" in schema and set(schema) - _ANNOTATIONS - {"$ref"}:
        refuse(f"$ref beside {', '.join(sorted(set(schema) - _ANNOTATIONS - {'$ref'}))}")
    if schema.get("format") in UNENFORCED_FORMATS:
        refuse(f"format {schema['format']!r}")
    if isinstance(schema.get("pattern"), str):
        check_regex(schema["pattern"], param, f"{path}/pattern")
    _check_string_shape(schema, refuse)
    if "multipleOf" in schema:
        types = schema.get("type")
        types = set(types) if isinstance(types, list) else {types}
        if "integer" not in types or "number" in types:
            refuse("multipleOf on a non-integer type")
        lower = {"minimum", "exclusiveMinimum"} & set(schema)
        upper = {"maximum", "exclusiveMaximum"} & set(schema)
        if bool(lower) != bool(upper):
            refuse("multipleOf with a one-sided range")


def check_schema(schema: Any, param: str, path: str = "#") -> None:
    """400 (against request field `param`) for a JSON schema using a feature the grammar cannot
    enforce, named with its path in the schema."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise BadRequest(f"{param}: expected a schema object at {path}, got {schema!r:.80}", param)
    _check_node(schema, param, path)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in UNSUPPORTED_KEYWORDS:
            raise BadRequest(f"{param}: schema keyword {key!r} at {where} is not supported", param)
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise BadRequest(f"{param}: only local $ref (#/...) is supported, got {value!r}", param)
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{where}/{name}")
        elif key in ("items", "additionalProperties") and isinstance(value, dict | bool):
            check_schema(value, param, where)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{where}/{i}")


def _schema_guide(schema: Any, param: str) -> Guide:
    if isinstance(schema, str):  # JSON text: the body's depth limit has not seen inside it
        try:
            schema = json.loads(schema)
            deep = json_depth_exceeds(schema, MAX_JSON_DEPTH)
        except RecursionError:
            deep = True
        except ValueError as exc:
            raise BadRequest(f"{param}: the schema is not valid JSON: {exc}", param) from None
        if deep:
            message = f"{param}: the schema nests deeper than {MAX_JSON_DEPTH} levels"
            raise BadRequest(message, param)
    if not isinstance(schema, dict | bool):
        raise BadRequest(f"{param}: expected a JSON schema object", param)
    check_schema(schema, param)
    return Guide("json_schema", json.dumps(schema))


def _choice_guide(choices: Any, param: str) -> Guide:
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise BadRequest(f"{param}: expected a non-empty list of strings", param)
    # EBNF string literals take JSON's escapes
    return Guide("grammar", "root ::= " + " | ".join(json.dumps(c) for c in choices))


def _extra_guide(kind: str, value: Any, param: str) -> Guide:
    if kind == "json":
        return _schema_guide(value, param)
    if kind == "json_object":
        return Guide("json_schema", json.dumps({"type": "object"}))
    if kind == "choice":
        return _choice_guide(value, param)
    if not (isinstance(value, str) and value):
        raise BadRequest(f"{param}: expected a non-empty string", param)
    if kind == "regex":
        check_regex(value, param)
    return Guide("regex" if kind == "regex" else "grammar", value)


def _response_format_guide(fmt: dict[str, Any]) -> Guide | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec or "name" not in spec:
            raise BadRequest(
                "response_format: json_schema needs {'name', 'schema'}.", "response_format"
            )
        return _schema_guide(spec["schema"], "response_format")
    raise BadRequest(
        f"response_format: type {kind!r} is not one of 'text', 'json_object', 'json_schema'."
        if kind is not None
        else "response_format: missing 'type' ('text', 'json_object' or 'json_schema').",
        "response_format",
    )


def tool_call_guide(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool = True
) -> Guide:
    """One Qwen3-coder XML tool call of the named function, or, for "required", one or more calls
    of any of the tools (one when not `parallel`, OpenAI's parallel_tool_calls), each call's
    parameters following its function's schema."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    functions = []
    for tool in tools:
        function = tool.get("function", {})
        name = function.get("name")
        if named is None or name == named:
            params = function.get("parameters")
            check_schema(params or {}, "tools", f"#/tools/{name}/parameters")
            functions.append((name, params))
    return Guide("structural_tag", tool_call_tag(functions, many=named is None and parallel))


def _sources(body: Any) -> list[tuple[str, Guide | None]]:
    found: list[tuple[str, Guide | None]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:  # {} too: a format that says nothing is refused, not ignored
        found.append(("response_format", _response_format_guide(fmt)))
    extras = getattr(body, "structured_outputs", None)
    if extras is not None:
        keys = [k for k in _EXTRA_KEYS if extras.get(k) not in (None, False)]
        if len(keys) != 1:
            raise BadRequest(
                f"structured_outputs: expected exactly one of {', '.join(_EXTRA_KEYS)}.",
                "structured_outputs",
            )
        found.append(("structured_outputs", _extra_guide(keys[0], extras[keys[0]], keys[0])))
    for field, kind in _LEGACY.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _extra_guide(kind, value, field)))
    choice = getattr(body, "tool_choice", None)
    tools = getattr(body, "tools", None)
    if tools and (choice == "required" or isinstance(choice, dict)):
        parallel = getattr(body, "parallel_tool_calls", True) is not False
        found.append(("tool_choice", tool_call_guide(tools, choice, parallel)))
    return [(name, guide) for name, guide in found if guide is not None]


def request_guide(
    body: Any, prompt_text: str | None, tokenizer: Any, reasoning: str = "auto"
) -> tuple[str, Guide] | None:
    """The request field that asks for structure and its guide, or None when the output is free.
    When the prompt opens a reasoning block, the grammar starts after the `</think>` token, unless
    the server leaves reasoning in the content (`--reasoning off`): then the whole answer is the
    content the grammar shapes, from its first token (as vLLM without a reasoning parser)."""
    found = _sources(body)
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise BadRequest(f"{names}: only one output constraint per request.", found[1][0])
    param, guide = found[0]
    if reasoning != "off" and prompt_text and prompt_opens_reasoning(prompt_text):
        think_end = tokenizer.convert_tokens_to_ids(THINK_END)
        if isinstance(think_end, int) and think_end >= 0:
            guide = Guide(guide.kind, guide.spec, after_token=think_end)
    return param, guide


async def compile_guide(compiler: GrammarCompiler, guide: Guide, param: str) -> None:
    """Waits for the guide's compiled grammar (cached, or compiled on the compiler's threads):
    the request reaches the queue only with a grammar that compiles."""
    try:
        await asyncio.wrap_future(compiler.submit(guide))
    except (GrammarError, GrammarUnavailable) as exc:
        raise BadRequest(str(exc), param) from None
