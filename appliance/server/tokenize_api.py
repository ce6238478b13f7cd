"""vLLM's /tokenize and /detokenize (SGLang has the same pair): the token ids this server would feed
the model for a completion prompt or a chat conversation, and the text of given ids. The prompt is
built exactly as /v1/completions and /v1/chat/completions build theirs (PromptBuilder, the chat
template with its kwargs and tools), so the count is what a request would be charged.

Used by app.py; images in messages are refused (they are expanded only where they are loaded).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from appliance.server.chat_checks import template_kwargs
from appliance.server.errors import BadRequest
from appliance.server.prompts import message_chars
from appliance.server.protocol import ChatMessage, _Schema
from appliance.server.state import ServerState


class TokenizeRequest(_Schema):
    """A completion prompt (`prompt`) or a conversation (`messages`), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Schema):
    model: str | None = None
    tokens: list[int]


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("Give either prompt or messages.", "prompt")
    builder = state.prompts
    if body.messages is not None:
        chars = message_chars(body.messages)
        kwargs = template_kwargs(body, state.config.trust_request_chat_template)
        args = (body.messages, body.tools, kwargs, body.add_generation_prompt)
        prompt = await state.prompt_lanes.run(chars, builder.chat, *args)
    else:
        prompt = await state.prompt_lanes.run(len(body.prompt), builder.completion, body.prompt)
    ids = prompt.token_ids
    strs = builder.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(body.model)
    vocab = state.prompts.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(
            f"tokens: token id {bad} is outside the vocabulary [0, {vocab}).", "tokens"
        )
    return {"prompt": state.prompts.decode(body.tokens)}
