"""vLLM's `stop_reason` of an ended sequence, worked out after the fact from its tokens and text
(the engine reports only the finish reason): the stop token id that ended a "stop" finish (not
eos), or the stop string that did; "repetition_detected" for a "repetition" finish; None
otherwise. Shared by the server's choices (appliance/server/serving_*.py) and the offline
outputs (appliance/offline/outputs.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_reason(
    finish: str | None,
    token_ids: Sequence[int],
    text: str,  # the sequence's text as returned (cut before a stop string unless it is kept)
    full_text: Callable[[], str],  # the whole text of token_ids (decoded only when needed)
    stop_token_ids: Sequence[int],
    stops: Sequence[str],
) -> int | str | None:
    """A stop id is the last token; a stop string ends the text (kept) or follows it in the
    whole text."""
    if finish == "repetition":
        return "repetition_detected"
    if finish != "stop":
        return None
    if token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[-1]
    if not stops:
        return None
    kept = next((s for s in stops if text.endswith(s)), None)
    if kept is not None:
        return kept
    rest = full_text()[len(text) :]
    return next((s for s in stops if rest.startswith(s)), None)
