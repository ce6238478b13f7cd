"""OpenAI request schemas (pydantic, validated by FastAPI) and the shared sampling-field checks.

Used by app.py (route signatures) and serving*.py. Type errors become 400s naming the field
through errors.py; value rules that pydantic cannot express are SamplingParams', applied by
`sampling_params()`.
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.sampling_params import SamplingParams
from appliance.server.errors import BadRequest

MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
# /v1/completions: vLLM sets no limit, and lm-eval's local-completions sends a task's `until` plus
# eos uncapped (humaneval: 6); a bound all the same, each string is searched in every delta
MAX_COMPLETION_STOP_SEQUENCES = 64


INT64_MAX = 2**63 - 1


def documented(**bounds: float) -> Any:
    """An optional field whose range is stated in the OpenAPI schema (JSON Schema keywords) and
    checked by SamplingParams, not by pydantic."""
    return Field(None, json_schema_extra=bounds)


class _Schema(BaseModel):
    # Unknown fields (store, metadata, user, ...) are accepted and ignored, as OpenAI servers do.
    # Strict types, as OpenAI checks them: no "2" or 2.0 or true for an integer, no "yes" for a
    # boolean (in particular `"prompt": [[false]]` is not a token-id prompt).
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for a field that has a default but no null of its own (`n`, `stream`,
        `logprobs`, `echo` ...) means its default: OpenAI's spec marks them nullable and the SDKs
        send None as null, as vLLM reads them."""
        if isinstance(data, dict):
            defaulted = _defaulted_not_nullable(cls)
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


@functools.cache
def _defaulted_not_nullable(cls: type[BaseModel]) -> frozenset[str]:
    names = set()
    for name, info in cls.model_fields.items():
        if info.is_required():
            continue
        nullable = get_origin(info.annotation) in (Union, types.UnionType) and type(
            None
        ) in get_args(info.annotation)
        if not nullable:
            names.add(name)
    return frozenset(names)


class TextPart(_Schema):
    type: Literal["text"]
    text: str


class ImageURL(_Schema):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _chat_part(part: Any) -> Any:
    """The Responses API's spellings, which vLLM also takes in chat messages, as chat parts:
    {"type": "input_text", "text"} and {"type": "input_image", "image_url": "<url>", "detail"}."""
    if not isinstance(part, dict):
        return part
    if part.get("type") == "input_text":
        return {**part, "type": "text"}
    if part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
        image = {"url": part["image_url"], "detail": part.get("detail")}
        return {"type": "image_url", "image_url": image}
    if part.get("type") == "input_image" and isinstance(part.get("image_url"), dict):
        return {"type": "image_url", "image_url": part["image_url"]}  # the chat form inside
    return part


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _responses_parts(cls, content: Any) -> Any:
        return [_chat_part(p) for p in content] if isinstance(content, list) else content


class StreamOptions(_Schema):
    # Unknown keys are refused (400 naming stream_options), unlike elsewhere: a misspelt
    # include_usage would otherwise silently drop the usage chunk.
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's; accepted and ignored (no obfuscation here)
    # vLLM's (guidellm sends it): with include_usage, every chunk's usage counts the tokens so far
    continuous_usage_stats: bool = False


