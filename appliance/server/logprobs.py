"""Logprob entries as the server renders them: vLLM's return_tokens_as_token_ids names and its
prompt_logprobs dicts. Called by serving_chat.py and serving_completion.py."""

from __future__ import annotations

from typing import Any

from appliance.messages import TokenLogprob


def token_name(text: str, token_id: int, as_ids: bool) -> str:
    """A logprob entry's token string: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:<id>" (which tells apart tokens whose bytes are no whole character)."""
    return f"token_id:{token_id}" if as_ids else text


def top_names(entry: TokenLogprob, as_ids: bool) -> list[str]:
    """The token strings of an entry's top alternatives (token_name's, in `top`'s order)."""
    if as_ids:
        return [f"token_id:{token_id}" for token_id in entry.top_ids]
    return [text for text, _, _ in entry.top]


def vllm_prompt_logprobs(
    entries: list[TokenLogprob], top_k: int, as_ids: bool
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing scores it) or, keyed by
    token id, the token itself (rank: its place in the whole vocabulary) and then its `top_k`
    best alternatives (rank: their place among them); one entry where the token is among them.
    The engine may have scored more alternatives (echo's k): the first top_k are kept."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        own = token_name(entry.token, entry.token_id, as_ids)
        scores = {str(entry.token_id): _vllm_logprob(entry.logprob, entry.rank or None, own)}
        alternatives = zip(entry.top_ids[:top_k], entry.top[:top_k], strict=True)
        for place, (token_id, (text, logprob, _)) in enumerate(alternatives, 1):
            name = token_name(text, token_id, as_ids)
            scores.setdefault(str(token_id), _vllm_logprob(logprob, place, name))
        out.append(scores)
    return out


def _vllm_logprob(logprob: float, rank: int | None, decoded_token: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded_token}
