"""Chat rendering and the reduced tokenizer of the default model.

The template is the project's Qwen3.5 chat template (appliance/testing/tokenizers.CHAT_TEMPLATE:
ChatML turns, image parts, Qwen3-coder XML tools and calls, `<think>`, enable_thinking), rendered
with jinja2 the way transformers' `apply_chat_template` renders it (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `tojson`), so training prompts equal the server's byte for byte
(checked in tests/ops/test_train_default.py).

The tokenizer is a byte-level BPE with the Qwen3.5 pre-tokenizer (regex + NFC + ByteLevel), trained
on the training texts (vocab 2048: it must stay small, the 248k Qwen vocabulary alone would be
254 MB of embeddings at this width), plus the 33 Qwen3.5 added tokens (specials and the non-special
`<think>`, `<tool_call>`, ...). Any text round-trips (byte-level).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from appliance.testing import tokenizers as tok_lib

ADDED = tok_lib.QWEN3_5_ADDED


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


_TEMPLATE = _environment().from_string(tok_lib.CHAT_TEMPLATE)


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    enable_thinking: bool = True,
    add_generation_prompt: bool = True,
) -> str:
    kwargs = {"enable_thinking": enable_thinking}
    if tools:
        kwargs["tools"] = tools
    return _TEMPLATE.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
    )


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """BPE over `texts` with the Qwen3.5 pre-tokenizer; added tokens take the last ids."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = tok_lib._pre_tokenizer(tok_lib.QWEN3_5_REGEX)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    base = tok.get_vocab_size(with_added_tokens=False)
    tok_lib._add_tokens(tok, ADDED, base)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja (as transformers 5 writes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": tok_lib.MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(tok_lib.CHAT_TEMPLATE)


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {name: tok.token_to_id(name) for name in ADDED}
