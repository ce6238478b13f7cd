"""SGLang's native API: `POST /generate` on the handler skeleton (the body becomes a completions
request, sglang_request.py; only the answer is worded as SGLang's, by a `serving.Reply`),
`GET /health_generate` (one token through the engine) and `GET /get_model_info`.

Called by app.py. Choice index = prompt index x n + sample, the order SGLang answers a batch in.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from appliance.messages import (
    SamplingOptions,
    SpecCounts,
    TextDelta,
    TokenizedRequest,
    TokenLogprob,
)
from appliance.server.errors import (
    APIError,
    BadRequest,
    ServiceUnavailable,
    error_response,
    sse_error,
)
from appliance.server.images import ImageSource, image_support, load_image_sources
from appliance.server.prompts import Prompt
from appliance.server.serving import Answer, serve
from appliance.server.serving_completion import COMPLETION, prompt_list
from appliance.server.sglang_request import (
    GenerateRequest,
    GenerateShape,
    SGLangCompletion,
    renamed,
    translate,
)
from appliance.server.state import ServerState, abort_on_disconnect, iterate_deltas, new_request_id
from visual.checkpoint import read_config

# how long /health_generate waits for its token: SGLang's default (SGLANG_HEALTH_CHECK_TIMEOUT)
HEALTH_GENERATE_TIMEOUT_S = 20.0


class _Unworded:
    """The skeleton's formatter slot: GenerateReply words the answer itself."""

    labels_stops = False  # the metrics count each choice's finish as the engine ended it


class GenerateEndpoint:
    """The completions route's checks and prompts for /generate (serving.Endpoint)."""

    id_prefix = "generate"
    reports_spec = True  # meta_info's spec_* fields, as SGLang's
    object_name = "generate"  # unused: the answer is SGLang's, without `object`
    chunk_object_name = "generate"

    def check(self, state: ServerState, body: SGLangCompletion) -> None:
        COMPLETION.check(state, body)

    async def prompts(self, state: ServerState, body: SGLangCompletion) -> list[Prompt]:
        """The completions route's prompts; then, as SGLang does, max_new_tokens is cut to the
        room the longest prompt leaves in the context rather than refused."""
        if body.image_data:
            prompts = await _image_prompts(state, body)
        else:
            prompts = await COMPLETION.prompts(state, body)
        shortest = min(len(p.token_ids) for p in prompts)
        if body.logprob_start_len > shortest:
            raise BadRequest(
                f"logprob_start_len: {body.logprob_start_len} is past the end of the prompt "
                f"({shortest} tokens).",
                "logprob_start_len",
            )
        room = state.max_model_len - max(len(p.token_ids) for p in prompts)
        if body.max_tokens is not None and body.max_tokens > room:
            body.max_tokens = room
        return prompts

    def formatter(
        self, state: ServerState, body: SGLangCompletion, prompts: list[Prompt]
    ) -> _Unworded:
        return _Unworded()


GENERATE = GenerateEndpoint()


async def _image_prompts(state: ServerState, body: SGLangCompletion) -> list[Prompt]:
    """Prompts with image_data: every image loaded and checked (images.py), then each of a
    prompt's `<|image_pad|>` tokens expanded to its image's count, in order (as chat's are)."""
    raw_prompts = prompt_list(body.prompt)
    support = image_support(state.model_dir, state.config.visual)
    batch = len(raw_prompts) > 1
    sources = [
        ImageSource(
            url,
            f"image_data: {f'prompt {p + 1}, ' if batch else ''}image {i + 1}",
            "image_data",
            bare_base64=True,
        )
        for p, urls in enumerate(body.image_data)
        for i, url in enumerate(urls)
    ]
    loaded = await load_image_sources(support, sources, "image_data", state.metrics)
    per_prompt, first = [], 0
    for urls in body.image_data:
        per_prompt.append(loaded[first : first + len(urls)])
        first += len(urls)
    field = body.prompt_param
    pad = state.prompts.tokenizer.convert_ids_to_tokens(support.image_token_id)
    hint = f"Put <|vision_start|>{pad}<|vision_end|> where each image goes."

    def build() -> list[Prompt]:
        return [
            state.prompts.completion(
                raw,
                None,
                images,
                support.image_token_id,
                (field, f"prompt {p + 1} has" if batch else "the prompt has", hint),
            )
            for p, (raw, images) in enumerate(zip(raw_prompts, per_prompt, strict=True))
        ]

    chars = sum(len(p) for p in raw_prompts if isinstance(p, str))
    return await state.prompt_lanes.run(chars, build)


