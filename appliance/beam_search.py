"""Beam search as vLLM runs it (its `use_beam_search` requests and `LLM.beam_search`): not inside
the engine but over it. Each round asks the engine for one token of every live beam, with the
2 x width best logprobs; every beam grows by each of those, ended ones (eos) set aside; the width
best by score stay. Scores are vLLM's: the cumulative logprob over the whole sequence's length
(prompt included, a final eos not) to the power `length_penalty`. With prefix caching a round
recomputes only the new token of each beam: its prompt is the previous round's plus one token.

`BeamSearch` holds one prompt's beams; the server (server/serving_beam.py) and the offline `LLM`
(offline/llm.py) drive it: `prompts()` -> the engine -> `advance(tops)`, until `done`. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: `beam_width` beams returned; `max_tokens` rounds at most; eos (and `stop_token_ids`)
    ends a beam unless `ignore_eos`; `length_penalty` the exponent of the length normalisation."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # taken for vLLM's signature; the logprobs are the model's own
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width: expected an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")


@dataclass
class Beam:
    """One candidate continuation: its tokens after the prompt and their summed logprob."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False  # ended by eos / a stop token id (the last token)


class BeamSearch:
    """One prompt's beam search (see the module docstring)."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        end_ids: Sequence[int],
    ) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.end_ids = set() if params.ignore_eos else set(end_ids)
        self.live: list[Beam] = [Beam()]
        self.completed: list[Beam] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.live or self.rounds >= self.params.max_tokens

    @property
    def num_top(self) -> int:
        """Alternatives a round asks for per beam: 2 x width, so width live ones survive even
        when width of them end."""
        return 2 * self.params.beam_width

    def prompts(self) -> list[list[int]]:
        """The token ids to extend, one per live beam."""
        return [self.prompt + beam.tokens for beam in self.live]

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One round: `tops[i]` the (token id, logprob) alternatives of live beam i."""
        if len(tops) != len(self.live):
            raise ValueError(f"tops: {len(tops)} given for {len(self.live)} live beams")
        grown: list[Beam] = []
        for beam, alternatives in zip(self.live, tops, strict=True):
            for token, logprob in alternatives:
                child = Beam(
                    beam.tokens + [token],
                    beam.logprobs + [logprob],
                    beam.cum_logprob + logprob,
                    token in self.end_ids,
                )
                (self.completed if child.finished else grown).append(child)
        grown.sort(key=self.score, reverse=True)
        self.live = grown[: self.params.beam_width]
        self.rounds += 1

    def score(self, beam: Beam) -> float:
        """vLLM's beam score: cum_logprob / length ** length_penalty, the length counting the
        prompt and not a final end token."""
        length = len(self.prompt) + len(beam.tokens) - (1 if beam.finished else 0)
        return beam.cum_logprob / max(1, length) ** self.params.length_penalty

    def result(self) -> list[Beam]:
        """The width best beams, ended or still live at max_tokens, best first."""
        ranked = sorted(self.completed + self.live, key=self.score, reverse=True)
        return ranked[: self.params.beam_width]
