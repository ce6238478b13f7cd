"""The offline `LLM.beam_search` (vLLM's): appliance/beam_search.py over the LLM's own engine,
one `generate` call a round (one token for every live beam of every prompt, its 2 x width best
logprobs). Prompts as `generate` takes them (text, token ids, prompt dicts with images); the
answer in vLLM's shapes: per prompt a `BeamSearchOutput` whose `sequences` are the width best,
best first, each with the prompt's and its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from appliance.beam_search import Beam, BeamSearch, BeamSearchParams
from appliance.offline.outputs import Logprob
from appliance.offline.prompts import OfflinePrompt, read_prompt
from appliance.sampling_params import SamplingParams


@dataclass
class BeamSearchSequence:
    """vLLM's: `tokens` the prompt's and the beam's; `logprobs` one {token id: Logprob} per
    generated token; `text` the generated text (special tokens skipped)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos or a stop token id) | "length"
    stop_reason: int | None = None  # the end token, when one ended it


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_search(llm: Any, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`llm`: the offline LLM (its generate, tokenizer, images and eos ids)."""
    if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    read = [
        p if isinstance(p, OfflinePrompt) else read_prompt(llm.tokenizer, llm.images, p, i, None)
        for i, p in enumerate(prompts)
    ]
    searches = [BeamSearch(p.token_ids, params, llm.eos_token_ids) for p in read]
    while not all(s.done for s in searches):
        live = [(p, s) for p, s in zip(read, searches, strict=True) if not s.done]
        asked = [replace(p, token_ids=ids) for p, s in live for ids in s.prompts()]
        one = SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=True, logprobs=live[0][1].num_top
        )
        outs = llm.generate(asked, one)
        first = 0
        for _, search in live:
            count = len(search.live)
            tops = [
                [(token, lp.logprob) for token, lp in out.logprobs[0].items()]
                for out in outs[first : first + count]
            ]
            search.advance([sorted(t, key=lambda pair: -pair[1])[: search.num_top] for t in tops])
            first += count
    return [BeamSearchOutput([_sequence(llm, s, b) for b in s.result()]) for s in searches]


def _sequence(llm: Any, search: BeamSearch, beam: Beam) -> BeamSearchSequence:
    generated = beam.tokens[:-1] if beam.finished else beam.tokens
    return BeamSearchSequence(
        tokens=search.prompt + beam.tokens,
        logprobs=[{t: Logprob(lp, None)} for t, lp in zip(beam.tokens, beam.logprobs, strict=True)],
        cum_logprob=beam.cum_logprob,
        text=llm.tokenizer.hf.decode(generated, skip_special_tokens=True),
        finish_reason="stop" if beam.finished else "length",
        stop_reason=beam.tokens[-1] if beam.finished else None,
    )
