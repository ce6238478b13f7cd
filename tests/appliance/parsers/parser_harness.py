"""Test helpers for the output parsers: chunk splitters and the streaming checks every case runs.

Imported by the tests in this directory (pytest puts the directory on sys.path).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from appliance.parsers import ReasoningParser, ToolCallParser, parse_tool_calls

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def compositions(text: str, max_piece: int = 3) -> Iterator[list[str]]:
    """Every split of `text` into pieces of 1..max_piece characters."""
    if not text:
        yield []
        return
    for size in range(1, min(max_piece, len(text)) + 1):
        for rest in compositions(text[size:], max_piece):
            yield [text[:size], *rest]


def two_cut_splits(text: str) -> Iterator[list[str]]:
    """Every split into three pieces (each cut pair i <= j), so every pair of boundaries is hit."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


def random_splits(text: str, rng: random.Random, count: int, max_piece: int) -> Iterator[list[str]]:
    for _ in range(count):
        pieces, at = [], 0
        while at < len(text):
            size = rng.randint(1, max_piece)
            pieces.append(text[at : at + size])
            at += size
        yield pieces


def many_splits(text: str, seed: int = 0, count: int = 240) -> Iterator[list[str]]:
    """The split set used for long inputs: whole, per character, every single cut, and `count`
    seeded random splits into 1..3-character pieces plus `count // 3` into 1..12-character ones."""
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield from random_splits(text, rng, count, 3)
    yield from random_splits(text, rng, count // 3, 12)


def _cut_points(arguments: dict) -> set[int]:
    """Lengths at which a streamed prefix of json.dumps(arguments) may stop: anywhere in keys and
    punctuation, at character-escape boundaries inside strings, only at either end of others."""
    text, cuts = "{", {0, 1}
    for position, (key, value) in enumerate(arguments.items()):
        head = (", " if position else "") + json.dumps(key) + ": "
        cuts.update(range(len(text), len(text) + len(head) + 1))
        text += head
        if isinstance(value, str):
            text += '"'
            cuts.add(len(text))
            for char in value:
                text += json.dumps(char)[1:-1]
                cuts.add(len(text))
            text += '"'
        else:
            text += json.dumps(value)
        cuts.add(len(text))
    text += "}"
    cuts.add(len(text))
    assert text == json.dumps(arguments)
    return cuts


@dataclass
class ToolCase:
    text: str
    content: str | None  # expected whole-response content
    calls: list[tuple[str, dict]]  # expected (name, arguments) in index order


def check_tool_stream(
    case: ToolCase,
    chunks: list[str],
    tools: list[dict] | None,
    compare_whole: bool = False,
    **parser_kwargs,
) -> None:
    """Feed `chunks`; assert every streaming invariant and the final calls and content."""
    assert "".join(chunks) == case.text
    finals = [json.dumps(arguments) for _, arguments in case.calls]
    cuts = [_cut_points(arguments) for _, arguments in case.calls]
    parser = ToolCallParser(tools, seed=7, **parser_kwargs)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    content, streamed, heads = "", [], []
    last_fragment: dict[int, str] = {}
    for delta in deltas:
        content += delta.content
        indexes = [fragment.index for fragment in delta.tool_calls]
        assert len(indexes) == len(set(indexes)), "one fragment per call per delta"
        for fragment in delta.tool_calls:
            if fragment.index == len(streamed):  # a new call: the head fragment
                assert fragment.id is not None and CALL_ID.fullmatch(fragment.id)
                assert fragment.name is not None
                heads.append((fragment.id, fragment.name))
                streamed.append("")
            else:
                assert fragment.index < len(streamed), "indexes appear in order"
                assert fragment.id is None and fragment.name is None
            streamed[fragment.index] += fragment.arguments
            last_fragment[fragment.index] = fragment.arguments
            index, so_far = fragment.index, streamed[fragment.index]
            assert index < len(finals), f"unexpected call {fragment.name!r}"
            assert finals[index].startswith(so_far), (so_far, finals[index])
            assert len(so_far) in cuts[index], f"cut inside a value: {so_far!r}"
    assert streamed == finals
    assert [name for _, name in heads] == [name for name, _ in case.calls]
    assert len({call_id for call_id, _ in heads}) == len(heads)
    for index, (_, arguments) in enumerate(case.calls):
        fragment = last_fragment[index]
        assert fragment.endswith("}")
        if arguments:  # the closing brace travels with the last argument bytes
            assert len(fragment) >= 2
    assert (content or None) == case.content
    assert parser.has_tool_calls == bool(case.calls)
    message = parser.result()
    assert message.content == case.content
    assert message.finish_reason_tool_calls == bool(case.calls)
    assert [(c["id"], c["function"]["name"]) for c in message.tool_calls] == heads
    assert [c["function"]["arguments"] for c in message.tool_calls] == finals
    assert all(c["type"] == "function" for c in message.tool_calls)
    if compare_whole:  # the one-shot helper gives the same message
        assert parse_tool_calls(case.text, tools, seed=7, **parser_kwargs) == message


def check_reasoning_stream(
    text: str, chunks: list[str], reasoning: str | None, content: str | None, **parser_kwargs
) -> None:
    assert "".join(chunks) == text
    parser = ReasoningParser(**parser_kwargs)
    got_reasoning, got_content = "", ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        got_reasoning, got_content = got_reasoning + r, got_content + c
        assert (reasoning or "").startswith(got_reasoning)
        assert (content or "").startswith(got_content)
    r, c = parser.finish()
    got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning or None, got_content or None) == (reasoning, content)
