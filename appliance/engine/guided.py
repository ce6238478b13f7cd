"""Guided decoding on the worker (issue 18): one xgrammar matcher per request with a guide, the
token bitmask of the rows a step samples, and the matcher advanced by the tokens the step commits.

Called by the model runner: `admit` / `release` with the plan, `bitmask` before sampling, `advance`
after the commit. Every TP rank keeps its own matchers (every rank samples the same tokens).

MTP: a verify chunk's row j is sampled after drafts 0..j-1, so its mask is the matcher's state
after them (the drafts are accepted tentatively, then rolled back). When the grammar rejects draft
j, row j's sample (masked, hence valid) cannot equal it, so acceptance ends there and the rows past
it are never kept: they get no mask. The output is the one MTP off would give.

A matcher waiting for `guide.after_token` (</think>: the reasoning stays free) leaves its rows
unmasked until that token is sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from appliance.grammars import GrammarCompiler, xgrammar
from appliance.logging import get_logger
from appliance.messages import Guide

log = get_logger(__name__)


@dataclass
class _Matcher:
    compiled: Future  # -> xgrammar CompiledGrammar
    after_token: int  # -1: constrained from the first token
    backlog: list[int] = field(default_factory=list)  # tokens to replay once compiled
    matcher: Any = None
    waiting: bool = False  # still before after_token
    broken: bool = False  # a committed token the grammar rejected (logged once; unmasked after)
    reported: bool = False  # the router was told the grammar is compiled


class GuidedDecoding:
    """Matchers of one worker's guided requests, keyed by request slot."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        compiler: GrammarCompiler | None = None,  # a shared one (benchmarks); else its own
    ) -> None:
        self.vocab_size = vocab_size
        self._compiler = compiler or GrammarCompiler(load_tokenizer, vocab_size, stop_token_ids)
        self._stop_ids = list(stop_token_ids)
        self._slots: dict[int, _Matcher] = {}

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def __bool__(self) -> bool:
        return bool(self._slots)

    def admit(self, slot: int, guide: Guide, output_tokens: Sequence[int]) -> None:
        """Starts compiling (or finds the cached grammar); `output_tokens`: the request's tokens
        generated before it was preempted and recomputed, replayed into the matcher."""
        state = _Matcher(self._compiler.submit(guide), guide.after_token)
        state.waiting = guide.after_token >= 0
        state.backlog = list(output_tokens)
        self._slots[slot] = state

    def release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._slots.pop(slot, None)

    def newly_compiled(self) -> list[int]:
        """Slots whose grammar finished compiling since the last call (the router plans their
        first sample only then, so no step waits on a compile)."""
        done = [slot for slot, st in self._slots.items() if not st.reported and st.compiled.done()]
        for slot in done:
            self._slots[slot].reported = True
        return done

    def wait_compiling(self, timeout_s: float) -> None:
        """Blocks until a grammar not yet reported finishes compiling, or `timeout_s`."""
        pending = [st.compiled for st in self._slots.values() if not st.reported]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _ready(self, slot: int) -> _Matcher:
        """The slot's matcher; waits for its compile if it is still running (the server compiled
        the same guide before submitting, so this is usually a short wait or none)."""
        state = self._slots[slot]
        if state.matcher is None:
            state.matcher = xgrammar().GrammarMatcher(state.compiled.result())
            backlog, state.backlog = state.backlog, []
            self._consume(state, backlog)
        return state

    # ------------------------------------------------------------------ per step
    def bitmask(self, rows: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor | None:
        """rows: per sampling chunk of the step, in order, (req slot, its MTP drafts) — a chunk
        samples len(drafts) + 1 rows. Returns the int32 bitmask [S, ceil(V / 32)] on the host (bit
        t of a row set = token t allowed), or None when no row is guided."""
        if not any(slot in self._slots for slot, _ in rows):
            return None
        xgr = xgrammar()
        total = sum(len(drafts) + 1 for _, drafts in rows)
        mask = xgr.allocate_token_bitmask(total, self.vocab_size)  # all allowed
        first = 0
        for slot, drafts in rows:
            if slot in self._slots:
                self._fill(self._ready(slot), drafts, mask, first)
            first += len(drafts) + 1
        return mask

    def _fill(self, state: _Matcher, drafts: Sequence[int], mask: torch.Tensor, first: int) -> None:
        if state.broken:
            return
        matcher, waiting, consumed = state.matcher, state.waiting, 0
        for j in range(len(drafts) + 1):
            if not waiting:
                self._fill_row(matcher, mask, first + j)
            if j == len(drafts):
                break
            token = drafts[j]
            if waiting:
                waiting = token != state.after_token
            elif not matcher.is_terminated() and matcher.accept_token(token):
                consumed += 1
            else:
                break  # rows past a rejected draft are never kept
        if consumed:
            matcher.rollback(consumed)

    def _fill_row(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        if matcher.is_terminated():  # past the stop token: only stop tokens (the request ends)
            mask[row] = 0
            for token in self._stop_ids:
                mask[row, token // 32] |= _bit(token % 32)
            return
        matcher.fill_next_token_bitmask(mask, row)

    def terminated(self, slot: int) -> bool:
        """The slot's grammar has accepted its stop token."""
        return self._ready(slot).matcher.is_terminated()

    def advance(self, slot: int, tokens: Sequence[int]) -> None:
        """The tokens the slot's request committed this step (after acceptance)."""
        if slot in self._slots:
            self._consume(self._ready(slot), tokens)

    def _consume(self, state: _Matcher, tokens: Sequence[int]) -> None:
        for token in tokens:
            if state.broken:
                return
            if state.waiting:
                state.waiting = token != state.after_token
                continue
            if state.matcher.is_terminated():
                return  # the stop token was accepted: the router ends the request
            if not state.matcher.accept_token(token):
                log.warning("guided decoding: token %d rejected by its grammar; unmasked", token)
                state.broken = True


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as a signed Python int (bit 31 is the sign)."""
    return -(2**31) if index == 31 else 1 << index
