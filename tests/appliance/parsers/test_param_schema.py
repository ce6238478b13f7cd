"""Tool-parameter conversion by JSON schema (appliance/parsers/schema.py)."""

from __future__ import annotations

import json

import pytest

from appliance.parsers.schema import (
    convert_value,
    schema_types,
    streams_as_string,
    tool_name,
    tool_parameter_schemas,
)


@pytest.mark.parametrize(
    ("schema", "types"),
    [
        (None, {"string"}),
        ({}, {"string"}),
        ({"type": "integer"}, {"integer"}),
        ({"type": ["string", "null"]}, {"string", "null"}),
        ({"type": "INT64"}, {"integer"}),
        ({"type": "float"}, {"number"}),
        ({"type": "bool"}, {"boolean"}),
        ({"type": "dict"}, {"object"}),
        ({"type": "any"}, {"any"}),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, {"integer", "null"}),
        ({"oneOf": [{"type": "string"}, {"type": "array", "items": {}}]}, {"string", "array"}),
        ({"enum": [1, 2]}, {"integer"}),
        ({"enum": ["a", None]}, {"string", "null"}),
        ({"const": True}, {"boolean"}),
        ({"properties": {"x": {}}}, {"object"}),
        ({"items": {"type": "string"}}, {"array"}),
        ({"$ref": "#/defs/X"}, {"any"}),
    ],
)
def test_schema_types(schema: object, types: set[str]) -> None:
    assert schema_types(schema) == frozenset(types)


def test_only_plain_strings_stream() -> None:
    assert streams_as_string(frozenset({"string"}))
    assert streams_as_string(frozenset({"string", "null"}))
    assert not streams_as_string(frozenset({"string", "integer"}))
    assert not streams_as_string(frozenset({"any"}))


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("hello", {"type": "string"}, "hello"),
        (" 42 ", {"type": "string"}, " 42 "),
        ("null", {"type": "string"}, None),
        ("Null", {"type": "integer"}, None),
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "integer"}, -7),
        ("5.0", {"type": "integer"}, 5),
        ("5.5", {"type": "integer"}, "5.5"),
        ("forty", {"type": "integer"}, "forty"),
        ("3", {"type": "number"}, 3),
        ("2.50", {"type": "number"}, 2.5),
        ("1e3", {"type": "number"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("inf", {"type": "number"}, "inf"),
        ("TRUE", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ('["a", 1]', {"type": "array"}, ["a", 1]),
        ("('a', 1)", {"type": "array"}, ["a", 1]),
        ('{"a": 1}', {"type": "array"}, '{"a": 1}'),
        ("{'a': None, 'b': True}", {"type": "object"}, {"a": None, "b": True}),
        ('{"a": NaN}', {"type": "object"}, '{"a": NaN}'),
        ("{1, 2}", {"type": "object"}, "{1, 2}"),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("7", {"type": "any"}, 7),
        ('"s"', {"$ref": "#/x"}, "s"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("seven", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "seven"),
        # a string beside other types, quoted as JSON (an enforced call writes it so): unquoted
        ('"At"', {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "At"),
        ('"5"', {"type": ["integer", "string"]}, "5"),
        ('"open', {"type": ["integer", "string"]}, '"open'),
        ('"s"', {"type": "string"}, '"s"'),  # a plain string keeps what the model wrote
        ("", {"type": "integer"}, ""),
        # Python's None (templates that render arguments with `| string` write null so) is null
        # where null is allowed or a string is not; a plain string keeps it
        ("None", {"type": "integer"}, None),
        ("none", {"type": "object"}, None),
        ("None", {"type": ["string", "null"]}, None),
        ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ("None", {"type": "string"}, "None"),
        ("None", {"type": ["integer", "string"]}, "None"),
    ],
)
def test_convert_value(raw: str, schema: dict, value: object) -> None:
    converted = convert_value(raw, schema_types(schema))
    assert converted == value and type(converted) is type(value)
    json.dumps(converted, allow_nan=False)  # always valid JSON


def test_tool_entry_helpers() -> None:
    wrapped = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    bare = {"name": "g", "parameters": {"type": "object"}}
    assert (tool_name(wrapped), tool_name(bare)) == ("f", "g")
    assert tool_parameter_schemas(wrapped) == {"x": {"type": "integer"}}
    assert tool_parameter_schemas(bare) == {}
