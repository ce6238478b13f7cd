"""User-facing, vLLM-style sampling parameters with validation; `to_options()` is the worker's view,
`to_detok()` the detokenizer's.

Built by the OpenAI server (from request fields) and by users of the offline `LLM`. Validation
raises ValueError naming the field and the accepted values (mapped to HTTP 400 by the server).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from appliance.messages import DetokParams, Guide, RepetitionCheck, SamplingOptions

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_TOKEN_ID = 2**31  # token ids travel as int32 on the worker
MAX_LOGIT_BIAS = 100.0  # OpenAI's logit_bias range is [-100, 100]


def _check(cond: bool, name: str, accepted: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {accepted}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    max_tokens: int | None = 16  # generated tokens at most; None = what the context leaves (vLLM)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely); 0 = off
    seed: int | None = None  # per-request sampling seed; None = drawn by the router at admission
    stop: str | list[str] | None = None  # stop strings (matched by the detokenizer)
    # extra token ids that end generation; their text, as eos's, is left out of the output unless
    # include_stop_str_in_output
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # keep generating past eos (stop_token_ids still apply)
    presence_penalty: float = 0.0  # OpenAI: subtract once per token present in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # HF: divide positive / multiply negative logits of seen tokens
    logprobs: int | None = None  # None = off; k = sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # None = off; k = each prompt token's logprob plus the top k
    skip_special_tokens: bool = True  # detokenizer: drop special tokens from the text
    include_stop_str_in_output: bool = False  # detokenizer: keep the stop string / token's text
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to its logit
    guide: Guide | None = None  # structured output: Guide("json_schema" / "regex" / "grammar", ..)
    # vLLM's: eos (unless ignore_eos) and stop_token_ids are not sampled before min_tokens tokens,
    # and a stop string ends the text only past those tokens' text
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these ids
    # vLLM's structured outputs, offline: one of json / regex / choice / grammar / json_object, a
    # dict or an object with those attributes (StructuredOutputsParams); the LLM makes the guide
    structured_outputs: object | None = None
    guided_decoding: object | None = None  # vLLM's older name of structured_outputs
    # vLLM's: only the prompt's last k tokens are fed (-1: the context length); offline only (the
    # server reads the request field, appliance/server/prompts.py kept_tokens)
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never to complete in the output; the LLM and the server tokenize them
    # (tokenize_bad_words) into bad_words_token_ids, which the worker reads
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: tokens of reasoning (after <think>) before </think> is forced; None or -1 = no
    # limit. The LLM and the server fill reasoning_token_ids (<think>, </think>) from their
    # tokenizer (with_reasoning_tokens)
    thinking_token_budget: int | None = None
    reasoning_token_ids: tuple[int, int] | None = None
    # vLLM's: end the request ("repetition") once its output ends with a pattern repeated:
    # {"max_pattern_size", "min_pattern_size", "min_count"} as a dict or an object with those
    # attributes (vLLM's RepetitionDetectionParams); max_pattern_size 0 = off
    repetition_detection: object | None = None

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", list(self.allowed_token_ids))
        if self.bad_words is not None:
            object.__setattr__(self, "bad_words", list(self.bad_words))
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens < 2**63),
            "max_tokens",
            "None (what the context leaves) or a 64-bit integer >= 1",
            self.max_tokens,
        )
        t = self.temperature
        _check(_is_number(t) and t >= 0, "temperature", "a number >= 0", t)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            _is_int(self.top_k) and -1 <= self.top_k < 2**63,
            "top_k",
            "-1 or 0 (off) or a 64-bit integer >= 1",
            self.top_k,
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63),
            "seed",
            "None or a 64-bit integer",
            self.seed,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a non-empty string or a list of them",
            self.stop,
        )
        _check(
            all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids),
            "stop_token_ids",
            f"a list of token ids in [0, {MAX_TOKEN_ID})",
            self.stop_token_ids,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        rp = self.repetition_penalty
        _check(_is_number(rp) and rp > 0, "repetition_penalty", "a number > 0", rp)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
                value,
            )
        self._validate_logit_bias()
        mt = self.min_tokens
        _check(
            _is_int(mt) and 0 <= mt <= (2**63 if self.max_tokens is None else self.max_tokens),
            "min_tokens",
            f"an integer in [0, max_tokens ({self.max_tokens})]",
            mt,
        )
        allowed = self.allowed_token_ids
        _check(
            allowed is None
            or (bool(allowed) and all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in allowed)),
            "allowed_token_ids",
            f"None or a non-empty list of token ids in [0, {MAX_TOKEN_ID})",
            allowed,
        )
        keep = self.truncate_prompt_tokens
        _check(
            keep is None or (_is_int(keep) and (keep == -1 or keep >= 1)),
            "truncate_prompt_tokens",
            "None, -1 (the context length) or an integer >= 1",
            keep,
        )
        _check(
            self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            "None or a list of words (non-blank strings)",
            self.bad_words,
        )
        budget = self.thinking_token_budget
        _check(
            budget is None or (_is_int(budget) and -1 <= budget < 2**63),
            "thinking_token_budget",
            "None, -1 (no limit) or an integer >= 0",
            budget,
        )
        self.repetition_check()  # raises on a bad repetition_detection
        given = [n for n in ("guide", "structured_outputs", "guided_decoding") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: only one output constraint per request")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raises ValueError naming the first stop or allowed token id past the tokenizer's
        vocabulary [0, vocab_size) (the checks above only know the wire's bound). The server and
        the offline LLM call it once they know their tokenizer."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = next((t for t in getattr(self, name) or [] if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"{name}: token id {bad} is not in the vocabulary (0..{vocab_size - 1})"
                )

    def tokenize_bad_words(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These parameters with bad_words_token_ids filled from bad_words (vLLM's reading): each
        word as written (leading spaces dropped), and again after a space when that spells it
        with another first token in as many tokens (a word mid-text), so both are banned.
        `encode`: the tokenizer's, without special tokens."""
        if not self.bad_words:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return dataclasses.replace(self, bad_words_token_ids=sequences)

    def repetition_check(self) -> RepetitionCheck | None:
        """repetition_detection as the router checks it (None: off)."""
        given = self.repetition_detection
        if given is None:
            return None
        fields = ("max_pattern_size", "min_pattern_size", "min_count")
        if isinstance(given, dict):
            unknown = sorted(set(given) - set(fields))
            _check(not unknown, "repetition_detection", f"keys among {fields}", unknown)
            values = [given.get(name, 0) for name in fields]
        else:
            values = [getattr(given, name, 0) for name in fields]
        _check(
            all(_is_int(v) and 0 <= v < 2**31 for v in values),
            "repetition_detection",
            "max_pattern_size, min_pattern_size and min_count as integers >= 0",
            values,
        )
        largest, smallest, count = values
        if largest == 0:
            return None
        _check(
            smallest <= largest,
            "repetition_detection",
            f"min_pattern_size <= max_pattern_size ({largest})",
            smallest,
        )
        _check(count >= 2, "repetition_detection", "min_count >= 2", count)
        return RepetitionCheck(max(smallest, 1), largest, count)

    @property
    def thinking_budget(self) -> int:
        """The thinking_token_budget in force: -1 for none."""
        budget = self.thinking_token_budget
        return -1 if budget is None else budget

    def with_reasoning_tokens(self, start: int | None, end: int | None) -> SamplingParams:
        """These parameters with the tokenizer's <think> / </think> ids, which a
        thinking_token_budget needs (ValueError naming it when the tokenizer has none)."""
        if self.thinking_budget < 0:
            return self
        if start is None or end is None:
            raise ValueError(
                "thinking_token_budget: the model's tokenizer has no <think> and </think> "
                "tokens, so there is no reasoning to limit"
            )
        return dataclasses.replace(self, reasoning_token_ids=(start, end))

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias", "None or a dict", bias)
        for token_id, value in (bias or {}).items():
            _check(
                _is_int(token_id) and 0 <= token_id < MAX_TOKEN_ID,
                "logit_bias",
                f"token ids in [0, {MAX_TOKEN_ID})",
                token_id,
            )
            _check(
                _is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (token {token_id})",
                value,
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def choice_options(self, choice: int, guide: Guide | None = None) -> SamplingOptions:
        """The worker's knobs for choice `choice` of n: a given seed is offset so choices differ
        (wrapping, a 64-bit integer still); `guide` replaces this one's (the server compiles)."""
        options = self.to_options()
        if guide is not None:
            options = msgspec.structs.replace(options, guide=guide)
        if options.seed is not None and choice:
            seed = (options.seed + choice + 2**63) % 2**64 - 2**63
            options = msgspec.structs.replace(options, seed=seed)
        return options

    def to_options(self) -> SamplingOptions:
        """The worker's view: top_k 0 becomes -1 (off); stop strings and n stay with their owners.
        A None seed stays None here: the router draws it at admission."""
        return SamplingOptions(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=-1 if self.top_k == 0 else self.top_k,
            min_p=float(self.min_p),
            seed=self.seed,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias={t: float(b) for t, b in (self.logit_bias or {}).items() if b},
            guide=self.guide,
            min_tokens=self.min_tokens,
            allowed_token_ids=sorted(set(self.allowed_token_ids or [])),
            bad_words=self._bad_word_ids(),
            **self._thinking_options(),
        )

    def _thinking_options(self) -> dict[str, int]:
        if self.thinking_budget < 0:
            return {}
        if self.reasoning_token_ids is None:
            raise ValueError(
                "thinking_token_budget: the <think> / </think> ids are not set "
                "(SamplingParams.with_reasoning_tokens)"
            )
        start, end = self.reasoning_token_ids
        return {"thinking_budget": self.thinking_budget, "think_start": start, "think_end": end}

    def _bad_word_ids(self) -> list[list[int]]:
        if self.bad_words and self.bad_words_token_ids is None:
            raise ValueError("bad_words: not tokenized (SamplingParams.tokenize_bad_words)")
        return [list(ids) for ids in self.bad_words_token_ids or [] if ids]

    def to_detok(self) -> DetokParams:
        """The detokenizer's view: stop strings (held by min_tokens), special tokens, logprob
        entries."""
        return DetokParams(
            stop=list(self.stop),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs is not None,
            min_tokens=self.min_tokens,
        )
