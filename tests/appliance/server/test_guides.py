"""Request fields -> guides (appliance/server/guides.py), and the enforced tool-call grammar
(tool_grammar.py) against the real Qwen3-coder parser: random walks through the grammar on the tiny
checkpoint's tokenizer always parse into one call whose arguments validate."""

from __future__ import annotations

import json
import re
import types

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from appliance.engine.guided import GuidedDecoding
from appliance.parsers.qwen3_coder import parse_tool_calls
from appliance.server.errors import BadRequest
from appliance.server.guides import request_guide, tool_call_guide
from appliance_kernels.token_bitmask import apply_token_bitmask

EOS = 1992  # <|im_end|> of the tiny BPE tokenizer
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo <north>", 'Rome "old"']},
                    "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                    "code": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{2}"},
                    "note": {"type": "string", "minLength": 1, "maxLength": 6},
                    "budget": {"type": "number", "minimum": 0, "maximum": 5},
                    "extras": {"type": "array", "items": {"enum": ["wifi", "pool"]}, "maxItems": 2},
                    "flags": {
                        "type": "object",
                        "properties": {"pets": {"type": "boolean"}},
                        "required": ["pets"],
                        "additionalProperties": False,
                    },
                },
                "required": ["city", "nights", "code"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]


def _nested(depth: int) -> str:
    """An object schema nested `depth` times, as JSON text (built without recursion)."""
    return '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth


def _body(**fields) -> types.SimpleNamespace:
    defaults = dict.fromkeys(
        (
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "regex",
            "ebnf",
            "json_schema",
            "tools",
            "tool_choice",
        )
    )
    return types.SimpleNamespace(**{**defaults, **fields})


class _Tok:
    def convert_tokens_to_ids(self, token: str) -> int:
        return 77 if token == "</think>" else -1


