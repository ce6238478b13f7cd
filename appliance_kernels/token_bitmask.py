"""Token bitmask for structured outputs: logits of the tokens a row's grammar forbids become -inf
before sampling. Called by appliance/engine/sampler.py (the mask comes from engine/guided.py).

Layout (xgrammar's): int32 [B, ceil(V / 32)]; bit t % 32 of word t // 32 set = token t allowed.
An all-ones row (-1 words) leaves its logits as they are. Fixed shapes, no host reads: the
Triton launch can sit inside a CUDA graph that reads a static bitmask buffer.
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import (
    check_dtype,
    check_last_dim_contiguous,
    jit,
    tl,
    use_triton,
)

BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [B, W] int32 -> allowed [B, vocab_size] bool (tokens past W * 32 are forbidden)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V], bitmask [B, W] int32 -> new logits [B, V] with forbidden tokens at -inf."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


@jit
def _apply_bitmask_kernel(
    logits_ptr, mask_ptr, vocab, words, stride_l, stride_m, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    word = tl.load(mask_ptr + row * stride_m + cols // 32, mask=ok & (cols // 32 < words), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=ok & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place on logits [B, V] (returned); same result as apply_token_bitmask_ref."""
    check_last_dim_contiguous("logits", logits)
    check_last_dim_contiguous("bitmask", bitmask)
    check_dtype("bitmask", bitmask, (torch.int32,))
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows:
        raise ValueError(f"bitmask: expected {rows} rows, got {tuple(bitmask.shape)}")
    if rows == 0:
        return logits
    block = 2048
    _apply_bitmask_kernel[(rows, -(-vocab // block))](
        logits,
        bitmask,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Dispatcher used by the sampler: Triton on CUDA (in place), the reference elsewhere."""
    if use_triton(logits):
        return apply_token_bitmask_triton(logits, bitmask)
    return apply_token_bitmask_ref(logits, bitmask)
