"""The one OpenAI handler skeleton: checks, tokenize, submit n choices per prompt, then answer as
one JSON body (collect) or as server-sent events (stream).

Called by app.py with an `Endpoint` strategy (serving_chat.CHAT, serving_completion.COMPLETION) that
supplies what differs per route: its checks, its prompts and the wording of its choices; a route
whose answer is not a list of choices (serving_responses.py) also brings its own `Reply`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from appliance.messages import Guide, TextDelta, TokenizedRequest, TokenLogprob
from appliance.parsers.reasoning import THINK_END, THINK_START, marker_id
from appliance.sampling_params import SamplingParams
from appliance.server.engine_client import EngineClient, RequestGroup
from appliance.server.errors import APIError, BadRequest, RequestTimeout, sse_error
from appliance.server.guides import compile_guide, request_guide
from appliance.server.prompts import Prompt
from appliance.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from appliance.server.request_metrics import ChoiceMetrics
from appliance.server.state import (
    ClientGone,
    ServerState,
    abort_on_disconnect,
    exit_reason,
    first_item,
    iterate_deltas,
    new_request_id,
    wait_disconnect,
)

Body = TypeVar("Body", bound="ChatCompletionRequest | CompletionRequest", contravariant=True)
Choice = dict[str, Any]  # one entry of a response's `choices`


class ChoiceFormatter(Protocol):
    """Words the choices of one request in its endpoint's format; holds the per-choice state."""

    # whether a choice that ended "stop" can be worded with another finish_reason (a chat answer
    # that made tool calls: "tool_calls"); the metrics then count what the answer says
    labels_stops: bool

    def opening(self, index: int) -> Choice | None:
        """The streamed choice sent before any text (None: the endpoint sends none)."""

    def opening_fields(self) -> dict[str, Any]:
        """Top-level keys of a stream's opening chunks besides OpenAI's (chat: vLLM's
        prompt_token_ids, with return_token_ids)."""

    def delta_choice(self, index: int, delta: TextDelta) -> Choice | None:
        """The streamed choice for one delta (None: nothing worth a chunk)."""

    def final_choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> Choice:
        """The choice of a JSON answer, from the choice's whole text and logprobs (its generated
        tokens'), and its prompt's entries when the engine scored the prompt."""

    def answer_fields(self, prompt_logprobs: list[list[TokenLogprob] | None]) -> dict[str, Any]:
        """Keys a JSON answer has besides OpenAI's (chat: vLLM's top-level prompt_logprobs), from
        each choice's prompt entries."""

    def observe(self, index: int, delta: TextDelta) -> None:
        """Sees every delta of a choice, streamed or collected, before it is worded."""

    def usage_details(self, indexes: Iterable[int]) -> dict[str, Any]:
        """Keys the usage of these choices has besides the token counts (chat: OpenAI's
        completion_tokens_details)."""


class Endpoint(Protocol[Body]):
    """What one OpenAI route adds to the skeleton; a stateless strategy, one per route."""

    id_prefix: str  # of the response id: "chatcmpl" | "cmpl"
    reports_spec: bool  # every answer reports each request's MTP counts (SGLang's /generate)
    object_name: str  # `object` of a JSON answer
    chunk_object_name: str  # `object` of a streamed chunk

    def check(self, state: ServerState, body: Body) -> None:
        """The route's own 400s, raised before sampling fields are validated."""

    async def prompts(self, state: ServerState, body: Body) -> list[Prompt]:
        """The request's prompts, tokenized and length-checked; each gets n choices."""

    def formatter(self, state: ServerState, body: Body, prompts: list[Prompt]) -> ChoiceFormatter:
        """A fresh formatter for the request's len(prompts) x n choices."""


@dataclass
class Answer:
    """A submitted request on its way back: what collect and stream share."""

    endpoint: Endpoint
    group: RequestGroup
    formatter: ChoiceFormatter
    head: dict[str, Any]  # id, created, model: the first keys of every body and chunk
    num_choices: int
    choices_per_prompt: int  # n: choice index = prompt index x n + choice number
    prompt_lengths: list[int]  # per prompt

    @property
    def num_prompt_tokens(self) -> int:
        """Over all prompts (usage.prompt_tokens: each prompt once, whatever n)."""
        return sum(self.prompt_lengths)