class _SamplingFields(_Schema):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    max_stop_sequences: ClassVar[int] = MAX_STOP_SEQUENCES  # the route's limit on `stop`

    model: str | None = None
    # Types here; value ranges are SamplingParams' (one rule set with the offline LLM), described
    # (not enforced) by `documented` so the OpenAPI schema states them too.
    n: int = Field(1, ge=1)
    temperature: float | None = documented(minimum=0)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=-1, maximum=INT64_MAX)
    min_p: float | None = documented(minimum=0, maximum=1)
    seed: int | None = documented(minimum=-INT64_MAX - 1, maximum=INT64_MAX)
    stop: str | list[str] | None = None  # at most max_stop_sequences (checked in sampling_params)
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = documented(exclusiveMinimum=0)
    ignore_eos: bool = False
    # vLLM's: eos, stop_token_ids and stop strings held back for the first min_tokens tokens;
    # sampling among allowed_token_ids only
    min_tokens: int | None = documented(minimum=0)
    allowed_token_ids: list[int] | None = None
    # vLLM's: score the prompt, each token's logprob, vocabulary rank and top k alternatives
    # (0: only the token itself); not with stream (check_prompt_logprobs)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: every logprob token string of the answer is "token_id:<id>", not the token's text
    return_tokens_as_token_ids: bool = False
    # vLLM's: words the output never completes (SamplingParams.tokenize_bad_words)
    bad_words: list[str] | None = None
    # vLLM's: lower is admitted first; only with --scheduling-policy priority (else 0)
    priority: int = 0
    # vLLM's beam search (server/serving_beam.py): n beams, length_penalty the exponent of its
    # length normalisation (read only with use_beam_search, as vLLM reads it)
    use_beam_search: bool = False
    length_penalty: float | None = None
    # vLLM's per-request image resize range: min_pixels / max_pixels / size {shortest_edge,
    # longest_edge}; checked by appliance/server/images.py (request_preprocess)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the context length); prompts.kept_tokens
    truncate_prompt_tokens: int | None = None
    # vLLM's: the prompt shares cached prefixes (KV, GDN state) only with requests of the same
    # salt: no tenant can time another's prompts through prefix-cache hits
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: reasoning tokens (after <think>) before </think> is forced; -1 = no limit
    thinking_token_budget: int | None = None
    # vLLM's: {"max_pattern_size", "min_pattern_size", "min_count"}: the request ends with
    # finish_reason "repetition" once its output ends with a pattern repeated min_count times
    repetition_detection: dict[str, Any] | None = None
    # vLLM's: the answer carries the prompt's token ids and each choice's generated ids (a
    # stream: the prompt's in a choice's first chunk, each chunk its new ids)
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # token id (a decimal string, as JSON keys are) -> bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    # structured outputs (appliance/server/guides.py reads them): OpenAI's response_format (also
    # on /v1/completions, as vLLM takes it), then vLLM's extra_body spellings
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # one of json/regex/choice/grammar/json_object
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # SGLang's spellings: a regex, an EBNF grammar, a JSON schema as JSON text
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's; only with --trust-request-chat-template
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: go on with the last (assistant) message
    # OpenAI's that this server cannot honour: refused when set (CHAT_REFUSED), not ignored
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def requested_max_tokens(self) -> int | None:
        # Both spellings are accepted; max_completion_tokens (OpenAI's current name, max_tokens
        # is deprecated) wins when both are set, as in vLLM and SGLang.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 without logprobs asks for nothing
            raise BadRequest("top_logprobs: requires logprobs to be true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_SamplingFields):
    max_stop_sequences: ClassVar[int] = MAX_COMPLETION_STOP_SEQUENCES

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only the prompt, scored with echo + logprobs
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)  # only = n (every sequence generated is returned)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echo_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt (its tokens lead the choice's logprobs)."""
        return self.logprobs if self.echo else None

    def num_prompt_logprobs(self) -> int | None:
        """What the engine scores the prompt with: echo's k and prompt_logprobs' k share one
        scoring, the larger (each view keeps its own top k)."""
        asked = [k for k in (self.echo_logprobs(), self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None  # machine-readable: "invalid_api_key", "context_length_exceeded", ...


class ErrorResponse(BaseModel):
    """The body of every 4xx / 5xx answer (OpenAI's error shape)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` of a route: these statuses answer with an ErrorResponse."""
    return {
        status: {"model": ErrorResponse, "description": _ERROR_MEANINGS[status]}
        for status in statuses
    }


_ERROR_MEANINGS = {
    400: "Invalid request: a field's type or value, the context length, the JSON nesting.",
    401: "Missing or wrong API key (when the server has keys).",
    404: "Unknown model or route.",
    408: "The request ran past the server's --request-timeout and was aborted.",
    413: "The request body is larger than --max-request-bytes.",
    429: "The server's queue is full; retry after the Retry-After seconds.",
    500: "The engine failed.",
    503: "The server is starting or shutting down.",
}


# the chat route's own refusals (ChatEndpoint.check); `modalities` only when it asks for more than
# text
CHAT_REFUSED = {
    "functions": "the deprecated function-calling fields are not supported; send `tools`",
    "function_call": "the deprecated function-calling fields are not supported; send `tool_choice`",
    "audio": "audio output is not supported (this model writes text)",
}


def check_chat_output(req: ChatCompletionRequest) -> None:
    """400s for what a chat answer here cannot be: the deprecated `functions` / `function_call`
    (whose answers carry `message.function_call`), audio output."""
    check_unsupported(req, CHAT_REFUSED)
    other = [m for m in req.modalities or [] if m != "text"]
    if other:
        raise BadRequest(
            f"modalities: only 'text' is supported, not {other[0]!r} (this model writes text).",
            "modalities",
        )


def check_unsupported(req: _Schema, refused: dict[str, str]) -> None:
    """vLLM's sampling fields this server does not implement (or a route's own `refused` fields):
    a 400 naming the field when one is set, rather than a silent answer without it."""
    for name, why in refused.items():
        value = getattr(req, name)
        if value is not None and value is not False and value not in ([], {}):  # 0 is set
            raise BadRequest(f"{name}: {why}.", name)


def check_stream_options(req: _SamplingFields) -> None:
    """stream_options only with stream=true, as OpenAI answers it."""
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options: only allowed when stream is true.", "stream_options")


def check_prompt_logprobs(req: _SamplingFields) -> None:
    """prompt_logprobs only without stream, as vLLM answers it: the scores would come in one
    chunk before any text, and vLLM's stream chunks have no place for them."""
    if req.prompt_logprobs is not None and req.stream:
        raise BadRequest("prompt_logprobs: not available when stream is true.", "prompt_logprobs")


def logit_bias(req: _SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """The request's logit_bias with integer keys; 400 naming a key that is not a token id of the
    vocabulary [0, vocab_size). The bias range is SamplingParams'."""
    if not req.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(
                f"logit_bias: keys must be token ids (decimal integers), got {key!r}.",
                "logit_bias",
            )
        token_id = int(key)
        if token_id >= vocab_size:
            raise BadRequest(
                f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
                "logit_bias",
            )
        bias[token_id] = value
    return bias


def sampling_params(
    req: _SamplingFields,
    num_logprobs: int | None,
    vocab_size: int,
    num_prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Validates the sampling fields (400 naming the field); unset fields take `defaults` (the
    model's generation_config.json, appliance/generation_defaults.py), then OpenAI's.
    `vocab_size`: the tokenizer's, the bound of logit_bias token ids."""
    check_stream_options(req)
    check_prompt_logprobs(req)
    requested = req.requested_max_tokens()
    if requested is not None and (req.min_tokens or 0) > requested:
        raise BadRequest(
            f"min_tokens: {req.min_tokens} is more than max_tokens ({requested}).", "min_tokens"
        )
    if isinstance(req.stop, list) and len(req.stop) > req.max_stop_sequences:
        raise BadRequest(
            f"stop: expected at most {req.max_stop_sequences} stop sequences, got {len(req.stop)}.",
            "stop",
        )
    for stop in [req.stop] if isinstance(req.stop, str) else req.stop or []:
        try:
            stop.encode()
        except UnicodeEncodeError:
            raise BadRequest(
                f"stop: {stop!r} is not valid Unicode (a lone surrogate escape).", "stop"
            ) from None
    fields = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    for name, value in (defaults or {}).items():
        if fields.get(name, 0) is None:
            fields[name] = value
    try:
        params = SamplingParams(
            n=req.n,
            # unset: the context's room, known per prompt later (serving.choice_requests, which
            # checks min_tokens against it); 0 (completions: score the prompt) has its own path
            max_tokens=requested or max(1, req.min_tokens or 0),
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=num_logprobs,
            prompt_logprobs=num_prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias(req, vocab_size),
            min_tokens=req.min_tokens or 0,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            thinking_token_budget=req.thinking_token_budget,
            repetition_detection=req.repetition_detection,
            **{k: v for k, v in fields.items() if v is not None},
        )
        params.check_vocabulary(vocab_size)
        return params
    except ValueError as exc:
        message = str(exc)
        raise BadRequest(message, message.split(":", 1)[0]) from None
