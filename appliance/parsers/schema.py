"""Tool-parameter value conversion by JSON schema: raw text from `<parameter=…>` → a JSON value.

Called by the Qwen3-coder tool-call parser (`appliance/parsers/qwen3_coder.py`) as parameters close.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from appliance.logging import get_logger

logger = get_logger(__name__)

# JSON-schema type names, plus the informal aliases models and tool authors use (the same set the
# vLLM / SGLang qwen3_coder parsers accept). "any" means: the schema names a type we cannot use.
_ALIASES = {
    "string": "string",
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "integer": "integer",
    "int": "integer",
    "long": "integer",
    "short": "integer",
    "uint": "integer",
    "unsigned": "integer",
    "number": "number",
    "num": "number",
    "float": "number",
    "double": "number",
    "boolean": "boolean",
    "bool": "boolean",
    "binary": "boolean",
    "object": "object",
    "dict": "object",
    "map": "object",
    "array": "array",
    "list": "array",
    "arr": "array",
    "tuple": "array",
    "null": "null",
    "none": "null",
}
_STRING_ONLY = (frozenset({"string"}), frozenset({"string", "null"}))


def _alias(type_name: object) -> str:
    name = str(type_name).strip().lower()
    if name in _ALIASES:
        return _ALIASES[name]
    for prefix, json_type in (
        ("int", "integer"),
        ("uint", "integer"),
        ("num", "number"),
        ("float", "number"),
        ("dict", "object"),
        ("list", "array"),
    ):
        if name.startswith(prefix):
            return json_type
    return "any"


def _value_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def schema_types(schema: object) -> frozenset[str]:
    """The JSON types a parameter schema allows, e.g. {"integer", "null"}.

    No usable type information (no schema, `{}`, a parameter missing from `properties`) means
    string, as in vLLM/SGLang. `anyOf`/`oneOf`/`allOf` contribute the union of their branches;
    `enum`/`const` the types of their values; an unknown type name or a bare `$ref` gives "any".
    """
    if not isinstance(schema, dict):
        return frozenset({"string"})
    if "type" in schema:
        declared = schema["type"]
        names = declared if isinstance(declared, list) else [declared]
        return frozenset(_alias(name) for name in names) or frozenset({"string"})
    branches = [b for key in ("anyOf", "oneOf", "allOf") for b in schema.get(key) or []]
    if branches:
        return frozenset().union(*(schema_types(branch) for branch in branches))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(_value_type(value) for value in schema["enum"])
    if "const" in schema:
        return frozenset({_value_type(schema["const"])})
    if "properties" in schema:
        return frozenset({"object"})
    if "items" in schema:
        return frozenset({"array"})
    if "$ref" in schema:
        return frozenset({"any"})
    return frozenset({"string"})


def streams_as_string(types: frozenset[str]) -> bool:
    """True when the value is a JSON string (or null), so the parser may stream it character by
    character; every other type is emitted whole when its `</parameter>` arrives."""
    return types in _STRING_ONLY


def null_spellings(types: frozenset[str]) -> tuple[str, ...]:
    """The lowercased texts that read as JSON null: `null` always (vLLM's rule); also Python's
    `None` (as Qwen templates that render arguments with `| string` write null) where the value
    may be null or cannot be a string, as vLLM reads it."""
    return ("null", "none") if "null" in types or "string" not in types else ("null",)


def _json_loads(text: str) -> Any:
    def reject(constant: str) -> Any:  # NaN / Infinity are not JSON
        raise ValueError(constant)

    return json.loads(text, parse_constant=reject)


def _is_json_value(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _to_integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _to_number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _to_structure(text: str, types: frozenset[str]) -> tuple[bool, Any]:
    """Parse a JSON (or Python-literal) object/array: (ok, value); "any" accepts any JSON value."""
    wanted = {"object": dict, "array": list}
    accept = tuple(wanted[t] for t in types if t in wanted)
    for parse in (_json_loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(value, tuple):
            value = list(value)
        if ("any" in types or isinstance(value, accept)) and _is_json_value(value):
            return True, value
    return False, None


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """Convert a parameter's raw text (Qwen's surrounding newlines stripped) to a JSON value.

    `null` (any case) is None whatever the type, as in vLLM/SGLang, and so is `None` where the
    type allows null or is not a string (`null_spellings`). Otherwise the non-string types
    are tried in a fixed order (integer, number, boolean, object/array/any), then, where a string
    is one of several types, a JSON string literal (`"5"` -> "5"); a value none of them accepts
    stays the raw string. Integers accept an integral float spelling ("5.0" → 5); numbers
    keep Python's int/float distinction ("5" → 5, "5.0" → 5.0); NaN and infinities stay strings.
    """
    if raw.lower() in null_spellings(types):
        return None
    if streams_as_string(types):
        return raw
    text = raw.strip()
    if "integer" in types and (value := _to_integer(text)) is not None:
        return value
    if "number" in types and (value := _to_number(text)) is not None:
        return value
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"object", "array", "any"}:
        ok, value = _to_structure(text, types)
        if ok:
            return value
    if "string" in types and text.startswith('"'):
        # a string where other types are allowed too is written as JSON (with quotes) by an
        # enforced call (appliance/server/tool_grammar.py) and by models that quote it
        try:
            value = _json_loads(text)
        except ValueError:
            value = None
        if isinstance(value, str):
            return value
    if "string" not in types:
        logger.debug("value %.80r does not match %s; kept as a string", raw, sorted(types))
    return raw


def resolve_refs(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`schema` with a local `$ref` (`#/$defs/X`, `#/definitions/X` of the parameters `root`, as
    pydantic writes enums and nested models) replaced by its target, in it and in its
    anyOf/oneOf/allOf branches, so its types are the target's; other refs are left as they are."""
    if not isinstance(schema, dict) or depth > 8:  # depth: a ref cycle resolves no further
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.count("/") == 2:
        hash_sign, section, name = ref.split("/")
        target = root.get(section) if hash_sign == "#" else None
        if isinstance(target, dict) and isinstance(target.get(name), dict):
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            return resolve_refs({**target[name], **siblings}, root, depth + 1)
    resolved = dict(schema)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            resolved[key] = [resolve_refs(branch, root, depth + 1) for branch in schema[key]]
    return resolved


def tool_parameter_schemas(tool: dict) -> dict[str, Any]:
    """`properties` of an OpenAI tool entry ({"type": "function", "function": {...}}) or of a bare
    function dict ({"name", "parameters"}), local `$ref`s resolved; {} when it has none."""
    function = tool.get("function", tool) if isinstance(tool, dict) else {}
    parameters = function.get("parameters") if isinstance(function, dict) else None
    if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict):
        return {k: resolve_refs(v, parameters) for k, v in parameters["properties"].items()}
    return {}


def tool_name(tool: dict) -> str | None:
    """The function name of an OpenAI tool entry or bare function dict."""
    function = tool.get("function", tool) if isinstance(tool, dict) else {}
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None
