"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams (the beam
width), `length_penalty`, `max_tokens` rounds at most, eos (and `stop_token_ids`) ending a beam
unless `ignore_eos`. The endpoint's checks and prompts are the route's own (images included);
then appliance/beam_search.py runs over the engine, one round at a time: every live beam of every
prompt asks for one token and its 2 x n best logprobs (the model's own), in one group of
requests. The answer is the route's (its formatter words each beam as a choice: n per prompt,
best first). With `stream` the same choices arrive as server-sent events once the search ends
(vLLM streams beam search the same way: its beams are known only at the end): each choice's
opening, one chunk with its whole text and finish_reason, the usage chunk when asked, [DONE].

Called by app.py for a request with `use_beam_search`. Each round's requests go through the
router like any (metrics count them); a client that leaves, or the request's deadline, aborts the
round in flight and ends the search.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from appliance.beam_search import BeamSearch, BeamSearchParams
from appliance.generation_defaults import end_token_ids
from appliance.messages import DetokParams, SamplingOptions, TextDelta, TokenizedRequest
from appliance.server.errors import BadRequest
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from appliance.server.serving import ChoiceFormatter, Endpoint, check_priority, sse_chunk, usage
from appliance.server.state import ServerState, abort_on_disconnect, iterate_deltas, new_request_id

# fields that change what is generated or returned and that beam search does not do -> why
_REFUSED = {
    "logprobs": "not returned with beam search",
    "top_logprobs": "not returned with beam search",
    "prompt_logprobs": "not returned with beam search",
    "echo": "not with beam search",
    "tools": "tool calls are not parsed with beam search",
    "response_format": "structured outputs are not constrained with beam search",
    "guided_json": "structured outputs are not constrained with beam search",
    "guided_regex": "structured outputs are not constrained with beam search",
    "guided_choice": "structured outputs are not constrained with beam search",
    "guided_grammar": "structured outputs are not constrained with beam search",
    "structured_outputs": "structured outputs are not constrained with beam search",
    "stop": "stop strings do not end beams; stop_token_ids and eos do",
    "bad_words": "not with beam search",
    "thinking_token_budget": "not with beam search (beams follow the model's own logprobs)",
    "repetition_detection": "not with beam search",
    "logit_bias": "not with beam search (beams follow the model's own logprobs)",
    "presence_penalty": "not with beam search (beams follow the model's own logprobs)",
    "frequency_penalty": "not with beam search (beams follow the model's own logprobs)",
    "repetition_penalty": "not with beam search (beams follow the model's own logprobs)",
    "min_tokens": "not with beam search",
    "allowed_token_ids": "not with beam search",
}


