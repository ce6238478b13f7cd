"""Incremental detokenization of one request: UTF-8-safe text deltas and stop strings.

Used by `Detokenizer` (detokenizer.py), one `RequestDetokenizer` per live request, and by the
offline `LLM` (add_token / stopped / flush / text).
"""

from __future__ import annotations

from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import DetokParams

REPLACEMENT = "\ufffd"


class RequestDetokenizer:
    """Turns a request's generated token ids into text, a token at a time.

    Two offsets into the generated ids bound the window that is re-decoded: text is produced only
    when the window decodes to something that does not end in U+FFFD, so a multibyte character split
    over several byte tokens is held until complete. Text that could be the start of a stop string
    stays unsent, so a stop string split across tokens never reaches the client; for the same reason
    a match can never begin inside text already sent, so only the unsent text is searched.
    """

    def __init__(self, tokenizer: TextTokenizer, params: DetokParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start (decoded text of [prefix, read) already counted)
        self._read_offset = 0  # window end of the text already turned into characters
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._sent: list[str] = []  # text handed out by take_delta
        self._sent_chars = 0  # len("".join(self._sent))
        # characters of text that the first min_tokens tokens decoded to: a stop string must end
        # past them (vLLM: stop strings are looked for once more than min_tokens are generated)
        self._min_chars = 0
        self._unsent = ""  # decoded text not handed out yet (held back, or not yet taken)
        self._stop_chars = frozenset("".join(params.stop))
        self.stopped = False  # a stop string matched: the text is final
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text so far (sent and unsent); after a stop, cut at the stop string."""
        return "".join(self._sent) + self._unsent

    # ------------------------------------------------------------------ decoding

    def add_token(self, token_id: int) -> None:
        """Append one generated token; may set `stopped` on a stop-string match."""
        assert not self.stopped, "token after a stop string"
        self.token_ids.append(token_id)
        skip = self.params.skip_special_tokens
        full = self.tokenizer.decode(
            self.token_ids[self._prefix_offset :], skip_special_tokens=skip
        )
        if full.endswith(REPLACEMENT):
            return  # an incomplete UTF-8 sequence: wait for the bytes that finish it
        new_text = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        if self.tokenizer.concatenative:
            # Byte-level decoding of complete characters is plain concatenation: the window just
            # consumed decodes to exactly the new text, so one decode per token suffices.
            self._prefix_text = new_text
        else:
            self._prefix_text = self.tokenizer.decode(
                self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
            )
        if new_text:
            self._append(new_text)

    def flush(self) -> None:
        """The request ended without a stop string: decode whatever is pending, even if invalid."""
        if self.stopped or self._read_offset == len(self.token_ids):
            return
        skip = self.params.skip_special_tokens
        full = self.tokenizer.decode(
            self.token_ids[self._prefix_offset :], skip_special_tokens=skip
        )
        self._read_offset = len(self.token_ids)
        self._append(full[len(self._prefix_text) :])

    # ------------------------------------------------------------------ stop strings

    def _append(self, new_text: str) -> None:
        unsent = self._unsent + new_text
        if len(self.token_ids) <= self.params.min_tokens:
            self._min_chars = self._sent_chars + len(unsent)
            self._unsent = unsent
            return
        if self._stop_chars:
            best: tuple[int, str] | None = None
            held = self._min_chars - self._sent_chars  # unsent characters no match may end in
            for stop in self.params.stop:
                pos = unsent.find(stop, max(0, held - len(stop) + 1))
                if pos >= 0 and (best is None or pos < best[0]):
                    best = (pos, stop)
            if best is not None:
                pos, stop = best
                unsent = unsent[
                    : pos + len(stop) if self.params.include_stop_str_in_output else pos
                ]
                self.stopped = True
                self.stop_reason = "stop"
        self._unsent = unsent

    def _held_back(self) -> int:
        """Characters at the end of the unsent text that could begin a stop string."""
        text = self._unsent
        if not text or text[-1] not in self._stop_chars:
            return 0
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def take_delta(self, final: bool = False) -> str:
        """Text ready for the client since the last call; `final` releases held-back text."""
        if not self._unsent:
            return ""
        keep = 0 if final or self.stopped else self._held_back()
        delta = self._unsent[: len(self._unsent) - keep]
        self._unsent = self._unsent[len(self._unsent) - keep :]
        if delta:
            self._sent.append(delta)
            self._sent_chars += len(delta)
        return delta
