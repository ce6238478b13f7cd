"""Prompt logprobs (completions `echo` + `logprobs`, vLLM's `prompt_logprobs`): each prompt token's
log-probability given the tokens before it, from the raw logits of the prefill rows that precede
it, with its rank in the vocabulary and the top alternatives. Called by the model runner on the
hidden states of every eager step; a chunked prefill scores its part per chunk. Every TP rank
computes the logits (the LM head gathers them over the ranks, a collective: each rank holds the
whole vocabulary's, so the rank counts every id), rank 0's lists are the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from appliance.engine.batch import StepBatch
from appliance.engine.requests import RequestTable
from appliance.messages import PromptLogprobs, PromptScores

# Logit rows computed at a time: [256, 248320] fp32 is 254 MB, a 16k-token chunk's whole would
# be 16 GB.
ROWS_PER_BLOCK = 256


def score_prompts(
    batch: StepBatch,
    hidden: torch.Tensor,  # [T, H] post-final-norm, rows in batch order
    requests: RequestTable,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, H] -> [N, V]
) -> list[PromptScores]:
    """The prompt tokens each chunk of the batch scores: the row at position p scores prompt token
    p + 1, so a chunk covering positions [start, end) scores tokens start + 1 .. min(end,
    prompt_len - 1) (the last prompt row predicts the first output token: the sampler's)."""
    out: list[PromptScores] = []
    row = 0
    for chunk, q_len in zip(batch.chunks, batch.ctx.q_lens, strict=True):
        options = requests.options[chunk.req_slot]
        if options is not None and options.prompt_logprobs is not None and not chunk.num_draft:
            prompt_len = requests.prompt_len_host[chunk.req_slot]
            count = min(chunk.num_tokens, prompt_len - 1 - chunk.start)
            if count > 0:
                first = chunk.start + 1
                targets = requests.token_ids[chunk.req_slot, first : first + count]  # [count]
                scores = score_rows(
                    hidden[row : row + count], targets, options.prompt_logprobs, compute_logits
                )
                out.append(PromptScores(chunk.req_slot, _as_message(first, targets, *scores)))
        row += q_len
    return out


def score_rows(
    hidden: torch.Tensor,  # [N, H]
    targets: torch.Tensor,  # [N] the token each row is scored against
    top_k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each target [N], its vocabulary rank [N], top_k logprobs [N, k], their ids
    [N, k]), block by block. The rank is 1 + the ids scored strictly higher: a token tied for
    first is rank 1, as the top list may show it first (vLLM counts ties against it)."""
    chosen, ranks, top_values, top_ids = [], [], [], []
    for first in range(0, hidden.shape[0], ROWS_PER_BLOCK):
        block = slice(first, first + ROWS_PER_BLOCK)
        logprobs = torch.log_softmax(compute_logits(hidden[block]).float(), dim=-1)  # [n, V]
        target_logprobs = logprobs.gather(1, targets[block, None])  # [n, 1]
        chosen.append(target_logprobs[:, 0])
        ranks.append(1 + (logprobs > target_logprobs).sum(dim=-1))
        if top_k:
            values, ids = logprobs.topk(top_k, dim=-1)  # [n, k]
        else:  # only the scored tokens
            values, ids = logprobs[:, :0], targets[block, None][:, :0]
        top_values.append(values)
        top_ids.append(ids)
    return torch.cat(chosen), torch.cat(ranks), torch.cat(top_values), torch.cat(top_ids)


def _as_message(
    start: int,
    targets: torch.Tensor,
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
) -> PromptLogprobs:
    values_host, ids_host = values.tolist(), ids.tolist()
    return PromptLogprobs(
        start=start,
        token_ids=targets.tolist(),
        logprobs=chosen.tolist(),
        top=[list(zip(i, v, strict=True)) for i, v in zip(ids_host, values_host, strict=True)],
        ranks=ranks.tolist(),
    )
