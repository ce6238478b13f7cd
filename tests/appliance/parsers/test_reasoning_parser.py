"""Reasoning parser: `<think>` splitting across every small chunking, both template modes."""

from __future__ import annotations

import pytest
from parser_harness import check_reasoning_stream, compositions, many_splits

from appliance.parsers import (
    ParserFinishedError,
    ReasoningParser,
    prompt_opens_reasoning,
    split_reasoning,
)

# (output, starts_in_reasoning, reasoning, content)
SHORT = [
    ("r\n</think>\n\nc", True, "r", "c"),
    ("<think>r</think>c", False, "r", "c"),
    ("<think>\n\n</think>", False, None, None),
    ("r</thi", True, "r</thi", None),  # no closing tag: everything is reasoning
    ("<think>a\n\nb", False, "a\n\nb", None),
    ("<thi", False, None, "<thi"),  # not a tag after all
    ("<b>x</think>", False, None, "<b>x</think>"),  # no <think> at the start: all content
    ("\n <think>x", False, "x", None),
    ("<think>x", True, "x", None),  # a repeated <think> after the template's is skipped
    ("</think>\n\nc", True, None, "c"),
    ("<</think><think>", True, "<", "<think>"),
]


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), SHORT)
def test_every_small_split(
    text: str, starts: bool, reasoning: str | None, content: str | None
) -> None:
    assert len(text) <= 17
    for pieces in compositions(text):
        check_reasoning_stream(text, pieces, reasoning, content, starts_in_reasoning=starts)
    assert split_reasoning(text, starts) == (reasoning, content)


LONG_REASONING = "Let me think.\n\nThe user wants 2+2 😀 — <b>not a tag</b> <think inside.\n"
LONG = [
    (LONG_REASONING + "</think>\n\nIt is 4.\n", True, LONG_REASONING.strip("\n"), "It is 4.\n"),
    (
        "<think>\n" + LONG_REASONING + "</think>\n\n<tool_call>\n",
        False,
        LONG_REASONING.strip("\n"),
        "<tool_call>\n",
    ),
    ("<think>\nr\n</think>", False, "r", None),
    (
        "Plain answer with <think> and </think> inside.\n\n",
        False,
        None,
        "Plain answer with <think> and </think> inside.\n\n",
    ),
    (LONG_REASONING * 3, True, (LONG_REASONING * 3).strip("\n"), None),
]


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), LONG)
def test_long_outputs_at_many_chunkings(
    text: str, starts: bool, reasoning: str | None, content: str | None
) -> None:
    for chunks in many_splits(text, seed=len(text)):
        check_reasoning_stream(text, chunks, reasoning, content, starts_in_reasoning=starts)


def test_disabled_parser_passes_everything_as_content() -> None:
    text = "<think>x</think>y"
    for chunks in many_splits(text, count=20):
        check_reasoning_stream(text, chunks, None, text, starts_in_reasoning=True, enabled=False)


def test_prompt_opens_reasoning_matches_the_template_endings() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_reasoning_streams_before_the_closing_tag() -> None:
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("abc") == ("abc", "")
    assert parser.feed("\n</thi") == ("", "")  # newline and partial tag held
    assert parser.feed("nk>\n\nAn") == ("", "An")
    assert parser.feed("swer") == ("", "swer")
    assert parser.finish() == ("", "")
    with pytest.raises(ParserFinishedError):
        parser.feed("x")
