"""POST /v1/completions: string or token-id prompts (one or a batch), n choices each, JSON or SSE.

Called by app.py. Choice index = prompt index x n + choice number, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from appliance.messages import TokenizedRequest, TokenLogprob
from appliance.server.errors import APIError, BadRequest, sse_error
from appliance.server.prompts import Prompt
from appliance.server.protocol import (
    CompletionRequest,
    choice_options,
    detok_params,
    sampling_params,
)
from appliance.server.serving_chat import sse_chunk, usage
from appliance.server.state import (
    ClientGone,
    ServerState,
    abort_on_disconnect,
    first_item,
    iterate_deltas,
    new_request_id,
)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt: expected a non-empty string or list.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class LegacyLogprobs:
    """Accumulates the /v1/completions logprobs object of one choice."""

    def __init__(self, offset: int) -> None:
        self.offset = offset  # characters before the first generated token (echoed prompt)

    def entries(self, items: list[TokenLogprob]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in items:
            tokens.append(e.token)
            token_logprobs.append(e.logprob)
            top.append({t: lp for t, lp, _ in e.top})
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    arrival = time.monotonic()
    state.check_accepting()
    model = state.check_model(body.model)
    if body.suffix:
        raise BadRequest("suffix: not supported.", "suffix")
    if body.n > state.config.max_n:
        raise BadRequest(f"n: expected at most {state.config.max_n}, got {body.n}.", "n")
    if body.echo and body.logprobs is not None:
        raise BadRequest("echo: prompt logprobs (echo with logprobs) are not supported.", "echo")
    params = sampling_params(body, body.num_logprobs())
    raw_prompts = _prompt_list(body.prompt)
    prompts: list[Prompt] = await asyncio.to_thread(
        lambda: [state.prompts.completion(p) for p in raw_prompts]
    )
    group_id = new_request_id("cmpl")
    detok = detok_params(params)
    requests: list[TokenizedRequest] = []
    echoes: list[str] = []
    for prompt in prompts:
        max_tokens = state.prompts.max_tokens_for(
            body.requested_max_tokens(), len(prompt.token_ids)
        )
        echo = ""
        if body.echo:
            echo = (
                prompt.text if prompt.text is not None else state.prompts.decode(prompt.token_ids)
            )
        for i in range(body.n):
            k = len(requests)
            requests.append(
                TokenizedRequest(
                    f"{group_id}-{k}",
                    prompt.token_ids,
                    choice_options(params, i),
                    max_tokens,
                    params.ignore_eos,
                    params.stop_token_ids,
                    detok,
                    time.time(),
                )
            )
            echoes.append(echo)
    group = state.client.submit(group_id, requests, arrival)
    head = {"id": group_id, "created": int(time.time()), "model": model}
    num_prompt = sum(len(p.token_ids) for p in prompts)
    if body.stream:
        try:
            first = await first_item(request, state.client, group)
        except ClientGone:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(state, request, group, first, echoes, head, num_prompt, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    async with abort_on_disconnect(request, state.client, group):
        return JSONResponse(await _collect(group, echoes, head, num_prompt))


async def _collect(group, echoes: list[str], head: dict, num_prompt: int) -> dict:
    n = len(echoes)
    texts = [[e] for e in echoes]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    finish = ["stop"] * n
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
    choices = [
        {
            "index": i,
            "text": "".join(texts[i]),
            "logprobs": None
            if logprobs[i] is None
            else LegacyLogprobs(len(echoes[i])).entries(logprobs[i]),
            "finish_reason": finish[i],
        }
        for i in range(n)
    ]
    return {
        **head,
        "object": "text_completion",
        "choices": choices,
        "usage": usage(num_prompt, sum(tokens), cached),
    }


_chunk = partial(sse_chunk, object_name="text_completion")


async def _stream(
    state: ServerState,
    request: Request,
    group,
    first,
    echoes: list[str],
    head: dict,
    num_prompt: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    n = len(echoes)
    tokens = [0] * n
    cached = 0
    pending_echo = list(echoes)
    offsets = [LegacyLogprobs(len(e)) for e in echoes]
    async with abort_on_disconnect(request, state.client, group):
        try:
            async for index, delta in iterate_deltas(group, first):
                tokens[index] = delta.num_output_tokens
                cached = max(cached, delta.num_cached_tokens)
                text = pending_echo[index] + delta.text
                pending_echo[index] = ""
                if not text and not delta.logprobs and delta.finish_reason is None:
                    continue
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": offsets[index].entries(delta.logprobs) if delta.logprobs else None,
                    "finish_reason": delta.finish_reason,
                }
                yield _chunk(head, [choice], include_usage=include_usage)
            if include_usage:
                yield _chunk(head, [], usage(num_prompt, sum(tokens), cached), True)
        except APIError as err:
            yield sse_error(err)
        yield "data: [DONE]\n\n"
