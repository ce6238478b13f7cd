"""POST /v1/chat/completions: load images, template + tokenize, submit n choices, answer as JSON
or SSE.

Called by app.py. Per choice, model text runs through the reasoning parser and then the tool-call
parser (appliance/parsers) before it becomes `content` / `reasoning_content` / `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from appliance.messages import TextDelta, TokenizedRequest, TokenLogprob
from appliance.parsers import ReasoningParser, ToolCallParser, prompt_opens_reasoning
from appliance.server.errors import APIError, BadRequest, sse_error
from appliance.server.images import image_support, load_images
from appliance.server.protocol import (
    ChatCompletionRequest,
    choice_options,
    detok_params,
    sampling_params,
)
from appliance.server.state import (
    ClientGone,
    ServerState,
    abort_on_disconnect,
    first_item,
    iterate_deltas,
    new_request_id,
)


class ChoiceParser:
    """Model text of one choice -> (reasoning, content, tool-call deltas), incrementally."""

    def __init__(
        self, body: ChatCompletionRequest, prompt_text: str, reasoning_mode: str, index: int
    ) -> None:
        opens = prompt_opens_reasoning(prompt_text)
        enabled = reasoning_mode == "on" or (reasoning_mode == "auto" and opens)
        self.reasoning = ReasoningParser(starts_in_reasoning=opens, enabled=enabled)
        seed = None if body.seed is None else body.seed + index
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
        self.tools = ToolCallParser(body.tools, tool_choice, body.parallel_tool_calls, seed)
        self.made_calls = False

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        reasoning, content = self.reasoning.feed(text)
        parsed = self.tools.feed(content)
        calls = [c.to_openai() for c in parsed.tool_calls]
        text_out = parsed.content
        if final:
            r2, c2 = self.reasoning.finish()
            reasoning += r2
            tail = self.tools.feed(c2)
            end = self.tools.finish()
            text_out += tail.content + end.content
            calls += [c.to_openai() for c in tail.tool_calls + end.tool_calls]
        self.made_calls = self.made_calls or bool(calls)
        return reasoning, text_out, calls

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.made_calls and reason == "stop" else reason


def chat_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": e.bytes,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e.top],
        }
        for e in entries
    ]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _check(state: ServerState, body: ChatCompletionRequest) -> None:
    if body.n > state.config.max_n:
        raise BadRequest(f"n: expected at most {state.config.max_n}, got {body.n}.", "n")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise BadRequest(
            f"response_format: type {fmt!r} is not supported (only 'text').", "response_format"
        )


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    arrival = time.monotonic()
    state.check_accepting()
    model = state.check_model(body.model)
    _check(state, body)
    params = sampling_params(body, body.num_logprobs())
    support = image_support(state.model_dir, state.config.visual)
    images = await load_images(support, body.messages, state.metrics)
    prompt = await asyncio.to_thread(
        state.prompts.chat,
        body.messages,
        body.tools,
        body.chat_template_kwargs,
        body.add_generation_prompt,
        images,
        support.image_token_id,
    )
    max_tokens = state.prompts.max_tokens_for(body.requested_max_tokens(), len(prompt.token_ids))
    group_id = new_request_id("chatcmpl")
    detok = detok_params(params)
    requests = [
        TokenizedRequest(
            f"{group_id}-{i}",
            prompt.token_ids,
            choice_options(params, i),
            max_tokens,
            params.ignore_eos,
            params.stop_token_ids,
            detok,
            time.time(),
            prompt.images,  # the visual server encodes them (and dedupes across the n choices)
        )
        for i in range(body.n)
    ]
    group = state.client.submit(group_id, requests, arrival)
    parsers = [
        ChoiceParser(body, prompt.text or "", state.config.reasoning, i) for i in range(body.n)
    ]
    head = {"id": group_id, "created": int(time.time()), "model": model}
    if body.stream:
        try:
            first = await first_item(request, state.client, group)
        except ClientGone:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(
            state, request, group, first, parsers, head, len(prompt.token_ids), include_usage
        )
        return StreamingResponse(stream, media_type="text/event-stream")
    async with abort_on_disconnect(request, state.client, group):
        return JSONResponse(await _collect(group, parsers, head, len(prompt.token_ids)))


async def _collect(group, parsers: list[ChoiceParser], head: dict, num_prompt: int) -> dict:
    n = len(parsers)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    finish: list[str] = ["stop"] * n
    tokens = [0] * n
    cached = 0
    async for index, delta in iterate_deltas(group):
        texts[index].append(delta.text)
        if delta.logprobs is not None:
            logprobs[index] = (logprobs[index] or []) + delta.logprobs
        tokens[index] = delta.num_output_tokens
        cached = max(cached, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            finish[index] = delta.finish_reason
    choices = []
    for i, parser in enumerate(parsers):
        reasoning, content, _ = parser.feed("".join(texts[i]), final=True)
        result = parser.tools.result()
        # content is null only for a pure tool-call answer, as OpenAI does.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not result.tool_calls else None,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if result.tool_calls:
            message["tool_calls"] = result.tool_calls
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": None
                if logprobs[i] is None
                else {"content": chat_logprobs(logprobs[i])},
                "finish_reason": parser.finish_reason(finish[i]),
            }
        )
    return {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage(num_prompt, sum(tokens), cached),
    }


def sse_chunk(
    head: dict,
    choices: list[dict],
    usage_: dict | None = None,
    include_usage: bool = False,
    *,
    object_name: str,
) -> str:
    """One server-sent event of a streamed completion (chat or legacy)."""
    body = {**head, "object": object_name, "choices": choices}
    if include_usage:
        body["usage"] = usage_
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


_chunk = partial(sse_chunk, object_name="chat.completion.chunk")


def _delta_choice(parser: ChoiceParser, index: int, delta: TextDelta) -> dict | None:
    final = delta.finish_reason is not None
    reasoning, content, calls = parser.feed(delta.text, final)
    out: dict[str, Any] = {}
    if reasoning:
        out["reasoning_content"] = reasoning
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
    if not out and not logprobs and not final:
        return None
    return {
        "index": index,
        "delta": out,
        "logprobs": {"content": logprobs} if logprobs else None,
        "finish_reason": parser.finish_reason(delta.finish_reason) if final else None,
    }


async def _stream(
    state: ServerState,
    request: Request,
    group,
    first,
    parsers: list[ChoiceParser],
    head: dict,
    num_prompt: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    tokens = [0] * len(parsers)
    cached = 0
    async with abort_on_disconnect(request, state.client, group):
        try:
            for i in range(len(parsers)):
                role = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _chunk(head, [role], include_usage=include_usage)
            async for index, delta in iterate_deltas(group, first):
                tokens[index] = delta.num_output_tokens
                cached = max(cached, delta.num_cached_tokens)
                choice = _delta_choice(parsers[index], index, delta)
                if choice is not None:
                    yield _chunk(head, [choice], include_usage=include_usage)
            if include_usage:
                yield _chunk(head, [], usage(num_prompt, sum(tokens), cached), True)
        except APIError as err:
            yield sse_error(err)
        yield "data: [DONE]\n\n"
