"""Incremental detokenization of one request: UTF-8-safe text deltas and stop strings.

Used by `Detokenizer` (detokenizer.py), one `RequestDetokenizer` per live request.
"""

from __future__ import annotations

from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import DetokParams

REPLACEMENT = "\ufffd"


class RequestDetokenizer:
    """Turns a request's generated token ids into text, a token at a time.

    Two offsets into the generated ids bound the window that is re-decoded: text is emitted only when
    the window decodes to something that does not end in U+FFFD, so a multibyte character split over
    several byte tokens is held until complete. Text that could be the start of a stop string is held
    back as well, so a stop string split across tokens never reaches the client.
    """

    def __init__(self, tokenizer: TextTokenizer, params: DetokParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start (decoded text of [prefix, read) already counted)
        self._read_offset = 0  # window end of the text already turned into characters
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self.text = ""  # all decoded characters so far (held-back ones included)
        self.emitted = 0  # characters of `text` already sent to the client
        self.stopped = False  # a stop string matched: text is final
        self.stop_reason: str | None = None

    # ------------------------------------------------------------------ decoding

    def add_token(self, token_id: int) -> None:
        """Append one generated token; updates `text`, and `stopped` on a stop-string match."""
        assert not self.stopped, "token after a stop string"
        self.token_ids.append(token_id)
        skip = self.params.skip_special_tokens
        window = self.token_ids[self._prefix_offset:]
        full = self.tokenizer.decode(window, skip_special_tokens=skip)
        if full.endswith(REPLACEMENT):
            return  # an incomplete UTF-8 sequence: wait for the bytes that finish it
        new_text = full[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self.tokenizer.decode(
            self.token_ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        if new_text:
            self._append_text(new_text)

    def flush(self) -> None:
        """The request ended without a stop string: decode whatever is pending, even if invalid."""
        if self.stopped or self._read_offset == len(self.token_ids):
            return
        skip = self.params.skip_special_tokens
        full = self.tokenizer.decode(self.token_ids[self._prefix_offset:], skip_special_tokens=skip)
        self._read_offset = len(self.token_ids)
        self._append_text(full[len(self._prefix_text):])

    # ------------------------------------------------------------------ stop strings

    def _append_text(self, new_text: str) -> None:
        old_len = len(self.text)
        self.text += new_text
        stops = self.params.stop
        if not stops:
            return
        longest = max(len(s) for s in stops)
        start = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            pos = self.text.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            pos, stop = best
            end = pos + len(stop) if self.params.include_stop_str_in_output else pos
            self.text = self.text[:end]
            self.emitted = min(self.emitted, end)
            self.stopped = True
            self.stop_reason = "stop"

    def _held_back(self) -> int:
        """Characters at the end of `text` that could begin a stop string."""
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def take_delta(self, final: bool = False) -> str:
        """Text ready for the client since the last call; `final` releases held-back text."""
        end = len(self.text)
        if not final and not self.stopped and self.params.stop:
            end -= self._held_back()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
