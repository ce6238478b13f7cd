"""Qwen3-coder tool-call parser: fixed responses, each fed at hundreds of chunkings."""

from __future__ import annotations

import json

import pytest
from parser_harness import (
    CALL_ID,
    ToolCase,
    check_tool_stream,
    compositions,
    many_splits,
    two_cut_splits,
)

from appliance.parsers import ParserFinishedError, ToolCallParser, parse_tool_calls


def _tool(name: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": properties},
        },
    }


TOOLS = [
    _tool(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
    ),
    _tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _tool(
        "configure",
        {
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "enabled": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "options": {"type": "object"},
            "note": {"type": ["string", "null"]},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
    ),
    _tool("ping", {}),
    {  # pydantic's layout: enums and nested models as $refs into $defs
        "type": "function",
        "function": {
            "name": "set_level",
            "parameters": {
                "type": "object",
                "$defs": {"Level": {"enum": ["1", "2", "true"], "type": "string"}},
                "properties": {
                    "level": {"$ref": "#/$defs/Level"},
                    "backup": {"anyOf": [{"$ref": "#/$defs/Level"}, {"type": "null"}]},
                    "other": {"$ref": "#/$defs/Missing"},
                },
            },
        },
    },
]


def _call(name: str, params: list[tuple[str, str]]) -> str:
    """Canonical Qwen3-coder rendering of one function block."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<function={name}>\n{body}</function>\n"


def _block(*functions: str) -> str:
    return "<tool_call>\n" + "".join(functions) + "</tool_call>"


WEATHER = _call("get_weather", [("city", "Paris"), ("days", "3")])
ESCAPES = 'He said "hi" \\ C:\\dir\n\ttab 😀 日本語 \x01 \u2028 </para <b> &amp; {"x": 1}'

CODE = "a </parameter> b\nx<parameter=y> </function> z\n</function>x <function=q </parameter>"
CASES = {
    "single": ToolCase(_block(WEATHER), None, [("get_weather", {"city": "Paris", "days": 3})]),
    "text_and_two_blocks": ToolCase(
        "Sure, checking.\n\n"
        + _block(_call("get_weather", [("city", "Oslo")]))
        + "\n"
        + _block(_call("ping", []))
        + "\n\nDone.",
        "Sure, checking.\n\nDone.",
        [("get_weather", {"city": "Oslo"}), ("ping", {})],
    ),
    "functions_in_one_block": ToolCase(
        _block(_call("ping", []), _call("get_weather", [("city", "Rome"), ("unit", "c")])),
        None,
        [("ping", {}), ("get_weather", {"city": "Rome", "unit": "c"})],
    ),
    "undefined_then_valid": ToolCase(
        _block(_call("launch", [("target", "moon")]))
        + "\n"
        + _block(_call("nope", [("x", "1")]), _call("get_weather", [("city", "Lima")])),
        None,
        [("get_weather", {"city": "Lima"})],
    ),
    "implicit_closers": ToolCase(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
        "</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    "function_end_closes_param": ToolCase(
        "<tool_call><function=get_weather><parameter=city>Nice</function></tool_call>",
        None,
        [("get_weather", {"city": "Nice"})],
    ),
    "truncated_in_string": ToolCase(
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.txt\n</parameter>\n"
        "<parameter=content>\nhello wor",
        None,
        [("write_file", {"path": "/tmp/a.txt", "content": "hello wor"})],
    ),
    "truncated_in_number": ToolCase(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n4",
        None,
        [("get_weather", {"city": "Paris", "days": 4})],
    ),
    "truncated_in_header": ToolCase(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "truncated_function_name": ToolCase("Hi\n<tool_call>\n<function=get_wea", "Hi", []),
    # a block with no <function=: a Hermes-style JSON call (Qwen3's format) is a call ...
    "hermes_json_call": ToolCase(
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>",
        "Sure.",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    "hermes_json_arguments_as_text": ToolCase(
        '<tool_call>{"name": "get_weather", "arguments": "{\\"unit\\": \\"c\\"}"}</tool_call>',
        None,
        [("get_weather", {"unit": "c"})],
    ),
    "hermes_json_with_nan_is_content": ToolCase(
        '<tool_call>{"name": "get_weather", "arguments": {"days": NaN}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"days": NaN}}</tool_call>',
        [],
    ),
    # ... and anything else in it is content, as written: nothing the model wrote is lost
    "block_without_a_call_is_content": ToolCase(
        "Call <tool_call> maybe</tool_call> later", "Call <tool_call> maybe</tool_call> later", []
    ),
    "unclosed_block_without_a_call_is_content": ToolCase(
        "Call <tool_call> maybe <b>", "Call <tool_call> maybe <b>", []
    ),
    # max_tokens cut the call inside its closing tag: the partial tag is not the value's
    "truncated_closer_dropped": ToolCase(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</param",
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "truncated_closer_after_the_newline": ToolCase(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</",
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "escapes_and_unicode": ToolCase(
        _block(_call("write_file", [("path", "ä/ö.txt"), ("content", ESCAPES)])),
        None,
        [("write_file", {"path": "ä/ö.txt", "content": ESCAPES})],
    ),
    "types_by_schema": ToolCase(
        _block(
            _call(
                "configure",
                [
                    ("count", "42"),
                    ("ratio", "0.5"),
                    ("enabled", "True"),
                    ("tags", '["a", "b"]'),
                    ("options", "{'k': [1, None], 'ok': True}"),
                    ("note", "null"),
                    ("limit", "NULL"),
                ],
            )
        ),
        None,
        [
            (
                "configure",
                {
                    "count": 42,
                    "ratio": 0.5,
                    "enabled": True,
                    "tags": ["a", "b"],
                    "options": {"k": [1, None], "ok": True},
                    "note": None,
                    "limit": None,
                },
            )
        ],
    ),
    "type_fallbacks": ToolCase(
        _block(
            _call(
                "configure",
                [
                    ("count", "forty"),
                    ("ratio", "1e3"),
                    ("enabled", "yes"),
                    ("tags", "not json"),
                    ("options", '{"nested": {"x": true, "y": [1.5, "q\\"z"]}}'),
                    ("limit", "7"),
                    ("extra", "5"),
                    ("note", "n/a"),
                ],
            )
        ),
        None,
        [
            (
                "configure",
                {
                    "count": "forty",
                    "ratio": 1000.0,
                    "enabled": "yes",
                    "tags": "not json",
                    "options": {"nested": {"x": True, "y": [1.5, 'q"z']}},
                    "limit": 7,
                    "extra": "5",
                    "note": "n/a",
                },
            )
        ],
    ),
    "repeated_parameter": ToolCase(
        _block(_call("get_weather", [("city", "A"), ("days", "1"), ("city", "B")])),
        None,
        [("get_weather", {"city": "A", "days": 1})],
    ),
    "null_like_strings": ToolCase(
        _block(
            _call("write_file", [("path", "nullx"), ("content", "Nu")]),
            _call("get_weather", [("city", "null")]),
            _call("write_file", [("path", ""), ("content", "NuLL")]),
        ),
        None,
        [
            ("write_file", {"path": "nullx", "content": "Nu"}),
            ("get_weather", {"city": None}),
            ("write_file", {"path": "", "content": None}),
        ],
    ),
    "python_none_is_null_where_null_fits": ToolCase(
        _block(
            _call(
                "configure",
                [("note", "None"), ("limit", "None"), ("count", "None"), ("tags", "Nonesuch")],
            ),
            _call("write_file", [("path", "None"), ("content", "Non")]),
        ),
        None,
        [
            ("configure", {"note": None, "limit": None, "count": None, "tags": "Nonesuch"}),
            ("write_file", {"path": "None", "content": "Non"}),
        ],
    ),
    "refs_typed_as_their_targets": ToolCase(
        _block(
            _call("set_level", [("level", "1"), ("backup", "true"), ("other", "2")]),
            _call("set_level", [("backup", "None")]),
        ),
        None,
        [
            ("set_level", {"level": "1", "backup": "true", "other": 2}),
            ("set_level", {"backup": None}),
        ],
    ),
    "newline_stripping": ToolCase(
        "<tool_call>\n<function=write_file>\n<parameter=content>\n\n\nx\n\n\n</parameter>\n"
        "<parameter=path>p</parameter>\n</function>\n</tool_call>",
        None,
        [("write_file", {"content": "\n\nx\n\n", "path": "p"})],
    ),
    "whitespace_around_calls": ToolCase(
        "\n\n" + _block(WEATHER) + "\n", None, [("get_weather", {"city": "Paris", "days": 3})]
    ),
    "junk_inside_block": ToolCase(
        "<tool_call>\nblah <b> <function=ping>\nzzz <x></function>\n</tool_call>",
        None,
        [("ping", {})],
    ),
    "unclosed_function_then_next": ToolCase(
        "<tool_call>\n<tool_call>\n<function=ping>\n<function=get_weather>\n<parameter=city>\nX\n"
        "</parameter>\n</tool_call>",
        None,
        [("ping", {}), ("get_weather", {"city": "X"})],
    ),
    "fake_tags_in_text": ToolCase(
        "Compare a<b, </tool_call>, <tool_c and <tool_callx>! end <tool_cal",
        "Compare a<b, </tool_call>, <tool_c and <tool_callx>! end <tool_cal",
        [],
    ),
    "plain_text_trailing_whitespace": ToolCase("Hello\n\n ", "Hello\n\n ", []),
    # a value may hold the closing tags as text (code, XML): only the model's layout closes it
    "closers_as_text_in_a_value": ToolCase(
        _block(_call("write_file", [("content", CODE), ("path", "p")])),
        None,
        [("write_file", {"content": CODE, "path": "p"})],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_at_many_chunkings(name: str) -> None:
    case = CASES[name]
    for number, chunks in enumerate(many_splits(case.text, seed=len(name))):
        check_tool_stream(case, chunks, TOOLS, compare_whole=number == 0)


@pytest.mark.parametrize("name", ["function_end_closes_param", "truncated_in_number"])
def test_every_pair_of_boundaries(name: str) -> None:
    case = CASES[name]
    for chunks in two_cut_splits(case.text):
        check_tool_stream(case, chunks, TOOLS)


@pytest.mark.parametrize(
    ("anchor", "shift"),
    [("<tool_call>", 0), ("<function=", 3), ("Paris", 2), ("3\n</par", -1), ("</function>", 5)],
)
def test_every_small_split_around_tags(anchor: str, shift: int) -> None:
    """All splits into 1–3-character pieces of a 14-character window around each tag."""
    case = CASES["single"]
    start, length = case.text.index(anchor) + shift, 14
    head, middle, tail = (
        case.text[:start],
        case.text[start : start + length],
        case.text[start + length :],
    )
    for pieces in compositions(middle):
        check_tool_stream(case, [head, *pieces, tail], TOOLS)


def test_short_texts_every_small_split() -> None:
    for text in ["a<tool_c", "x\n<tool_call", "<<tool_ca>"]:
        for pieces in compositions(text):
            check_tool_stream(ToolCase(text, text, []), pieces, TOOLS)


def test_pass_through_without_tools_or_with_tool_choice_none() -> None:
    text = "Hi\n\n" + _block(WEATHER) + "\n"
    for case in (ToolCase(text, text, []),):
        for chunks in many_splits(text, count=30):
            check_tool_stream(case, chunks, TOOLS, tool_choice="none")
            check_tool_stream(case, chunks, None)
            check_tool_stream(case, chunks, [])


def test_named_tool_choice_and_parallel_off() -> None:
    text = _block(WEATHER, _call("ping", []), _call("get_weather", [("city", "B")]))
    named = {"type": "function", "function": {"name": "ping"}}
    for chunks in many_splits(text, count=30):
        check_tool_stream(ToolCase(text, None, [("ping", {})]), chunks, TOOLS, tool_choice=named)
        check_tool_stream(
            ToolCase(text, None, [("get_weather", {"city": "Paris", "days": 3})]),
            chunks,
            TOOLS,
            parallel_tool_calls=False,
        )
        check_tool_stream(
            ToolCase(
                text,
                None,
                [
                    ("get_weather", {"city": "Paris", "days": 3}),
                    ("ping", {}),
                    ("get_weather", {"city": "B"}),
                ],
            ),
            chunks,
            TOOLS,
            tool_choice="required",
        )


def _arguments_after(parser: ToolCallParser, text: str) -> str:
    return "".join(f.arguments for f in parser.feed(text).tool_calls)


def test_strings_stream_before_their_closer_and_other_values_wait() -> None:
    parser = ToolCallParser(TOOLS, seed=1)
    streamed = _arguments_after(parser, "<tool_call>\n<function=configure>\n<parameter=note>\n")
    streamed += _arguments_after(parser, "abc")
    assert streamed == '{"note": "abc'  # streamed with no closer in sight
    streamed += _arguments_after(parser, "def\n")
    assert streamed == '{"note": "abcdef'  # the newline may be the closer's: held
    streamed += _arguments_after(parser, "</parameter>\n<parameter=count>\n12")
    assert streamed == '{"note": "abcdef", "count": '
    streamed += _arguments_after(parser, "3\n</parameter>\n")
    assert streamed == '{"note": "abcdef", "count": '  # held until the function closes
    last = _arguments_after(parser, "</function>")
    assert last == "123}"
    assert json.loads(streamed + last) == {"note": "abcdef", "count": 123}
    assert parser.finish().tool_calls == []


def test_first_fragment_is_the_name_head() -> None:
    parser = ToolCallParser(TOOLS, seed=3)
    assert parser.feed("<tool_call>\n<function=ping").tool_calls == []
    (head,) = parser.feed(">\n").tool_calls
    assert (head.index, head.name, head.arguments) == (0, "ping", "{")
    assert head.to_openai() == {
        "index": 0,
        "id": head.id,
        "type": "function",
        "function": {"name": "ping", "arguments": "{"},
    }
    (tail,) = parser.feed("</function>\n</tool_call>").tool_calls
    assert tail.to_openai() == {"index": 0, "function": {"arguments": "}"}}


def test_call_ids_are_seeded_or_random() -> None:
    text = _block(_call("ping", []), _call("ping", []))

    def ids(seed: int | None) -> list[str]:
        return [c["id"] for c in parse_tool_calls(text, TOOLS, seed=seed).tool_calls]

    assert ids(5) == ids(5)
    assert ids(5) != ids(6)
    assert ids(None) != ids(None)
    assert all(CALL_ID.fullmatch(call_id) for call_id in ids(None) + ids(5))
    assert len(set(ids(5))) == 2


def test_finished_parser_refuses_more_input() -> None:
    parser = ToolCallParser(TOOLS)
    parser.feed("hi")
    assert parser.finish().content == ""
    with pytest.raises(ParserFinishedError):
        parser.feed("x")
    with pytest.raises(ParserFinishedError):
        parser.finish()
    assert parser.result().content == "hi"
