"""The detokenizer's logic: RouterOutput batches in, DetokOutput batches (text deltas) out.

Driven by the detokenizer process loop (process.py); no sockets here, so tests call `process()`
directly.
"""

from __future__ import annotations

from appliance.detokenizer.incremental import RequestDetokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import (
    DetokOutput,
    FinishRequest,
    RouterOutput,
    TextDelta,
    TokenLogprob,
    TokenUpdate,
)


class Detokenizer:
    """Keeps one RequestDetokenizer per live request; forgets it when the request finishes."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestDetokenizer] = {}

    @property
    def num_live(self) -> int:
        return len(self._requests)

    def process(self, out: RouterOutput) -> tuple[DetokOutput, list[FinishRequest]]:
        """Returns the deltas for the server and the stop-string finishes for the router."""
        for reg in out.registers:
            self._requests[reg.req_id] = RequestDetokenizer(self.tokenizer, reg.params)
        deltas: list[TextDelta] = []
        finishes: list[FinishRequest] = []
        for update in out.updates:
            delta = self._apply(update, finishes)
            if delta is not None:
                deltas.append(delta)
        return DetokOutput(deltas=deltas), finishes

    def _apply(self, update: TokenUpdate, finishes: list[FinishRequest]) -> TextDelta | None:
        req_id = update.req_id
        state = self._requests.get(req_id)
        if state is None:
            # Rejected before registration, or tokens still in flight after a stop string matched.
            if update.finish_reason == "error":
                return TextDelta(
                    req_id, "", [], 0, "error", error=update.error, error_status=update.error_status
                )
            return None
        finish = update.finish_reason
        # The router's "stop" ends on the token that stopped it (eos or a stop_token_ids id): it
        # counts and has its logprob, but its text is left out unless the request keeps stops
        # (include_stop_str_in_output), as vLLM and SGLang do.
        ids = update.token_ids
        stop_token = finish == "stop" and bool(ids) and not state.params.include_stop_str_in_output
        consumed = 0
        for token_id in ids[:-1] if stop_token else ids:
            state.add_token(token_id)
            consumed += 1
            if state.stopped:
                break
        unread = 0
        if stop_token and not state.stopped:
            consumed += 1
            unread = 1
        if state.stopped:
            if finish is None:
                finishes.append(FinishRequest(req_id, "stop"))
            finish = "stop"
        elif finish is not None:
            state.flush()
        text = state.take_delta(final=finish is not None)
        token_ids = list(update.token_ids[:consumed])
        logprobs = self._logprobs(update, consumed) if state.params.logprobs else None
        scores = update.prompt_logprobs
        prompt_logprobs = None
        if scores is not None:
            prompt_logprobs = self._entries(
                scores.token_ids, scores.logprobs, scores.top, scores.ranks
            )
        if finish is not None:
            del self._requests[req_id]
        if not text and not token_ids and finish is None and prompt_logprobs is None:
            return None
        return TextDelta(
            req_id,
            text,
            token_ids,
            len(state.token_ids) + unread,
            finish,
            logprobs,
            error=update.error,
            error_status=update.error_status,
            prompt_logprobs=prompt_logprobs,
            cached_tokens=update.cached_tokens,
            spec=update.spec,
            timing=update.timing,
        )

    def _logprobs(self, update: TokenUpdate, consumed: int) -> list[TokenLogprob] | None:
        if update.logprobs is None:
            return None
        return self._entries(
            update.token_ids[:consumed], update.logprobs[:consumed], update.top_logprobs
        )

    def _entries(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        tops: list[list[tuple[int, float]]] | None,
        ranks: list[int] | None = None,
    ) -> list[TokenLogprob]:
        """OpenAI logprob entries (token text and bytes, its logprob, the top alternatives'), with
        the ids behind them and, for prompt tokens, their vocabulary ranks (`ranks`)."""
        entries: list[TokenLogprob] = []
        entry = self.tokenizer.token_entry
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            text, raw = entry(token_id)
            top: list[tuple[str, float, list[int]]] = []
            top_ids: list[int] = []
            if tops is not None:
                for tok, lp in tops[i]:
                    t_text, t_raw = entry(tok)
                    top.append((t_text, lp, t_raw))
                    top_ids.append(tok)
            rank = ranks[i] if ranks else 0
            entries.append(TokenLogprob(text, logprob, raw, top, token_id, top_ids, rank))
        return entries
