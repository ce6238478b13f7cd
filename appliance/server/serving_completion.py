"""/v1/completions as an `Endpoint` of the handler skeleton (serving.py): string or token-id
prompts (one or a batch), n choices each, worded as text choices with optional echo.

Used by app.py. Choice index = prompt index x n + choice number, as OpenAI numbers them.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

import msgspec

from appliance.messages import TextDelta, TokenLogprob
from appliance.server.errors import BadRequest
from appliance.server.images import image_support, request_preprocess
from appliance.server.logprobs import token_name, top_names, vllm_prompt_logprobs
from appliance.server.prompts import Prompt, kept_tokens
from appliance.server.protocol import CompletionRequest
from appliance.server.serving import Choice, check_n
from appliance.server.state import ServerState
from appliance.server.stops import ChoiceStops, choice_stops


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt: expected a non-empty string or list.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class LegacyLogprobs:
    """Accumulates the /v1/completions logprobs object of one choice."""

    def __init__(self, offset: int, as_ids: bool = False) -> None:
        self.offset = offset  # characters before the first generated token (echoed prompt)
        self.as_ids = as_ids  # return_tokens_as_token_ids: tokens named "token_id:<id>"
        # a character split over several tokens counts once, at the token that completes it
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def entries(self, items: list[TokenLogprob]) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in items:
            name = token_name(e.token, e.token_id, self.as_ids)
            tokens.append(name)
            token_logprobs.append(e.logprob)
            # a prompt's first token has no logprob and no alternatives (null, as OpenAI); else
            # the top N and the token itself, as OpenAI's up to N + 1 entries (and vLLM's). Two
            # tokens spelt alike (byte pieces shown as U+FFFD) share a key: it keeps the better
            # logprob (the top N come best first), so the key with the highest value is the
            # most likely text, as clients read it (lm-eval's greedy check)
            top.append(None if e.logprob is None else {})
            if top[-1] is not None:
                for token, (_, logprob, _) in zip(top_names(e, self.as_ids), e.top, strict=True):
                    top[-1].setdefault(token, logprob)
                top[-1].setdefault(name, e.logprob)
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(bytes(e.bytes)))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def scored_entries(
        self, prompt_items: list[TokenLogprob], items: list[TokenLogprob], echo: str
    ) -> dict[str, Any]:
        """The prompt's entries, then the generated tokens' from the end of the echoed `echo`:
        its tokens may spell it otherwise (the empty prompt's <|endoftext|>, text the tokenizer
        normalised to NFC), and the offsets index the text the client got."""
        scored = self.entries(prompt_items)
        if prompt_items:
            self.offset = len(echo)
            self._utf8.reset()
        generated = self.entries(items)
        return {key: scored[key] + generated[key] for key in scored}


def _cut_top(entries: list[TokenLogprob], top_k: int) -> list[TokenLogprob]:
    """The entries with their first top_k alternatives only: the engine scores the prompt once,
    with the larger of echo's and prompt_logprobs' k."""
    return [
        msgspec.structs.replace(e, top=e.top[:top_k], top_ids=e.top_ids[:top_k])
        if len(e.top) > top_k
        else e
        for e in entries
    ]


class CompletionFormatter:
    """Text choices; an echoed prompt leads the choice's text (in its first streamed chunk), and
    with `echo_top_k` (echo + logprobs) its token entries lead the choice's logprobs, offsets
    from 0. With `prompt_top_k` (vLLM's prompt_logprobs) a JSON choice also carries them in
    vLLM's shape (never streamed: check_prompt_logprobs)."""

    labels_stops = False  # finish_reason as the engine ended the choice

    def __init__(
        self,
        echoes: list[str],
        echo_top_k: int | None = None,
        prompt_top_k: int | None = None,
        token_ids_as_names: bool = False,
        prompt_ids: list[list[int]] | None = None,
        stops: ChoiceStops | None = None,
    ) -> None:
        self.stops = stops  # vLLM's stop_reason of each choice (None: not reported)
        self.echoes = echoes  # per choice: the prompt text to echo ("" without echo)
        # vLLM's return_token_ids: per choice its prompt's ids (None: not asked), and then the
        # ids it generated; a stream sends the prompt's in each choice's first chunk
        self.prompt_ids = prompt_ids
        self.output_ids: list[list[int]] = [[] for _ in echoes]
        self.unsent_prompt = [prompt_ids is not None] * len(echoes)
        self.pending_echo = list(echoes)  # per choice: echo not streamed yet
        self.echo_top_k = echo_top_k  # echo + logprobs: the alternatives per prompt entry
        self.prompt_top_k = prompt_top_k
        self.as_ids = token_ids_as_names  # vLLM's return_tokens_as_token_ids
        # per choice, for streaming
        self.offsets = [LegacyLogprobs(self._first_offset(e), self.as_ids) for e in echoes]

    def _first_offset(self, echo: str) -> int:
        """text_offset of the first entry: the echoed prompt's own entries start at 0."""
        return 0 if self.echo_top_k is not None else len(echo)

    def _echo_entries(self, prompt_items: list[TokenLogprob] | None) -> list[TokenLogprob]:
        if self.echo_top_k is None or prompt_items is None:
            return []
        return _cut_top(prompt_items, self.echo_top_k)

    def opening(self, index: int) -> None:
        return None

    def opening_fields(self) -> dict[str, Any]:
        return {}

    def delta_choice(self, index: int, delta: TextDelta) -> Choice | None:
        text = self.pending_echo[index] + delta.text
        self.pending_echo[index] = ""
        prompt_items, items = self._echo_entries(delta.prompt_logprobs), delta.logprobs or []
        ids = self.prompt_ids is not None and bool(delta.token_ids)
        if not text and not prompt_items and not items and delta.finish_reason is None and not ids:
            return None
        logprobs = None
        if prompt_items or items:
            echo = self.echoes[index]
            logprobs = self.offsets[index].scored_entries(prompt_items, items, echo)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
        if delta.finish_reason is not None and self.stops is not None:
            choice["stop_reason"] = self.stops.reason(index, delta.finish_reason)
        if self.prompt_ids is not None:
            if self.unsent_prompt[index]:
                choice["prompt_token_ids"] = self.prompt_ids[index]
                self.unsent_prompt[index] = False
            choice["token_ids"] = list(delta.token_ids)
        return choice

    def final_choice(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> Choice:
        echo = self.echoes[index]
        entries = None
        if self.echo_top_k is not None or logprobs is not None:
            entries = LegacyLogprobs(self._first_offset(echo), self.as_ids).scored_entries(
                self._echo_entries(prompt_logprobs), logprobs or [], echo
            )
        choice = {
            "index": index,
            "text": echo + text,
            "logprobs": entries,
            "finish_reason": finish_reason,
        }
        if self.stops is not None:
            choice["stop_reason"] = self.stops.reason(index, finish_reason)
        if self.prompt_top_k is not None:
            scored = prompt_logprobs or []
            choice["prompt_logprobs"] = vllm_prompt_logprobs(scored, self.prompt_top_k, self.as_ids)
        if self.prompt_ids is not None:
            choice["prompt_token_ids"] = self.prompt_ids[index]
            choice["token_ids"] = self.output_ids[index]
        return choice

    def answer_fields(self, prompt_logprobs: list[list[TokenLogprob] | None]) -> dict[str, Any]:
        return {}  # each choice carries its own prompt's

    def observe(self, index: int, delta: TextDelta) -> None:
        if self.prompt_ids is not None:
            self.output_ids[index] += delta.token_ids
        if self.stops is not None:
            self.stops.observe(index, delta)

    def usage_details(self, indexes: Iterable[int]) -> dict[str, Any]:
        return {}  # OpenAI's completions usage has the token counts only


class CompletionEndpoint:
    """The legacy route's checks, prompts and formatter for the skeleton (serving.Endpoint)."""

    id_prefix = "cmpl"
    reports_spec = False  # only with --per-request-spec-decode-metrics (serving.choice_requests)
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def check(self, state: ServerState, body: CompletionRequest) -> None:
        if body.suffix:
            raise BadRequest("suffix: not supported.", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise BadRequest(
                f"best_of: must be at least n ({body.n}), got {body.best_of}."
                if body.best_of < body.n
                else "best_of: more candidates than n is not supported (every sequence "
                "generated is returned); ask for n instead.",
                "best_of",
            )
        check_n(state, body)
        # no images here, but the chat route's rule for the field: a bad value is a 400 anyway
        request_preprocess(
            image_support(state.model_dir, state.config.visual), body.mm_processor_kwargs
        )

    async def prompts(self, state: ServerState, body: CompletionRequest) -> list[Prompt]:
        raw_prompts = prompt_list(body.prompt)
        keep = kept_tokens(body.truncate_prompt_tokens, state.prompts.max_model_len)
        text_chars = [len(p) for p in raw_prompts if isinstance(p, str)]
        for num_chars in text_chars:
            state.prompts.check_chars(num_chars, "prompt")  # before queueing for a lane
        return await state.prompt_lanes.run(
            sum(text_chars), lambda: [state.prompts.completion(p, keep) for p in raw_prompts]
        )

    def formatter(
        self, state: ServerState, body: CompletionRequest, prompts: list[Prompt]
    ) -> CompletionFormatter:
        echoes: list[str] = []
        for prompt in prompts:
            echoes += [_echo(state, body, prompt)] * body.n
        ids = [list(p.token_ids) for p in prompts for _ in range(body.n)]
        return CompletionFormatter(
            echoes,
            body.echo_logprobs(),
            body.prompt_logprobs,
            body.return_tokens_as_token_ids,
            ids if body.return_token_ids else None,
            choice_stops(state, body, len(echoes)),
        )


def _echo(state: ServerState, body: CompletionRequest, prompt: Prompt) -> str:
    if not body.echo:
        return ""
    return prompt.text if prompt.text is not None else state.prompts.decode(prompt.token_ids)


COMPLETION = CompletionEndpoint()
