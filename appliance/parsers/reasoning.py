r"""Reasoning parser: splits model text into `reasoning_content` (`<think>…</think>`) and content.

The chat endpoint makes one `ReasoningParser` per choice and feeds its content output on to the tool
parser; `split_reasoning()` is the whole-response view.

Qwen3.5's template ends a thinking prompt with `<think>\n`, so the output starts inside reasoning
(`starts_in_reasoning=True`, see `prompt_opens_reasoning`); with `enable_thinking=False` it ends
with `<think>\n\n</think>\n\n` and the output is plain content. Older templates leave `<think>`
to the model: with `starts_in_reasoning=False` a `<think>` at the very start of the output (after
optional whitespace) opens reasoning, and anything else makes the whole output content. A stray
`<think>` at the start is skipped in either mode. Reasoning without `</think>` (cut by max_tokens)
is all reasoning. Like Qwen's template, newlines around the reasoning and at the start of the
content after `</think>` are dropped. Partial tags at chunk edges are held until decided.
"""

from __future__ import annotations

from typing import Any

from appliance.parsers.qwen3_coder import ParserFinishedError

THINK_START = "<think>"
THINK_END = "</think>"
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def marker_id(tokenizer: Any, marker: str) -> int | None:
    """The tokenizer's id of `marker` (THINK_START / THINK_END) when it is one token of its
    own, else None (a tokenizer without reasoning markers)."""
    token_id = tokenizer.convert_tokens_to_ids(marker)
    if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == marker:
        return token_id
    return None


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves the model inside `<think>` (thinking enabled)."""
    return prompt.rstrip().endswith(THINK_START)


def reasoning_token_count(output_ids: list[int], think_end: int | None, has_reasoning: bool) -> int:
    """OpenAI's `reasoning_tokens` of an answer that has reasoning: its output tokens up to and
    including `</think>` (`think_end`, its token id), all of them when the reasoning was cut
    short (or the tokenizer has no such token); 0 for an answer without reasoning."""
    if not has_reasoning:
        return 0
    if think_end is not None and think_end in output_ids:
        return output_ids.index(think_end) + 1
    return len(output_ids)


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (starts with '<')."""
    start = text.find("<", max(0, len(text) - len(tag) + 1))
    while start >= 0:
        if tag.startswith(text[start:]):
            return len(text) - start
        start = text.find("<", start + 1)
    return 0


class ReasoningParser:
    """Incremental `<think>` splitter for one choice of one request."""

    def __init__(self, starts_in_reasoning: bool = False, enabled: bool = True) -> None:
        """`enabled=False` makes every character content (no reasoning separation)."""
        self._enabled = enabled
        self._state = _START
        self._untagged = _REASONING if starts_in_reasoning else _CONTENT  # if no <think> comes
        self._pending = ""
        self._newlines = ""  # trailing newlines of the reasoning, held until more reasoning comes
        self._reasoning_started = False
        self._after_think = False  # content follows a </think>: drop its leading newlines
        self._content_started = False
        self._finished = False

    def feed(self, text_delta: str) -> tuple[str, str]:
        """Consume the next text delta; return (reasoning_delta, content_delta)."""
        if self._finished:
            raise ParserFinishedError("feed() after finish()")
        if not self._enabled:
            return "", text_delta
        self._pending += text_delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """End of generation: release held text; (reasoning_delta, content_delta)."""
        if self._finished:
            raise ParserFinishedError("finish() called twice")
        self._finished = True
        if not self._enabled:
            return "", ""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == _START:
                if not self._step_start(final):
                    break
            elif self._state == _REASONING:
                reasoning.append(self._step_reasoning(final))
                if self._state == _REASONING:
                    break
            else:
                content.append(self._content(self._pending))
                self._pending = ""
                break
        return "".join(reasoning), "".join(content)

    def _step_start(self, final: bool) -> bool:
        """Decide whether the output opens with `<think>`; False while undecided."""
        head = self._pending.lstrip()
        if head.startswith(THINK_START):
            self._pending = head[len(THINK_START) :]
            self._state = _REASONING
            return True
        if not final and THINK_START.startswith(head):  # empty, or a partial tag
            return False
        self._state = self._untagged
        return True

    def _step_reasoning(self, final: bool) -> str:
        at = self._pending.find(THINK_END)
        if at >= 0:
            text = self._reasoning(self._pending[:at], closing=True)
            self._pending = self._pending[at + len(THINK_END) :]
            self._state, self._after_think = _CONTENT, True
            return text
        keep = 0 if final else _held_suffix(self._pending, THINK_END)
        text = self._reasoning(self._pending[: len(self._pending) - keep], closing=final)
        self._pending = self._pending[len(self._pending) - keep :]
        return text

    def _reasoning(self, text: str, closing: bool) -> str:
        text = self._newlines + text
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        body = text.rstrip("\n")
        self._newlines = "" if closing else text[len(body) :]
        return body

    def _content(self, text: str) -> str:
        if self._after_think and not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str | None]:
    """Whole-response split: (reasoning_content or None, content or None)."""
    parser = ReasoningParser(starts_in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2) or None, (c1 + c2) or None
