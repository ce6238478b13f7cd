"""vLLM's /tokenize and /detokenize (SGLang has the same pair): the token ids this server would feed
the model for a completion prompt or a chat conversation, and the text of given ids. The prompt is
built exactly as /v1/completions and /v1/chat/completions build theirs (PromptBuilder, the chat
template with its kwargs and tools), so the count is what a request would be charged.

Used by app.py; images in messages are refused (their token count is known once they are loaded).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field

from appliance.server.chat_checks import check_messages, check_tools, template_kwargs
from appliance.server.errors import BadRequest
from appliance.server.prompts import PromptBuilder, message_chars
from appliance.server.protocol import ChatMessage, ImagePart, _Schema
from appliance.server.state import ServerState

LONGEST = 2**62  # a counting builder's context and characters: none refused for its length


class TokenizeRequest(_Schema):
    """A completion prompt (`prompt`) or a conversation (`messages`), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Schema):
    model: str | None = None
    tokens: list[int]


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    state.check_accepting()  # the context length is known once the engine is ready
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("Give either prompt or messages.", "prompt")
    # counting whether a prompt fits is what this is for: no context-length refusal (as vLLM);
    # the body limit (--max-request-bytes) bounds the text
    served = state.prompts
    builder = PromptBuilder(served.tokenizer, LONGEST, LONGEST)
    if body.messages is not None:
        check_messages(body.messages)  # what the chat route refuses, this refuses too
        check_tools(body.tools)
        for message in body.messages:
            if isinstance(message.content, list) and any(
                isinstance(p, ImagePart) for p in message.content
            ):
                raise BadRequest(
                    "messages: /tokenize counts text; an image's tokens depend on its size, "
                    "known once it is loaded (usage.prompt_tokens of the chat request has them).",
                    "messages",
                )
        chars = message_chars(body.messages)
        kwargs = template_kwargs(
            body, state.config.trust_request_chat_template, state.template_defaults
        )
        render = functools.partial(builder.chat, continue_final_message=body.continue_final_message)
        args = (body.messages, body.tools, kwargs, body.add_generation_prompt)
        prompt = await state.prompt_lanes.run(chars, render, *args)
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
    state.check_accepting()
    state.check_model(body.model)
    vocab = state.prompts.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(
            f"tokens: token id {bad} is outside the vocabulary [0, {vocab}).", "tokens"
        )
    return {"prompt": state.prompts.decode(body.tokens)}
