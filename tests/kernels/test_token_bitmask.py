"""The token bitmask against a direct per-token reading of the bits, and Triton against the ref."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu

from appliance_kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
    bitmask_words,
)


def _random_mask(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[0] = True  # an all-ones row leaves its logits alone
    words = torch.zeros(rows, bitmask_words(vocab), dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # bit 31 is the int32 sign
    if vocab % 32:
        words[0, -1] = -1
    return words.to(torch.int32), allowed


@pytest.mark.parametrize("vocab", [64, 1000])
def test_ref_masks_exactly_the_cleared_bits(vocab):
    bitmask, allowed = _random_mask(4, vocab, seed=vocab)
    logits = torch.randn(4, vocab)
    out = apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()
    assert torch.equal(out[0], logits[0])


@pytest.mark.parametrize("vocab", [64, 3001])
def test_triton_matches_reference(vocab):
    bitmask, _ = _random_mask(3, vocab, seed=1)
    logits = torch.randn(3, vocab)
    expected = apply_token_bitmask_ref(logits, bitmask)
    assert torch.equal(apply_token_bitmask_triton(logits.clone(), bitmask), expected)


def test_dispatcher_matches_reference():
    bitmask, _ = _random_mask(2, 100, seed=2)
    logits = torch.randn(2, 100)
    assert torch.equal(
        apply_token_bitmask(logits, bitmask), apply_token_bitmask_ref(logits, bitmask)
    )


@gpu
def test_full_size_qwen35_vocab():
    vocab = 248320
    bitmask, _ = _random_mask(16, vocab, seed=3)
    logits = torch.randn(16, vocab)
    expected = apply_token_bitmask_ref(logits, bitmask)
    out = apply_token_bitmask(logits.cuda(), bitmask.cuda())
    assert torch.equal(out.cpu(), expected)
