"""A tiny byte-level BPE tokenizer (trained in ~0.1 s) for detokenizer tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from appliance.detokenizer.tokenizer import TextTokenizer

CORPUS = [
    "hello world, this is a small test corpus for the detokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here and stop there.",
    "def main():\n    return 42\n",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_hf_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


@pytest.fixture(scope="session")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    return build_hf_tokenizer()


@pytest.fixture(scope="session")
def text_tokenizer(hf_tokenizer) -> TextTokenizer:
    return TextTokenizer(hf_tokenizer)