def test_sources_map_to_guides():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    param, guide = request_guide(_body(response_format=fmt), None, _Tok())
    assert (param, guide.kind, json.loads(guide.spec)) == ("response_format", "json_schema", schema)
    assert request_guide(_body(response_format={"type": "text"}), None, _Tok()) is None
    _, guide = request_guide(_body(guided_choice=["a", 'b"c']), None, _Tok())
    assert guide.spec == 'root ::= "a" | "b\\"c"'
    _, guide = request_guide(_body(structured_outputs={"regex": "[0-9]+"}), None, _Tok())
    assert (guide.kind, guide.spec, guide.after_token) == ("regex", "[0-9]+", -1)
    _, guide = request_guide(_body(guided_json=json.dumps(schema)), None, _Tok())
    assert json.loads(guide.spec) == schema
    # thinking on: the grammar starts after </think>
    _, guide = request_guide(_body(guided_regex="a"), "<|im_start|>assistant\n<think>\n", _Tok())
    assert guide.after_token == 77
    # ... unless the server leaves reasoning in the content: the grammar shapes all of it
    thinking = "<|im_start|>assistant\n<think>\n"
    _, guide = request_guide(_body(guided_regex="a"), thinking, _Tok(), reasoning="off")
    assert guide.after_token == -1
    # tool_choice auto / none constrain nothing
    assert request_guide(_body(tools=TOOLS, tool_choice="auto"), None, _Tok()) is None
    # SGLang's spellings
    _, guide = request_guide(_body(regex="(yes|no)"), None, _Tok())
    assert (guide.kind, guide.spec) == ("regex", "(yes|no)")
    _, guide = request_guide(_body(ebnf='root ::= "A"'), None, _Tok())
    assert (guide.kind, guide.spec) == ("grammar", 'root ::= "A"')
    param, guide = request_guide(_body(json_schema=json.dumps(schema)), None, _Tok())
    assert (param, guide.kind, json.loads(guide.spec)) == ("json_schema", "json_schema", schema)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"not": {}}}}}, "'not' at"),
        ({"guided_json": {"$ref": "https://example.com/s.json"}}, "local $ref"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"guided_choice": ["a", 1]}, "list of strings"),
        ({"guided_regex": "a", "guided_grammar": "root ::= x"}, "only one"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "needs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "needs"),
        ({"response_format": {}}, "missing 'type'"),
        ({"regex": "a", "ebnf": "root ::= x"}, "only one"),
        ({"response_format": {"json_schema": {"schema": {}}}}, "missing 'type'"),
        # accepted by xgrammar 0.2.9 but left unenforced (it only logs a warning): refused
        ({"guided_json": {"allOf": [{"type": "object"}, {"required": []}]}}, "allOf with more"),
        (
            {"guided_json": {"$defs": {"A": {}}, "$ref": "#/$defs/A", "minimum": 3}},
            "beside minimum",
        ),
        ({"guided_json": {"type": "string", "pattern": "a+", "maxLength": 3}}, "with maxLength"),
        ({"guided_json": {"type": "string", "format": "uri", "maxLength": 9}}, "'uri' together"),
        ({"guided_json": {"type": "string", "pattern": "a", "format": "email"}}, "pattern togeth"),
        ({"guided_json": {"type": "string", "format": "idn-email"}}, "format 'idn-email'"),
        ({"guided_json": {"type": "number", "multipleOf": 0.5}}, "non-integer"),
        ({"guided_json": {"type": "integer", "multipleOf": 5, "minimum": 1}}, "one-sided"),
        ({"guided_json": {"type": "string", "pattern": "a(?!b)"}}, "lookahead"),
        ({"guided_regex": "\\d(?=x)"}, "lookahead"),
        ({"guided_json": {"type": "object", "required": ["a"]}}, "required 'a' without"),
        # JSON text skips the body's depth limit: the same limit, and no RecursionError (a 500)
        ({"guided_json": _nested(40)}, "nests deeper than 64"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"properties": {"v": {"enum": ["a", "NULL"]}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "enum value 'null' cannot be told apart",
        ),
        ({"structured_outputs": {"json": _nested(5000)}}, "nests deeper than 64"),
    ],
)
def test_bad_sources_are_400s(fields, words):
    with pytest.raises(BadRequest) as err:
        request_guide(_body(**fields), None, _Tok())
    assert words in err.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"type": "integer"}]},  # one schema: inlined by xgrammar
        {"$defs": {"A": {}}, "$ref": "#/$defs/A", "description": "annotations may sit beside"},
        {"type": "string", "format": "uri", "minLength": 1},  # pydantic's AnyUrl
        {"type": "string", "format": "password", "maxLength": 4},  # not a standard format
        {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
        {"type": "string", "pattern": "a\\(?=b"},  # an escaped parenthesis, no lookahead
    ],
)
def test_enforced_schemas_pass(schema):
    request_guide(_body(guided_json=schema), None, _Tok())


@pytest.fixture(scope="module")
def tokenizer(tiny_dense):
    return AutoTokenizer.from_pretrained(str(tiny_dense))


def _walks(tokenizer, guide, tools, seed: int, count: int):
    """`count` random walks through `guide` on the tiny tokenizer (random logits under its
    bitmask): each must end with the stop token and parse into calls; yields each walk's
    [(name, args), ...]."""
    guided = GuidedDecoding(lambda: tokenizer, 2000, [EOS])
    gen = torch.Generator().manual_seed(seed)
    for walk in range(count):
        guided.admit(walk, guide, [])
        tokens = []
        while not guided.terminated(walk):
            logits = apply_token_bitmask(
                torch.randn(1, 2000, generator=gen), guided.bitmask([(walk, [])])
            )
            tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
            guided.advance(walk, tokens[-1:])
            assert len(tokens) < 2000
        assert tokens[-1] == EOS
        calls = parse_tool_calls(tokenizer.decode(tokens[:-1]), tools).tool_calls
        assert calls
        yield [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _parameters(tools, name: str) -> dict:
    return next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "book"}}, True),
    ],
)
def test_random_walks_through_the_tool_grammar_parse_into_valid_calls(tokenizer, choice, parallel):
    """ "required" is one or more calls (one without parallel_tool_calls), a named function one."""
    names, counts = set(), set()
    guide = tool_call_guide(TOOLS, choice, parallel)
    for calls in _walks(tokenizer, guide, TOOLS, 0, 12):
        counts.add(len(calls))
        for name, args in calls:
            names.add(name)
            jsonschema.validate(args, _parameters(TOOLS, name))
    assert names == ({"book", "ping"} if choice == "required" else {"book"})
    assert counts == {1} if choice != "required" or not parallel else max(counts) > 1