class Reply(Protocol):
    """Words a submitted answer where the choices shape does not fit (/v1/responses: one Response
    object, or its typed events); without one, `serve` answers with choices (collect or chunks)."""

    async def collect(self, state: ServerState, request: Request, answer: Answer) -> dict[str, Any]:
        """The JSON body, once every delta has arrived."""

    def stream(
        self, state: ServerState, request: Request, answer: Answer, first: tuple[int, TextDelta]
    ) -> AsyncIterator[str]:
        """The server-sent events, from the first delta on (it is already taken)."""


def check_n(state: ServerState, body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n > state.config.max_n:
        raise BadRequest(f"n: expected at most {state.config.max_n}, got {body.n}.", "n")


def check_priority(state: ServerState, priority: int) -> None:
    """vLLM's rule: a priority other than 0 needs the priority policy (else it would be ignored)."""
    if priority and state.scheduling_policy != "priority":
        raise BadRequest(
            "priority: this server schedules first come, first served; start it with "
            "--scheduling-policy priority to order requests by priority.",
            "priority",
        )


async def serve(
    endpoint: Endpoint[Body],
    state: ServerState,
    body: Body,
    request: Request,
    reply: Reply | None = None,
) -> Response:
    """Handles one POST of an OpenAI route end to end. Once submitted, the request's choices are
    released (aborted in the router) on every way out that leaves them open."""
    arrival = time.monotonic()
    state.metrics.frontend_enter()
    try:
        answer = await _admit_watched(endpoint, state, body, request, arrival)
    except ClientGone:
        return Response(status_code=499)
    finally:
        state.metrics.frontend_exit()
    # for the access log (app.AccessLog): the completion id and how the request ended
    request.state.completion_id = answer.head["id"]
    request.state.request_group = answer.group
    try:
        return await _respond(state, request, body, answer, reply)
    except BaseException as exc:
        state.client.abort(answer.group, exit_reason(exc))
        raise


async def _admit_watched(
    endpoint: Endpoint[Body], state: ServerState, body: Body, request: Request, arrival: float
) -> Answer:
    """`_admit`, given up (its image fetches cancelled) when the client leaves (ClientGone) or the
    request's --request-timeout passes first: fetching images, rendering the prompt and compiling a
    grammar count against the deadline as the generation does."""
    admit = asyncio.ensure_future(_admit(endpoint, state, body, arrival))
    gone = asyncio.ensure_future(wait_disconnect(request))
    limit = state.config.request_timeout
    try:
        wait = max(0.0, arrival + limit - time.monotonic()) if limit else None
        done, _ = await asyncio.wait({admit, gone}, timeout=wait, return_when="FIRST_COMPLETED")
        if admit in done:  # its submit is its last step: not done, nothing was submitted
            return admit.result()
        admit.cancel()
        if gone in done:
            raise ClientGone
        raise RequestTimeout(limit, started=False)
    except asyncio.CancelledError:
        admit.cancel()
        raise
    finally:
        gone.cancel()


async def _admit(
    endpoint: Endpoint[Body], state: ServerState, body: Body, arrival: float
) -> Answer:
    """Checks, prompts and choices, then the submit (last: nothing after it can fail)."""
    state.check_accepting()
    model = state.check_model(body.model)
    check_priority(state, body.priority)
    endpoint.check(state, body)
    vocab_size = state.prompts.vocab_size
    params = sampling_params(
        body,
        body.num_logprobs(),
        vocab_size,
        body.num_prompt_logprobs(),
        state.sampling_defaults,
    ).tokenize_bad_words(state.prompts.encode_words)
    params = reasoning_tokens(params, state)
    prompts = await endpoint.prompts(state, body)
    guide = None
    tokenizer, reasoning = state.prompts.tokenizer, state.config.reasoning
    if found := request_guide(body, prompts[0].text, tokenizer, reasoning):
        param, guide = found
        await compile_guide(state.grammars, guide, param)  # 400 for a grammar that fails
    group_id = new_request_id(endpoint.id_prefix)
    requests = choice_requests(state, group_id, prompts, params, body, guide, endpoint.reports_spec)
    formatter = endpoint.formatter(state, body, prompts)
    head = {"id": group_id, "created": int(time.time()), "model": model}
    group = state.client.submit(group_id, requests, arrival, formatter.labels_stops, body.n)
    if state.config.request_timeout:
        group.deadline = arrival + state.config.request_timeout
        group.timeout_s = state.config.request_timeout
    return Answer(
        endpoint,
        group,
        formatter,
        head,
        len(requests),
        body.n,
        [len(p.token_ids) for p in prompts],
    )


async def _respond(
    state: ServerState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    answer: Answer,
    reply: Reply | None,
) -> Response:
    group = answer.group
    if not body.stream:
        async with abort_on_disconnect(request, state.client, group):
            if reply is None:
                answer_body = await _collect(state, answer)
            else:
                answer_body = await reply.collect(state, request, answer)
        if group.abort_reason == "client_gone":  # nobody to send it to (nginx's 499)
            return Response(status_code=499)
        return JSONResponse(answer_body)
    try:
        first = await first_item(request, state.client, group)
    except ClientGone:
        return Response(status_code=499)
    if reply is not None:
        stream = reply.stream(state, request, answer, first)
    else:
        options = body.stream_options
        asked = bool(options and options.include_usage)
        include_usage = asked or state.config.enable_force_include_usage
        continuous = asked and options.continuous_usage_stats
        stream = _stream(state, request, answer, first, include_usage, continuous)
    return ReleasingStream(state.client, group, stream, media_type="text/event-stream")


class ReleasingStream(StreamingResponse):
    """A stream that aborts its request's open choices however it ends, including when its body
    never started (the client left before the first byte, or sending the headers failed)."""

    def __init__(self, client: EngineClient, group: RequestGroup, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client = client
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # open choices here: the body stopped early (the client went away)
            self.client.abort(self.group, "client_gone")


def reasoning_tokens(params: SamplingParams, state: ServerState) -> SamplingParams:
    """The params with the tokenizer's <think> / </think> ids a thinking_token_budget needs (a 400
    naming the field when the tokenizer has none)."""
    if params.thinking_budget < 0:
        return params
    tokenizer = state.prompts.tokenizer
    try:
        start, end = marker_id(tokenizer, THINK_START), marker_id(tokenizer, THINK_END)
        return params.with_reasoning_tokens(start, end)
    except ValueError as exc:
        raise BadRequest(str(exc), "thinking_token_budget") from None


def choice_requests(
    state: ServerState,
    group_id: str,
    prompts: list[Prompt],
    params: SamplingParams,
    body: ChatCompletionRequest | CompletionRequest,
    guide: Guide | None = None,
    reports_spec: bool = False,  # the route reports each request's MTP counts
) -> list[TokenizedRequest]:
    """n choices per prompt; choice index = prompt index x n + choice number, as OpenAI numbers
    them. Raises the max_tokens 400 of the first prompt that leaves too little room."""
    detok = params.to_detok()
    arrival_time = time.time()
    # the router times the request only where the answer reports it: one choice (vLLM's rule)
    single = len(prompts) * body.n == 1
    timed = state.config.enable_per_request_metrics and single
    # the router ships MTP counts only where the answer words them
    spec_metrics = state.config.per_request_spec_decode_metrics != "none" and single
    counted = bool(state.mtp_step) and (reports_spec or spec_metrics)
    requests: list[TokenizedRequest] = []
    for prompt in prompts:
        max_tokens = state.prompts.max_tokens_for(
            body.requested_max_tokens(), len(prompt.token_ids)
        )
        # generation_config.json's max_new_tokens caps every request, as in vLLM
        max_tokens = min(max_tokens, state.sampling_defaults.get("max_tokens", max_tokens))
        if params.min_tokens > max_tokens:  # the context's room or the max_new_tokens cap
            raise BadRequest(
                f"min_tokens: {params.min_tokens} is more than the {max_tokens} tokens this "
                "request may generate (the room the prompt leaves in the model's context, at "
                "most the model's max_new_tokens).",
                "min_tokens",
            )
        for choice in range(body.n):
            request = TokenizedRequest(
                req_id=f"{group_id}-{len(requests)}",
                prompt_token_ids=prompt.token_ids,
                sampling=params.choice_options(choice, guide),
                max_tokens=max_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=params.stop_token_ids,
                detok=detok,
                arrival_time=arrival_time,
                images=prompt.images,  # the visual server encodes them (deduped across choices)
                turn_start=prompt.turn_start,
                priority=body.priority,
                report_timing=timed,
                cache_salt=body.cache_salt or "",
                repetition=params.repetition_check(),
                report_spec=counted,
            )
            requests.append(request)
    return requests


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens`: prompt tokens served from the prefix
    cache (a part of prompt_tokens: see `cached_prompt_tokens`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_prompt_tokens(answer: Answer, cached: list[int]) -> int:
    """Per prompt the most any of its n choices found cached, summed over the prompts: like
    prompt_tokens, each prompt counts once, so cached_tokens never exceeds it."""
    n = answer.choices_per_prompt
    return sum(max(cached[first : first + n]) for first in range(0, len(cached), n))


async def _collect(state: ServerState, answer: Answer) -> dict[str, Any]:
    n = answer.num_choices
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    prompt_logprobs: list[list[TokenLogprob] | None] = [None] * n  # in a choice's first delta
    finish = ["stop"] * n
    tokens, cached = [0] * n, [0] * n
    tallies = [ChoiceMetrics() for _ in range(n)]
    async for index, delta in iterate_deltas(answer.group):
        answer.formatter.observe(index, delta)
        tallies[index].feed(delta)
        texts[index].append(delta.text)
        if delta.prompt_logprobs is not None:
            prompt_logprobs[index] = delta.prompt_logprobs
        cached[index] = max(cached[index], delta.cached_tokens)
        if delta.logprobs is not None:
            logprobs[index] = (logprobs[index] or []) + delta.logprobs
        tokens[index] = delta.num_output_tokens
        if delta.finish_reason is not None:
            finish[index] = delta.finish_reason
    final = answer.formatter.final_choice
    choices = [
        final(i, "".join(texts[i]), logprobs[i], finish[i], prompt_logprobs[i]) for i in range(n)
    ]
    for i, choice in enumerate(choices):
        state.client.label_finish(answer.group, i, choice["finish_reason"])
    return {
        **answer.head,
        "object": answer.endpoint.object_name,
        "system_fingerprint": None,  # OpenAI's key; no fingerprint here (vLLM: null too)
        "choices": choices,
        "usage": {
            **usage(answer.num_prompt_tokens, sum(tokens), cached_prompt_tokens(answer, cached)),
            **answer.formatter.usage_details(range(n)),
        },
        **answer.formatter.answer_fields(prompt_logprobs),
        **(report.field(tallies) if (report := state.metrics_report) else {}),
    }


def sse_chunk(
    head: dict[str, Any],
    object_name: str,
    choices: list[Choice],
    usage_: dict[str, int] | None = None,
    *,
    include_usage: bool,
    **extra: Any,
) -> str:
    """One server-sent event of a stream. With include_usage every chunk carries `usage` (null but
    in the last one), as OpenAI does; `extra`: more top-level fields (the usage chunk's vLLM
    per-request `metrics`)."""
    body = {**head, "object": object_name, "system_fingerprint": None, "choices": choices}
    if include_usage:
        body["usage"] = usage_
    body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(
    state: ServerState,
    request: Request,
    answer: Answer,
    first: tuple[int, TextDelta],
    include_usage: bool,
    continuous: bool = False,
) -> AsyncIterator[str]:
    """With `continuous` (vLLM's continuous_usage_stats) every choice's chunk carries the usage
    of that choice so far (its prompt, its tokens, as vLLM counts them); otherwise only the last
    chunk carries one, over every choice."""

    def chunk(
        choices: list[Choice], usage_: dict[str, int] | None = None, index: int = 0, **extra: Any
    ) -> str:
        name = answer.endpoint.chunk_object_name
        if continuous and usage_ is None:
            prompt = answer.prompt_lengths[index // answer.choices_per_prompt]
            usage_ = usage(prompt, tokens[index], cached[index])
            usage_.update(answer.formatter.usage_details([index]))
        return sse_chunk(answer.head, name, choices, usage_, include_usage=include_usage, **extra)

    tokens, cached = [0] * answer.num_choices, [0] * answer.num_choices
    tallies = [ChoiceMetrics() for _ in range(answer.num_choices)]
    async with abort_on_disconnect(request, state.client, answer.group):
        try:
            for index in range(answer.num_choices):
                opening = answer.formatter.opening(index)
                if opening is not None:
                    yield chunk([opening], index=index, **answer.formatter.opening_fields())
            async for index, delta in iterate_deltas(answer.group, first):
                answer.formatter.observe(index, delta)
                tallies[index].feed(delta)
                tokens[index] = delta.num_output_tokens
                cached[index] = max(cached[index], delta.cached_tokens)
                choice = answer.formatter.delta_choice(index, delta)
                if choice is not None and delta.finish_reason is not None:
                    state.client.label_finish(answer.group, index, choice["finish_reason"])
                if choice is not None:
                    yield chunk([choice], index=index)
            if include_usage:
                cached_tokens = cached_prompt_tokens(answer, cached)
                usage_ = usage(answer.num_prompt_tokens, sum(tokens), cached_tokens)
                usage_.update(answer.formatter.usage_details(range(answer.num_choices)))
                report = state.metrics_report
                yield chunk([], usage_, **(report.field(tallies) if report else {}))
        except APIError as err:
            yield sse_error(err)
        yield "data: [DONE]\n\n"
