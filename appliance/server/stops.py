"""vLLM's `stop_reason` on the chat and completions choices (appliance/stop_reasons.py): each
choice's tokens and text as its deltas came, and what ended it (the stop token id, the stop
string, "repetition_detected" or null) once it ends."""

from __future__ import annotations

from collections.abc import Callable

from appliance.messages import TextDelta
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest
from appliance.server.state import ServerState
from appliance.stop_reasons import stop_reason


class ChoiceStops:
    def __init__(
        self,
        num_choices: int,
        stops: str | list[str] | None,
        stop_token_ids: list[int] | None,
        decode: Callable[[list[int]], str],  # the tokenizer's, as the detokenizer decodes
    ) -> None:
        self.stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.stop_token_ids = list(stop_token_ids or [])
        self.decode = decode
        self.ids: list[list[int]] = [[] for _ in range(num_choices)]
        self.texts: list[list[str]] = [[] for _ in range(num_choices)]

    def observe(self, index: int, delta: TextDelta) -> None:
        self.ids[index] += delta.token_ids
        self.texts[index].append(delta.text)

    def reason(self, index: int, finish: str | None) -> int | str | None:
        ids = self.ids[index]
        text = "".join(self.texts[index])
        return stop_reason(
            finish, ids, text, lambda: self.decode(ids), self.stop_token_ids, self.stops
        )


def choice_stops(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, num_choices: int
) -> ChoiceStops:
    """What a route's choices need for vLLM's stop_reason."""
    tokenizer, skip = state.prompts.tokenizer, body.skip_special_tokens
    return ChoiceStops(
        num_choices,
        body.stop,
        body.stop_token_ids,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=skip),
    )
