"""/v1/chat/completions as an `Endpoint` of the handler skeleton (serving.py): load images, render
and tokenize the conversation, word each choice as an assistant message (or message deltas).

Used by app.py. Per choice, model text runs through the reasoning parser and then the tool-call
parser (appliance/parsers) before it becomes `content` / `reasoning_content` / `tool_calls`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from appliance.messages import TextDelta, TokenLogprob
from appliance.parsers import ReasoningParser, ToolCallParser, prompt_opens_reasoning
from appliance.parsers.reasoning import THINK_END, marker_id, reasoning_token_count
from appliance.server.chat_checks import (
    check_messages,
    check_tool_choice,
    check_tools,
    template_kwargs,
)
from appliance.server.images import image_support, load_images, request_preprocess
from appliance.server.logprobs import token_name, top_names, vllm_prompt_logprobs
from appliance.server.prompts import Prompt, kept_tokens, message_chars
from appliance.server.protocol import ChatCompletionRequest, check_chat_output
from appliance.server.serving import Choice, check_n
from appliance.server.state import ServerState
from appliance.server.stops import ChoiceStops, choice_stops


def call_id_seed(seed: int, index: int, prompt_text: str) -> int:
    """The seed of a choice's tool-call ids: a seeded request gets the same ids again, while the
    turns of a seeded conversation (one seed, a longer prompt each turn) do not repeat them, as
    clients match tool results to their calls by id."""
    digest = hashlib.sha256(f"{seed}:{index}:{prompt_text}".encode(errors="replace")).digest()
    return int.from_bytes(digest[:8], "big")


class ChoiceParser:
    """Model text of one choice -> (reasoning, content, tool-call deltas), incrementally."""

    def __init__(
        self, body: ChatCompletionRequest, prompt_text: str, reasoning_mode: str, index: int
    ) -> None:
        opens = prompt_opens_reasoning(prompt_text)
        enabled = reasoning_mode == "on" or (reasoning_mode == "auto" and opens)
        self.reasoning = ReasoningParser(starts_in_reasoning=opens, enabled=enabled)
        seed = None if body.seed is None else call_id_seed(body.seed, index, prompt_text)
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
        self.tools = ToolCallParser(body.tools, tool_choice, body.parallel_tool_calls, seed)
        self.made_calls = False
        self.had_reasoning = False  # some reasoning_content came out (usage's reasoning_tokens)

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
        self.had_reasoning = self.had_reasoning or bool(reasoning)
        return reasoning, text_out, calls

    def finish_reason(self, reason: str) -> str:
        """The choice's finish_reason: "tool_calls" where it made calls and ended on its own, or
        was cut by max_tokens after its last call closed (vLLM says "tool_calls" there too); a
        call cut open stays "length", so the client knows its arguments may be incomplete."""
        if not self.made_calls:
            return reason
        closed = reason == "length" and not self.tools.ended_in_call
        return "tool_calls" if reason == "stop" or closed else reason


def chat_logprobs(entries: list[TokenLogprob], as_ids: bool = False) -> list[dict[str, Any]]:
    """`logprobs.content`; `as_ids` (return_tokens_as_token_ids): tokens named "token_id:<id>"."""
    out = []
    for e in entries:
        top = [
            {"token": name, "logprob": lp, "bytes": b}
            for name, (_, lp, b) in zip(top_names(e, as_ids), e.top, strict=True)
        ]
        token = token_name(e.token, e.token_id, as_ids)
        out.append({"token": token, "logprob": e.logprob, "bytes": e.bytes, "top_logprobs": top})
    return out


class ChatFormatter:
    """Chat choices: a role chunk, then reasoning / content / tool-call deltas, or one message."""

    labels_stops = True  # a "stop" that made tool calls is worded "tool_calls"

    def __init__(
        self,
        parsers: list[ChoiceParser],
        prompt_top_k: int | None = None,
        token_ids_as_names: bool = False,
        think_end: int | None = None,
        prompt_ids: list[int] | None = None,
        stops: ChoiceStops | None = None,
    ) -> None:
        self.stops = stops  # vLLM's stop_reason of each choice (None: not reported)
        self.parsers = parsers  # one per choice
        self.prompt_ids = prompt_ids  # vLLM's return_token_ids: the prompt's (None: not asked)
        self.prompt_top_k = prompt_top_k  # vLLM's prompt_logprobs (None: the prompt unscored)
        self.as_ids = token_ids_as_names  # vLLM's return_tokens_as_token_ids
        self.think_end = think_end  # the `</think>` token id, where reasoning tokens stop
        self.output_ids: list[list[int]] = [[] for _ in parsers]  # per choice, as they came

    def observe(self, index: int, delta: TextDelta) -> None:
        self.output_ids[index] += delta.token_ids
        if self.stops is not None:
            self.stops.observe(index, delta)

    def usage_details(self, indexes: Iterable[int]) -> dict[str, Any]:
        """OpenAI's completion_tokens_details of these choices: their reasoning tokens."""
        count = sum(
            reasoning_token_count(self.output_ids[i], self.think_end, self.parsers[i].had_reasoning)
            for i in indexes
        )
        return {"completion_tokens_details": {"reasoning_tokens": count}}

    def opening(self, index: int) -> Choice:
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def opening_fields(self) -> dict[str, Any]:
        return {} if self.prompt_ids is None else {"prompt_token_ids": self.prompt_ids}

    def delta_choice(self, index: int, delta: TextDelta) -> Choice | None:
        parser = self.parsers[index]
        final = delta.finish_reason is not None
        reasoning, content, calls = parser.feed(delta.text, final)
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        logprobs = chat_logprobs(delta.logprobs, self.as_ids) if delta.logprobs else None
        ids = self.prompt_ids is not None and bool(delta.token_ids)
        if not out and not logprobs and not final and not ids:
            return None
        choice = {
            "index": index,
            "delta": out,
            "logprobs": {"content": logprobs} if logprobs else None,
            "finish_reason": parser.finish_reason(delta.finish_reason) if final else None,
        }
        if final and self.stops is not None:
            choice["stop_reason"] = self.stops.reason(index, delta.finish_reason)
        if self.prompt_ids is not None:
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
        """The prompt's entries are the answer's (answer_fields), not a choice's."""
        parser = self.parsers[index]
        reasoning, content, _ = parser.feed(text, final=True)
        tool_calls = parser.tools.result().tool_calls
        # content is null only for a pure tool-call answer, as OpenAI does.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not tool_calls else None,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "message": message,
            "logprobs": (
                None if logprobs is None else {"content": chat_logprobs(logprobs, self.as_ids)}
            ),
            "finish_reason": parser.finish_reason(finish_reason),
        }
        if self.stops is not None:
            choice["stop_reason"] = self.stops.reason(index, finish_reason)
        if self.prompt_ids is not None:
            choice["token_ids"] = self.output_ids[index]
        return choice

    def answer_fields(self, prompt_logprobs: list[list[TokenLogprob] | None]) -> dict[str, Any]:
        """vLLM's top-level prompt_logprobs and prompt_token_ids: the n choices share the one
        rendered prompt."""
        fields = self.opening_fields()
        if self.prompt_top_k is not None:
            entries = next((p for p in prompt_logprobs if p is not None), [])
            scored = vllm_prompt_logprobs(entries, self.prompt_top_k, self.as_ids)
            fields["prompt_logprobs"] = scored
        return fields


