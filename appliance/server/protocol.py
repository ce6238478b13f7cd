"""OpenAI request schemas (pydantic, validated by FastAPI) and the shared sampling-field checks.

Used by app.py (route signatures) and serving_*.py. Type errors become 400s naming the field through
errors.py; value rules that pydantic cannot express live in `sampling_options()`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.messages import DetokParams, SamplingOptions
from appliance.server.errors import BadRequest

MAX_TOP_LOGPROBS = 20


class _Schema(BaseModel):
    # Unknown fields (store, metadata, user, ...) are accepted and ignored, as OpenAI servers do.
    model_config = ConfigDict(extra="ignore")


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


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Schema):
    include_usage: bool = False


class _SamplingFields(_Schema):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


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
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        # Both spellings are accepted; max_tokens wins when both are set.
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs: requires logprobs to be true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


def stop_strings(req: _SamplingFields) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise BadRequest("stop: stop strings must not be empty.", "stop")
    return stop


def sampling_options(req: _SamplingFields, num_logprobs: int | None,
                     seed_offset: int = 0) -> SamplingOptions:
    """The worker's sampling knobs for one choice; unset fields take the OpenAI defaults."""
    top_k = req.top_k if req.top_k is not None else -1
    seed = None if req.seed is None else req.seed + seed_offset
    return SamplingOptions(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=req.min_p or 0.0,
        seed=seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=num_logprobs,
    )


def detok_params(req: _SamplingFields, logprobs: bool) -> DetokParams:
    return DetokParams(stop=stop_strings(req),
                       include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens, logprobs=logprobs)