@dataclass
class _Output:
    """One choice's answer so far: what SGLang's cumulative chunks and final object carry."""

    texts: list[str] = field(default_factory=list)  # joined when worded, not once per delta
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    cached_tokens: int = 0
    spec: SpecCounts | None = None  # its MTP counts so far
    finish: str | None = None
    finished_at: float = 0.0  # time.monotonic() when its last delta came

    def feed(self, delta: TextDelta) -> None:
        self.texts.append(delta.text)
        self.output_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_tokens = delta.num_output_tokens
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        self.spec = delta.spec or self.spec
        self.finish = delta.finish_reason
        if self.finish is not None:
            self.finished_at = time.monotonic()

    @property
    def text(self) -> str:
        return "".join(self.texts)


class GenerateReply:
    """Words a /generate answer as SGLang does (serving.Reply): per choice {"text", "output_ids",
    "meta_info"}; one object for one prompt with n = 1, else a list; streamed, each chunk carries
    the choice's text and ids so far (SGLang's default, not incremental), batch chunks an
    "index"."""

    def __init__(self, shape: GenerateShape, arrival: float) -> None:
        self.shape = shape
        self.arrival = arrival  # time.monotonic() when the request came: e2e_latency

    async def collect(self, state: ServerState, request: Request, answer: Answer) -> Any:
        outputs = [_Output() for _ in range(answer.num_choices)]
        async for index, delta in iterate_deltas(answer.group):
            outputs[index].feed(delta)
        ids = self.shape.rids or _choice_ids(answer)
        words = [self._word(state, answer, i, out, ids[i]) for i, out in enumerate(outputs)]
        return words[0] if self.shape.single else words

    async def stream(
        self, state: ServerState, request: Request, answer: Answer, first: tuple[int, TextDelta]
    ) -> AsyncIterator[str]:
        outputs = [_Output() for _ in range(answer.num_choices)]
        ids = self.shape.rids or _choice_ids(answer)
        async with abort_on_disconnect(request, state.client, answer.group):
            try:
                async for index, delta in iterate_deltas(answer.group, first):
                    outputs[index].feed(delta)
                    chunk = self._word(state, answer, index, outputs[index], ids[index])
                    if not self.shape.single:
                        chunk["index"] = index
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except APIError as err:
                yield sse_error(err)
            yield "data: [DONE]\n\n"

    def _word(
        self, state: ServerState, answer: Answer, index: int, out: _Output, choice_id: str
    ) -> dict[str, Any]:
        shape = self.shape
        meta: dict[str, Any] = {
            "id": choice_id,
            "finish_reason": None if out.finish is None else self._finish_reason(state, out),
            "prompt_tokens": answer.prompt_lengths[index // answer.choices_per_prompt],
            "completion_tokens": out.num_tokens,
            "cached_tokens": out.cached_tokens,
        }
        if shape.return_logprob:
            meta.update(self._logprobs(out))
        if state.mtp_step:
            meta.update(spec_meta(out.spec, out.num_tokens))
        if out.finish is not None:
            meta["e2e_latency"] = out.finished_at - self.arrival
        return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}

    def _finish_reason(self, state: ServerState, out: _Output) -> dict[str, Any]:
        """SGLang's finish_reason object: a stop names what matched (the stop string, or the
        token id: eos or one of stop_token_ids), a length its limit."""
        if out.finish == "length":
            return {"type": "length", "length": out.num_tokens}
        if out.finish != "stop":
            return {"type": "abort", "message": f"the request ended: {out.finish}"}
        return {"type": "stop", "matched": self._matched(state, out)}

    def _matched(self, state: ServerState, out: _Output) -> str | int | None:
        """The stop string whose match ended the text (the detokenizer cuts the text before it,
        or after it with no_stop_trim; at one place the first listed wins, as it matches), else
        the last token, which stopped the choice."""
        shape = self.shape
        if shape.keep_stops:
            hits = sorted((s for s in shape.stops if out.text.endswith(s)), key=len, reverse=True)
        elif shape.stops:
            tokenizer = state.prompts.tokenizer
            full = tokenizer.decode(out.output_ids, skip_special_tokens=shape.skip_special_tokens)
            hits = [s for s in shape.stops if full.startswith(s, len(out.text))]
        else:
            hits = []
        if hits:
            return hits[0]
        return out.output_ids[-1] if out.output_ids else None

    def _logprobs(self, out: _Output) -> dict[str, Any]:
        """SGLang's logprob lists: [logprob, token id, text or null] per position; the prompt's
        from logprob_start_len (its first position has no logprob: null)."""
        shape = self.shape
        start = shape.logprob_start_len
        scored = out.prompt_logprobs[start:] if start >= 0 else []
        with_text = shape.text_in_logprobs
        lists: dict[str, Any] = {
            "input_token_logprobs": [
                _entry(e.logprob, e.token_id, e.token, with_text) for e in scored
            ],
            "output_token_logprobs": [
                _entry(e.logprob, e.token_id, e.token, with_text) for e in out.logprobs
            ],
        }
        if shape.top_logprobs_num > 0:
            k = shape.top_logprobs_num
            lists["input_top_logprobs"] = [_top(e, k, with_text) for e in scored]
            lists["output_top_logprobs"] = [_top(e, k, with_text) for e in out.logprobs]
        return lists


