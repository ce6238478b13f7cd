"""Fast decode and per-token text/bytes for one checkpoint's tokenizer.

Used by the detokenizer role (incremental.py, detokenizer.py); loads the HF tokenizer once and decodes
through its Rust backend when that gives the same text as transformers' `decode`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable unicode stand-in char -> raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TextTokenizer:
    """Decoding view of a tokenizer: `decode(ids)` plus cached (text, bytes) per token id."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleanup = bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False))
        # The Rust decode skips transformers' Python overhead; only valid without space cleanup.
        self._backend = backend if (backend is not None and not cleanup) else None
        self._special_ids = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
        self._byte_level = self._backend is not None and "ByteLevel" in str(
            type(self._backend.decoder))
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self._entries: dict[int, tuple[str, list[int]]] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TextTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_entry(self, token_id: int) -> tuple[str, list[int]]:
        """(text, raw UTF-8 bytes) of one token, as OpenAI logprobs report it."""
        entry = self._entries.get(token_id)
        if entry is None:
            entry = self._compute_entry(token_id)
            self._entries[token_id] = entry
        return entry

    def _compute_entry(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._backend.id_to_token(token_id) if self._backend is not None else None
        if piece is not None and self._byte_level and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
        else:
            raw = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)
