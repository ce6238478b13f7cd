"""Fast decode and per-token text/bytes for one checkpoint's tokenizer.

Used by the detokenizer role (incremental.py, detokenizer.py). Loads `tokenizer.json` with the Rust
`tokenizers` library directly (no transformers, hence no torch import in this process) and falls
back to transformers only for checkpoints without it or with space clean-up enabled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable unicode stand-in char -> raw byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class _HFDecoder:
    """Adapter giving a transformers tokenizer the Rust Tokenizer's decode/id_to_token calls."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.decoder = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.convert_ids_to_tokens(token_id)


class TextTokenizer:
    """Decoding view of a tokenizer: `decode(ids)` plus cached (text, bytes) per token id.

    `backend` is a `tokenizers.Tokenizer`, or a transformers tokenizer (wrapped)."""

    def __init__(self, backend: Any, model_dir: str | Path | None = None) -> None:
        self._model_dir = model_dir
        self._hf = backend if not hasattr(backend, "id_to_token") else None
        if not hasattr(backend, "id_to_token"):  # a transformers tokenizer
            rust = getattr(backend, "backend_tokenizer", None)
            cleanup = bool(getattr(backend, "clean_up_tokenization_spaces", False))
            backend = rust if rust is not None and not cleanup else _HFDecoder(backend)
        self._backend = backend
        self._byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        # decode(a + b) == decode(a) + decode(b) when a ends on a character boundary
        self.concatenative = self._byte_level
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self._entries: dict[int, tuple[str, list[int]]] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        if (model_dir / "tokenizer.json").exists() and not config.get(
            "clean_up_tokenization_spaces", False
        ):
            from tokenizers import Tokenizer

            return cls(Tokenizer.from_file(str(model_dir / "tokenizer.json")), model_dir)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), model_dir)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (loaded on first use; the decode path never needs it)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self._model_dir))
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without added special tokens (as the server's prompts use)."""
        if isinstance(self._backend, _HFDecoder):
            return self._backend.hf.encode(text, add_special_tokens=False)
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_entry(self, token_id: int) -> tuple[str, list[int]]:
        """(text, raw UTF-8 bytes) of one token, as OpenAI logprobs report it."""
        entry = self._entries.get(token_id)
        if entry is None:
            entry = self._compute_entry(token_id)
            self._entries[token_id] = entry
        return entry

    def _compute_entry(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._backend.id_to_token(token_id)
        if piece is not None and self._byte_level and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
        else:
            raw = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)