UNION_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set",
            "parameters": {
                "type": "object",
                "properties": {
                    "v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]},
                    "w": {"type": ["string", "integer"], "maxLength": 4},
                    "x": {"type": "number"},
                },
                "required": ["v", "w", "x"],
            },
        },
    }
]


def test_union_and_unbounded_number_parameters_parse_into_valid_values(tokenizer):
    """A string allowed beside other types is written quoted and read back unquoted (it kept
    its quotes inside the value); a number with no bounds is never an exponent that reads back as
    infinity (it came back as a string)."""
    strings = 0
    guide = tool_call_guide(UNION_TOOLS, "required")
    for _, args in (
        call for calls in _walks(tokenizer, guide, UNION_TOOLS, 3, 16) for call in calls
    ):
        jsonschema.validate(args, UNION_TOOLS[0]["function"]["parameters"])
        assert isinstance(args["x"], int | float) and not isinstance(args["x"], bool)
        strings += sum(isinstance(args[k], str) for k in ("v", "w"))
        assert not any(isinstance(args[k], str) and args[k].startswith('"') for k in ("v", "w"))
    assert strings  # the walks took the string branches too


OPTIONAL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {
                    "day": {"type": "string", "format": "date"},
                    "ref": {"anyOf": [{"type": "string", "format": "uuid"}, {"type": "null"}]},
                    "code": {
                        "anyOf": [{"type": "string", "pattern": "[a-c]{2}"}, {"type": "null"}]
                    },
                    "kind": {"anyOf": [{"enum": ["x", "y"], "type": "string"}, {"type": "null"}]},
                },
                "required": ["day", "ref", "code", "kind"],
            },
        },
    }
]


def test_tool_string_formats_and_optional_branches_are_enforced(tokenizer):
    # a string parameter's format, and the constraints inside Optional[...] (anyOf with null, as
    # pydantic writes it), hold in the raw XML text too (they were free text)
    guide = tool_call_guide(OPTIONAL_TOOLS, "required")
    for _, args in (
        call for calls in _walks(tokenizer, guide, OPTIONAL_TOOLS, 1, 6) for call in calls
    ):
        jsonschema.validate(args, OPTIONAL_TOOLS[0]["function"]["parameters"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", args["day"])
        hexes = r"[0-9a-fA-F]{8}-" + r"[0-9a-fA-F]{4}-" * 3 + r"[0-9a-fA-F]{12}"
        assert args["ref"] is None or re.fullmatch(hexes, args["ref"])


REF_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_level",
            "parameters": {
                "type": "object",
                "$defs": {"Level": {"enum": ["1", "high"], "type": "string"}},
                "properties": {
                    "level": {"$ref": "#/$defs/Level"},
                    "backup": {"anyOf": [{"$ref": "#/$defs/Level"}, {"type": "null"}]},
                },
                "required": ["level", "backup"],
            },
        },
    }
]


def test_ref_enum_parameters_are_raw_strings_in_the_grammar(tokenizer):
    # an enum behind a $ref (pydantic's layout) is a string parameter, written raw as the parser
    # reads it (as JSON, "1" would be quoted in the XML and read back as typed)
    guide = tool_call_guide(REF_TOOLS, "required")
    assert '"value": "1"' in guide.spec and '"value": "high"' in guide.spec
    for _, args in (call for calls in _walks(tokenizer, guide, REF_TOOLS, 2, 6) for call in calls):
        jsonschema.validate(args, REF_TOOLS[0]["function"]["parameters"])
