"""What the offline `LLM` returns, in vLLM's shapes: `CompletionOutput` (one choice; a prompt's
first one also stands for the prompt, as vLLM's RequestOutput) and `Logprob`. Built by
offline/llm.py from the detokenizer's deltas and the router's token updates."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.messages import TokenLogprob

# vLLM's per-position logprobs: token id -> Logprob (the chosen token and the top alternatives)
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank among the vocabulary's (1 = most
    likely; None when it was not among the top asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One choice of one prompt. `generate` returns each prompt's first choice, which also holds
    the prompt's choices as `outputs` (vLLM's RequestOutput.outputs): vLLM's
    `out[i].outputs[j].text` reads choice j of prompt i, and `out[i].text` its first choice."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids (a final stop id included)
    text: str = ""
    finish_reason: str | None = None
    # vLLM's: the stop string or stop_token_ids id that ended it; None for eos or a length finish
    stop_reason: str | int | None = None
    # SamplingParams.logprobs: per generated token, {id: Logprob} of it and the top alternatives
    logprobs: list[LogprobsDict] | None = None
    # SamplingParams.prompt_logprobs: per prompt token, as logprobs (None for the first)
    prompt_logprobs: list[LogprobsDict | None] | None = None
    index: int = 0  # which of the prompt's n choices
    prompt: str | None = None  # the prompt as given, when it was text
    request_id: str = ""
    # the prompt's choices, this one among them (vLLM's RequestOutput.outputs)
    outputs: list[CompletionOutput] = field(default_factory=list, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' logprobs, when SamplingParams.logprobs asked
        for them."""
        if self.logprobs is None:
            return None
        return sum(d[t].logprob for t, d in zip(self.token_ids, self.logprobs))


def logprob_dicts(
    entries: list[TokenLogprob], token_ids: list[int], tops: list[list[tuple[int, float]]] | None
) -> list[LogprobsDict | None]:
    """vLLM's logprob dicts from the detokenizer's entries (texts) and the router's top ids: the
    token itself, then its top alternatives best first. None where a token has no logprob (a
    prompt's first). The token's rank is its vocabulary rank where the engine computed one (prompt
    tokens, as vLLM's), else its place among the top alternatives (None when not among them)."""
    dicts: list[LogprobsDict | None] = []
    for i, (entry, token_id) in enumerate(zip(entries, token_ids)):
        if entry.logprob is None:
            dicts.append(None)
            continue
        top = tops[i] if tops else []
        ranks = {tok: rank for rank, (tok, _) in enumerate(top, 1)}
        rank = entry.rank or ranks.get(token_id)
        chosen = {token_id: Logprob(entry.logprob, rank, entry.token)}
        alternatives = {
            tok: Logprob(lp, rank, text)
            for rank, ((tok, lp), (text, _, _)) in enumerate(zip(top, entry.top), 1)
        }
        dicts.append(chosen | {t: v for t, v in alternatives.items() if t != token_id})
    return dicts