def check_beam_request(body: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 naming the first field set that beam search would otherwise leave unheeded (their
    neutral values, 0 penalties or a repetition_penalty of 1, are fine)."""
    for name, why in _REFUSED.items():
        value = getattr(body, name, None)
        neutral = 1 if name == "repetition_penalty" else 0
        if value not in (None, False, [], {}, "", neutral):
            raise BadRequest(f"{name}: {why}.", name)


def beam_params(body: Any, max_tokens: int, ignore_eos: bool) -> BeamSearchParams:
    """The request's beam search: n beams, length_penalty 1 when unset (0 is no normalisation)."""
    penalty = 1.0 if body.length_penalty is None else float(body.length_penalty)
    return BeamSearchParams(body.n, max_tokens, ignore_eos, 0.0, penalty)


@functools.lru_cache(maxsize=8)
def _end_ids(model_dir: str) -> tuple[int, ...]:
    return end_token_ids(model_dir)


async def serve_beam_search(
    endpoint: Endpoint, state: ServerState, body: Any, request: Request
) -> Response:
    """POST of a route with use_beam_search, end to end."""
    check_beam_request(body)
    state.check_accepting()
    model = state.check_model(body.model)
    check_priority(state, body.priority)
    endpoint.check(state, body)
    params = sampling_params(body, None, state.prompts.vocab_size, None, state.sampling_defaults)
    prompts = await endpoint.prompts(state, body)
    formatter = endpoint.formatter(state, body, prompts)
    end_ids = set(_end_ids(state.model_dir)) | set(params.stop_token_ids)
    searches = []
    for prompt in prompts:
        room = state.prompts.max_tokens_for(body.requested_max_tokens(), len(prompt.token_ids))
        room = min(room, state.sampling_defaults.get("max_tokens", room))
        beam = beam_params(body, room, params.ignore_eos)
        searches.append(BeamSearch(prompt.token_ids, beam, sorted(end_ids)))
    group_id = new_request_id(endpoint.id_prefix)
    arrival = time.monotonic()
    while not all(s.done for s in searches):
        gone = await _round(
            state,
            request,
            group_id,
            prompts,
            searches,
            arrival,
            body.priority,
            body.cache_salt or "",
        )
        if gone:
            return Response(status_code=499)
    beams = []  # (choice index, text, tokens, finish_reason), best first per prompt
    for p, search in enumerate(searches):
        for rank, beam in enumerate(search.result()):
            tokens = list(beam.tokens)
            text = state.prompts.tokenizer.decode(
                tokens[:-1] if beam.finished else tokens, skip_special_tokens=True
            )
            beams.append((p * body.n + rank, text, tokens, "stop" if beam.finished else "length"))
    head = {"id": group_id, "created": int(time.time()), "model": model}
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    total = usage(prompt_tokens, sum(len(tokens) for _, _, tokens, _ in beams))
    if body.stream:
        options = body.stream_options
        asked = bool(options and options.include_usage)
        chunks = _chunks(
            endpoint,
            formatter,
            head,
            beams,
            [len(prompts[index // body.n].token_ids) for index, *_ in beams],
            total if asked or state.config.enable_force_include_usage else None,
            bool(asked and options.continuous_usage_stats),
        )
        return StreamingResponse(chunks, media_type="text/event-stream")
    choices = []
    for index, text, tokens, finish in beams:
        formatter.observe(index, TextDelta(group_id, text, tokens, len(tokens)))
        choices.append(formatter.final_choice(index, text, None, finish))
    return JSONResponse(
        {
            **head,
            "object": endpoint.object_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": total,
            **formatter.answer_fields([None] * len(choices)),  # chat's prompt_token_ids
        }
    )


def _chunks(
    endpoint: Endpoint,
    formatter: ChoiceFormatter,
    head: dict[str, Any],
    beams: list[tuple[int, str, list[int], str]],
    prompt_lengths: list[int],
    total: dict[str, Any] | None,
    continuous: bool,
) -> Iterator[str]:
    """The finished search as a stream: every choice's opening, then one chunk per choice with
    its whole text and finish_reason; `total`: the usage chunk's (None: not asked for);
    `continuous`: each choice's chunk carries that choice's usage too (vLLM's
    continuous_usage_stats)."""
    name, include_usage = endpoint.chunk_object_name, total is not None
    for (index, *_), prompt_length in zip(beams, prompt_lengths, strict=True):
        opening = formatter.opening(index)
        if opening is not None:
            mine = usage(prompt_length, 0) if continuous else None
            fields = formatter.opening_fields()
            yield sse_chunk(head, name, [opening], mine, include_usage=include_usage, **fields)
    for (index, text, tokens, finish), prompt_length in zip(beams, prompt_lengths, strict=True):
        delta = TextDelta(head["id"], text, tokens, len(tokens), finish)
        formatter.observe(index, delta)
        choice = formatter.delta_choice(index, delta)
        mine = usage(prompt_length, len(tokens)) if continuous else None
        yield sse_chunk(head, name, [choice], mine, include_usage=include_usage)
    if include_usage:
        yield sse_chunk(head, name, [], total, include_usage=True)
    yield "data: [DONE]\n\n"


async def _round(
    state: ServerState,
    request: Request,
    group_id: str,
    prompts: list,
    searches: list[BeamSearch],
    arrival: float,
    priority: int,
    salt: str,
) -> bool:
    """One token for every live beam, in one group; True when the client went away."""
    live = [(p, s) for p, s in enumerate(searches) if not s.done]
    requests: list[TokenizedRequest] = []
    for p, search in live:
        for ids in search.prompts():
            requests.append(
                TokenizedRequest(
                    req_id=f"{group_id}-r{search.rounds}-{len(requests)}",
                    prompt_token_ids=ids,
                    sampling=SamplingOptions(temperature=0.0, logprobs=search.num_top),
                    max_tokens=1,
                    ignore_eos=True,
                    detok=DetokParams(logprobs=True, skip_special_tokens=False),
                    arrival_time=time.time(),
                    images=prompts[p].images,
                    turn_start=prompts[p].turn_start,
                    priority=priority,
                    cache_salt=salt,
                )
            )
    group = state.client.submit(f"{group_id}-r{live[0][1].rounds}", requests, arrival)
    if state.config.request_timeout:
        group.deadline = arrival + state.config.request_timeout
        group.timeout_s = state.config.request_timeout
    tops: list[list[tuple[int, float]]] = [[] for _ in requests]
    async with abort_on_disconnect(request, state.client, group):
        async for index, delta in iterate_deltas(group):
            for entry in delta.logprobs or []:
                tops[index] = [
                    (token, logprob)
                    for token, (_, logprob, _) in zip(entry.top_ids, entry.top, strict=True)
                ]
    if group.abort_reason == "client_gone":
        return True
    first = 0
    for _, search in live:
        count = len(search.live)
        search.advance(tops[first : first + count])
        first += count
    return False