class ChatEndpoint:
    """The chat route's checks, prompt and formatter for the skeleton (serving.Endpoint)."""

    id_prefix = "chatcmpl"
    reports_spec = False  # only with --per-request-spec-decode-metrics (serving.choice_requests)
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def check(self, state: ServerState, body: ChatCompletionRequest) -> None:
        check_n(state, body)
        check_chat_output(body)
        check_messages(body.messages)
        check_tools(body.tools)
        check_tool_choice(body.tool_choice, body.tools)
        template_kwargs(body, state.config.trust_request_chat_template, state.template_defaults)

    async def prompts(self, state: ServerState, body: ChatCompletionRequest) -> list[Prompt]:
        num_chars = message_chars(body.messages)
        state.prompts.check_chars(num_chars, "messages")  # before fetching images or queueing
        keep = kept_tokens(body.truncate_prompt_tokens, state.prompts.max_model_len)
        support = image_support(state.model_dir, state.config.visual)
        preprocess = request_preprocess(support, body.mm_processor_kwargs)
        images = await load_images(support, body.messages, state.metrics, preprocess)
        prompt = await state.prompt_lanes.run(
            num_chars,
            state.prompts.chat,
            body.messages,
            body.tools,
            template_kwargs(
                body, state.config.trust_request_chat_template, state.template_defaults
            ),
            body.add_generation_prompt,
            images,
            support.image_token_id,
            body.continue_final_message,
            keep,
        )
        return [prompt]

    def formatter(
        self, state: ServerState, body: ChatCompletionRequest, prompts: list[Prompt]
    ) -> ChatFormatter:
        (prompt,) = prompts
        text, mode = prompt.text or "", state.config.reasoning
        parsers = [ChoiceParser(body, text, mode, i) for i in range(body.n)]
        return ChatFormatter(
            parsers,
            body.prompt_logprobs,
            body.return_tokens_as_token_ids,
            think_end_id(state),
            list(prompt.token_ids) if body.return_token_ids else None,
            choice_stops(state, body, body.n),
        )


def think_end_id(state: ServerState) -> int | None:
    """The tokenizer's `</think>` token id (None: it has no such token)."""
    return marker_id(state.prompts.tokenizer, THINK_END)


CHAT = ChatEndpoint()
