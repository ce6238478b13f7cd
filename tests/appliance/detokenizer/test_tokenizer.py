"""TextTokenizer (Rust tokenizer.json, no transformers) decodes exactly like transformers, and the
incremental detokenizer's text equals one full decode, on the project's real test tokenizer."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from appliance.detokenizer.detokenizer import Detokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import DetokParams, DetokRegister, RouterOutput, TokenUpdate
from appliance.testing.tokenizers import build_bpe_tokenizer


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_decode_matches_transformers(bpe_dir):
    fast = TextTokenizer.from_pretrained(bpe_dir)
    assert type(fast._backend).__name__ == "Tokenizer"  # the transformers-free path
    hf = AutoTokenizer.from_pretrained(str(bpe_dir))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert fast.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_incremental_equals_full_decode(bpe_dir):
    tok = TextTokenizer.from_pretrained(bpe_dir)
    hf = AutoTokenizer.from_pretrained(str(bpe_dir))
    rng = random.Random(1)
    for trial in range(40):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))]
        detok = Detokenizer(tok)
        detok.process(RouterOutput(registers=[DetokRegister("r", 1, DetokParams())]))
        text = ""
        for i, token in enumerate(ids):
            done = "length" if i == len(ids) - 1 else None
            out, _ = detok.process(RouterOutput(updates=[TokenUpdate("r", [token], done)]))
            text += "".join(d.text for d in out.deltas)
        assert text == hf.decode(ids, skip_special_tokens=True), trial
