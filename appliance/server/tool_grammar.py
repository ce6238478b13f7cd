"""The grammar of enforced tool calls (`tool_choice` "required": one or more, one if
parallel_tool_calls is false; a named function: one) in the Qwen3-coder XML format that
appliance/parsers/qwen3_coder.py parses, as an xgrammar structural tag (calls a newline apart):

    <tool_call>\\n<function=NAME>\\n
    <parameter=KEY>\\nVALUE\\n</parameter>\\n     (per property, in schema order; optional ones may
    ...                                          be left out)
    </function>\\n</tool_call>

A VALUE whose schema type is string (or string/null) is raw text, as the parser keeps it: one of
its `enum` values, its `pattern`, its `format`, or text without `<` within its length bounds. Any
other VALUE is compact JSON following the property's schema (the parser converts it by type; a
string allowed beside other types is then a quoted JSON string, which the parser unquotes; a number
without bounds gets +-NUMBER_BOUND, so it is a plain decimal). No
free whitespace anywhere: the parser would keep it inside a string value. Called by
appliance/server/guides.py.
"""

from __future__ import annotations

import json
from typing import Any

from appliance.grammars import ENFORCED_FORMATS, RAW_STRING_STYLE
from appliance.parsers.schema import resolve_refs, schema_types, streams_as_string
from appliance.server.errors import BadRequest

Format = dict[str, Any]
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/")
NUMBER_BOUND = 1e300  # |value| of a number parameter with no bounds of its own


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _one_of(formats: list[Format]) -> Format:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


def _raw_string(schema: dict[str, Any]) -> Format:
    """A string parameter's raw text (no quotes, no JSON escapes); `null` where the schema allows
    null (the parser reads that text as None)."""
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or []]
    if branches:  # Optional[str] as pydantic writes it: each branch keeps its own constraints
        formats = [_raw_string(b) for b in branches if "string" in schema_types(b)]
        if any("null" in schema_types(b) for b in branches):
            formats.append(_const("null"))
        return _one_of(formats)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        texts = [v for v in values if isinstance(v, str)] + ["null"] * (None in values)
        if not texts:
            raise BadRequest("tools: a string parameter's enum has no string value.", "tools")
        if any(isinstance(v, str) and v.lower() == "null" for v in values):
            raise BadRequest(  # the parser reads the text null as JSON null (vLLM's rule)
                "tools: a string parameter's enum value 'null' cannot be told apart from JSON "
                "null in the XML tool-call format; rename it.",
                "tools",
            )
        return _one_of([_const(t) for t in texts])
    if isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    if schema.get("format") in ENFORCED_FORMATS:  # compiled in appliance/grammars.py
        string = {"type": "string", "format": schema["format"]}
        return {"type": "json_schema", "json_schema": string, "style": RAW_STRING_STYLE}
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    bounds = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
    return {"type": "regex", "pattern": f"[^<]{bounds}"}


def _finite(schema: dict[str, Any]) -> dict[str, Any]:
    """A number schema with no bounds gets NUMBER_BOUND ones: the grammar then writes plain
    decimals, never an exponent so large that the value reads back as infinity (not JSON)."""
    types = schema.get("type")
    if "number" not in (types if isinstance(types, list) else [types]):
        return schema
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return schema
    return {**schema, "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND}


def _value(schema: Any, definitions: dict[str, Any]) -> Format:
    schema = resolve_refs(schema, definitions)  # typed as the parser types it
    if isinstance(schema, dict) and streams_as_string(schema_types(schema)):
        return _raw_string(schema)
    if isinstance(schema, dict):
        schema = _finite(schema)
    if schema is None:
        schema = True
    elif isinstance(schema, dict) and definitions:
        # a property compiles as its own schema: its local $refs (#/$defs/X, as pydantic writes
        # nested models and enums) need the root's definitions beside it
        schema = {**definitions, **schema}
    # compact JSON: appliance/grammars.py compiles it as such
    return {"type": "json_schema", "json_schema": schema}


def _parameter(name: str, schema: Any, definitions: dict[str, Any]) -> Format:
    return {
        "type": "sequence",
        "elements": [
            _const(f"<parameter={name}>\n"),
            _value(schema, definitions),
            _const("\n</parameter>\n"),
        ],
    }


def function_call_format(name: str, parameters: dict[str, Any] | None) -> Format:
    """One call of function `name` whose arguments follow `parameters` (an object schema)."""
    parameters = parameters or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    elements: list[Format] = [_const(f"<tool_call>\n<function={name}>\n")]
    for key, schema in properties.items():
        param = _parameter(key, schema, definitions)
        elements.append(param if key in required else {"type": "optional", "content": param})
    elements.append(_const("</function>\n</tool_call>"))
    return {"type": "sequence", "elements": elements}


def tool_call_tag(functions: list[tuple[str, dict[str, Any] | None]], many: bool = False) -> str:
    """The structural tag (JSON text) of one call of any of `functions` (name, parameters), or,
    with `many`, of one or more such calls, a newline between two."""
    calls = [function_call_format(name, params) for name, params in functions]
    fmt = _one_of(calls)
    if many:
        more = {"type": "sequence", "elements": [_const("\n"), fmt]}
        fmt = {"type": "sequence", "elements": [fmt, {"type": "star", "content": more}]}
    return json.dumps({"type": "structural_tag", "format": fmt})