def _entry(logprob: float | None, token_id: int, text: str, with_text: bool) -> list:
    return [logprob, token_id, text if with_text else None]


def _top(entry: TokenLogprob, k: int, with_text: bool) -> list | None:
    """An entry's k best alternatives, best first; null where none were scored (a prompt's first
    position)."""
    alternatives = zip(entry.top_ids[:k], entry.top[:k], strict=True)
    listed = [_entry(lp, token_id, text, with_text) for token_id, (text, lp, _) in alternatives]
    return listed or None


def spec_meta(spec: SpecCounts | None, completion_tokens: int) -> dict[str, Any]:
    """SGLang's per-request speculative-decoding fields of meta_info (when MTP is on): verify
    steps, the share of drafts accepted, completion tokens per verify step (SGLang's accept
    length: the prefill's token counts too), the counts, and verify steps by accepted drafts."""
    meta: dict[str, Any] = {"spec_verify_ct": 0, "spec_accept_rate": 0.0, "spec_accept_length": 0}
    if spec is None or not spec.verify_steps:
        return meta
    verify, drafts, accepted = spec.verify_steps, spec.draft_tokens, spec.accepted_tokens
    return {
        "spec_verify_ct": verify,
        "spec_accept_rate": accepted / drafts if drafts else 0.0,
        "spec_accept_length": completion_tokens / verify,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": drafts,
        "spec_accept_histogram": list(spec.histogram),
    }


def _choice_ids(answer: Answer) -> list[str]:
    """The engine's request id of each choice (the router's and /debug/status' name for it)."""
    ids = {choice.index: req_id for req_id, choice in answer.group.choices.items()}
    return [ids[i] for i in range(answer.num_choices)]


async def generate(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    """POST /generate end to end (serving.serve with the completions route's pieces)."""
    arrival = time.monotonic()
    completion, shape = translate(body)
    try:
        return await serve(GENERATE, state, completion, request, GenerateReply(shape, arrival))
    except APIError as err:
        raise renamed(err, completion.prompt_param) from None


async def health_generate(state: ServerState) -> Response:
    """200 once one greedy token went through the whole engine (router, worker, detokenizer);
    503 when the server cannot serve, the engine refuses or fails, or no token comes within
    HEALTH_GENERATE_TIMEOUT_S."""
    group_id = new_request_id("health")
    probe = TokenizedRequest(
        req_id=f"{group_id}-0",
        prompt_token_ids=[0],  # SGLang's probe prompt: any token id will do
        sampling=SamplingOptions(temperature=0.0),
        max_tokens=1,
        arrival_time=time.time(),
    )
    try:
        state.check_accepting()
        group = state.client.submit(group_id, [probe], time.monotonic())
    except APIError as err:
        return _unhealthy(err.message)

    async def finished() -> bool:
        async for _, delta in iterate_deltas(group):
            if delta.finish_reason is not None:  # the token came, or the engine ended it so
                return delta.finish_reason in ("stop", "length")
        return False  # the group ended without it (the engine dropped it)

    try:
        if not await asyncio.wait_for(finished(), HEALTH_GENERATE_TIMEOUT_S):
            return _unhealthy("the probe's request was dropped or failed")
    except asyncio.TimeoutError:
        return _unhealthy(f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s")
    except APIError as err:
        return _unhealthy(err.message)
    finally:
        state.client.abort(group, "deadline")  # nothing open unless the wait gave up
    return Response(status_code=200)


def _unhealthy(reason: str) -> Response:
    return error_response(ServiceUnavailable(f"The engine did not generate: {reason}"))


def model_info(state: ServerState) -> dict[str, Any]:
    """SGLang's /get_model_info keys this server can fill honestly. model_path is the served name,
    never the folder's path on the host (as /v1/models)."""
    config = read_config(state.model_dir)
    return {
        "model_path": state.model_name,
        "tokenizer_path": state.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",  # SGLang's name for weights never updated in place
        "has_image_understanding": image_support(state.model_dir, state.config.visual).enabled,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }
