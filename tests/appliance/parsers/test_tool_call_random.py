"""Qwen3-coder tool-call parser on seeded random responses: random calls, values, text and missing
closers, each fed at random chunkings; expected calls come from the generator, not the parser."""

from __future__ import annotations

import json
import random

import pytest
from parser_harness import ToolCase, check_tool_stream, random_splits

SCHEMAS = {
    "text": {"type": "string"},
    "label": {"type": "string"},
    "count": {"type": "integer"},
    "scale": {"type": "number"},
    "flag": {"type": "boolean"},
    "items": {"type": "array"},
    "meta": {"type": "object"},
    "maybe": {"type": ["string", "null"]},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "alpha", "parameters": {"type": "object", "properties": SCHEMAS}},
    },
    {
        "type": "function",
        "function": {
            "name": "beta",
            "parameters": {
                "type": "object",
                "properties": {k: SCHEMAS[k] for k in ("text", "count")},
            },
        },
    },
]
PARAMS = {"alpha": list(SCHEMAS), "beta": ["text", "count"]}
_TERMINATORS = ("</parameter>", "<parameter=", "</function>", "<function=", "</tool_call>")
_PIECES = [
    "a",
    "Z",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    '"',
    "\\",
    "\\n",
    "😀",
    "日本",
    "é",
    "\x00",
    "\x1f",
    "\u2028",
    "<",
    ">",
    "/",
    "</para",
    "<parame",
    "</func",
    "</tool_cal",
    "<tool_c",
    "null",
    "nul",
    "N",
    "{",
    "}",
    "[1, 2]",
    "&amp;",
    "\r",
]


def _random_string(rng: random.Random) -> str:
    while True:
        value = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 14)))
        if not any(tag in value for tag in _TERMINATORS):
            return value


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-(10**12), 10**12)
    if kind == "float":
        return rng.choice([0.5, -1.25e-7, 3.0, 1e21, rng.random()])
    if kind == "str":
        return rng.choice(["", "x", 'q"t', "b\\s", "ü😀", "<b>"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _random_value(rng: random.Random, param: str) -> tuple[str, object]:
    """(text the model writes, the JSON value the parser must produce)."""
    if param in ("text", "label") or (param == "maybe" and rng.random() < 0.7):
        text = _random_string(rng)
        return text, None if text.lower() == "null" else text
    if param == "maybe":
        return rng.choice(["null", "NULL"]), None
    if param == "count":
        number = rng.randint(-(10**15), 10**15)
        return rng.choice([str(number), f" {number} "]), number
    if param == "scale":
        number = rng.choice([rng.random() * 100, -2.5, 1e-9, float(rng.randint(0, 9))])
        return repr(number), number
    if param == "flag":
        flag = rng.random() < 0.5
        return rng.choice([str(flag), str(flag).lower(), str(flag).upper()]), flag
    if param == "items":
        items = [_random_json(rng, 1) for _ in range(rng.randint(0, 4))]
        return json.dumps(items, ensure_ascii=rng.random() < 0.5), items
    meta = {f"m{i}": _random_json(rng, 1) for i in range(rng.randint(0, 3))}
    return json.dumps(meta, ensure_ascii=rng.random() < 0.5), meta


def _partial_closer(text: str) -> int:
    """Length of the longest end of `text` that begins a terminator without completing it."""
    return max(
        (k for t in _TERMINATORS for k in range(1, len(t)) if text.endswith(t[:k])), default=0
    )


def _random_function(rng: random.Random, last: bool) -> tuple[str, tuple[str, dict] | None, bool]:
    """(rendered function block, expected call or None if undefined, truncated?)."""
    defined = rng.random() < 0.85
    name = rng.choice(list(PARAMS)) if defined else rng.choice(["gamma", "alpha_x", "alph"])
    pool = PARAMS.get(name, ["text", "count"])
    names = rng.sample(pool, rng.randint(0, min(3, len(pool))))
    parts, arguments = [f"<function={name}>\n"], {}
    truncated = False
    for position, param in enumerate(names):
        raw, value = _random_value(rng, param)
        final_param = last and position == len(names) - 1
        if final_param and rng.random() < 0.25 and param in ("text", "label"):
            # cut the output inside this string value: EOS with no closers at all
            raw = raw[: rng.randint(0, len(raw))]
            value = raw[: len(raw) - _partial_closer(raw)]  # the tag being written: dropped
            value = value[:-1] if value.endswith("\n") else value
            value = None if value.lower() == "null" else value
            parts.append(f"<parameter={param}>\n{raw}")
            arguments[param] = value
            truncated = True
            break
        closer = "\n</parameter>\n" if rng.random() < 0.85 else "\n"  # a missing </parameter>
        parts.append(f"<parameter={param}>\n{raw}{closer}")
        arguments[param] = value
    if not truncated and rng.random() < 0.85:
        parts.append("</function>\n")
    return "".join(parts), ((name, arguments) if defined else None), truncated


def random_case(rng: random.Random) -> ToolCase:
    text = rng.choice(["", "", "I'll look that up.", 'Über 😀 "quoted" <b>'])
    content, calls = text, []
    blocks = rng.randint(1, 3)
    for block in range(blocks):
        text += rng.choice(["", "\n", "\n\n", " "]) + "<tool_call>\n"
        functions = rng.randint(1, 2)
        truncated = False
        for position in range(functions):
            last = block == blocks - 1 and position == functions - 1
            rendered, call, truncated = _random_function(rng, last)
            text += rendered
            if call is not None:
                calls.append(call)
        if truncated or (block == blocks - 1 and rng.random() < 0.2):
            break  # EOS without </tool_call>
        text += "</tool_call>"
        if rng.random() < 0.3:
            between = rng.choice(["\n\n", " ", ""]) + rng.choice(["Then:", "ok", "<b>x</b>"])
            text += between
            content += between
        elif rng.random() < 0.3:
            text += rng.choice(["\n", "\n\n  "])  # whitespace only: dropped
    return ToolCase(text, content or None, calls)


@pytest.mark.parametrize("seed", range(8))
def test_random_responses_at_random_chunkings(seed: int) -> None:
    rng = random.Random(seed)
    for case_number in range(20):
        case = random_case(rng)
        chunkings = [[case.text], list(case.text)]
        chunkings += random_splits(case.text, rng, 12, 3)
        chunkings += random_splits(case.text, rng, 6, 20)
        for number, chunks in enumerate(chunkings):
            try:
                check_tool_stream(case, chunks, TOOLS, compare_whole=number == 0)
            except AssertionError as error:
                raise AssertionError(f"seed {seed} case {case_number}: {case.text!r}") from error
