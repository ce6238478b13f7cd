"""Checks a completions logprobs object's prompt entries (echo + logprobs) against transformers'
forward on the checkpoint. Used by the first-contact and TP=2 lifecycle e2e tests."""

from __future__ import annotations

import pytest
import torch

from appliance.testing.oracle import hf_logits


def assert_scored_like_transformers(model_dir, prompt: list[int], logprobs, top_n: int) -> None:
    """The prompt's entries of a completions logprobs object: token i >= 1 scores
    log p(prompt[i] | prompt[:i]) and its alternatives are transformers' top ones."""
    ref = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)  # [P, V]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(prompt)):
        best = ref[i - 1].topk(top_n).values.tolist()
        top = logprobs.top_logprobs[i]
        # the top N and the prompt token itself; tokens that read alike share a key
        assert 1 <= len(top) <= top_n + 1
        own = logprobs.token_logprobs[i]
        assert all(any(abs(v - b) < 1e-4 for b in [*best, own]) for v in top.values()), (i, top)
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
