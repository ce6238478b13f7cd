"""Torch reference of token sampling: `sample_ref()`, its logit filters and counter-based noise.

Called by the dispatcher `sample` in appliance_kernels/sampling.py;
appliance_kernels/sampling_triton.py reproduces it (the same hash, filter order and tie rules) and
takes SAMPLING_EPS from here.

Randomness: no generator state. Each row's Gumbel noise is a pure function of (seed, offset, token
id) through a 32-bit integer hash (below), so a row samples the same token alone or in any batch, a
re-run with the same (seed, offset) reproduces it, and seeds/offsets can live in device buffers that
a CUDA graph reads. Sampling is the Gumbel-max trick: argmax(logits / T + G) with G = -log(-log(U)).

Hash, in uint32 arithmetic (a Triton kernel should reproduce it bit for bit; its fp32 log may differ
in the last ulp, so compare tokens, not noise):
    fmix(x)   = murmur3 finaliser: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35;
                x ^= x >> 16
    key       = fmix(fmix(fmix(fmix(seed_hi ^ 0x9E3779B9) ^ seed_lo) ^ offset_hi) ^ offset_lo)
    bits(v)   = fmix(key ^ fmix(v + 0x632BE5AB))
    U         = (bits >> 9) * 2**-23 + 2**-24        (23 bits: U in (0, 1) exactly in fp32)
"""

from __future__ import annotations

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
_M32 = 0xFFFFFFFF
_NOISE_ELEMS_PER_CHUNK = 1 << 24  # bounds the int64 temporaries of the reference noise


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and offsets -> [B] int64 holding a uint32 key."""
    seeds, offsets = seeds.long(), offsets.long()
    key = _fmix32(((seeds >> 32) & _M32) ^ 0x9E3779B9)
    key = _fmix32(key ^ (seeds & _M32))
    key = _fmix32(key ^ ((offsets >> 32) & _M32))
    return _fmix32(key ^ (offsets & _M32))


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) per (row, vocab id): [B] seeds, [B] offsets -> [B, V] fp32, never 0 or 1."""
    keys = row_keys(seeds, offsets)  # [B]
    vocab_bits = _fmix32(
        torch.arange(vocab_size, device=seeds.device, dtype=torch.long) + 0x632BE5AB
    )
    out = torch.empty(keys.shape[0], vocab_size, device=seeds.device, dtype=torch.float32)
    rows_per_chunk = max(1, _NOISE_ELEMS_PER_CHUNK // max(vocab_size, 1))
    for r0 in range(0, keys.shape[0], rows_per_chunk):
        bits = _fmix32(keys[r0 : r0 + rows_per_chunk, None] ^ vocab_bits[None, :])  # [b, V]
        out[r0 : r0 + rows_per_chunk] = (bits >> 9).float() * 2.0**-23 + 2.0**-24
    return out


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V] fp32 from the counter-based uniforms."""
    return -torch.log(-torch.log(uniform_noise(seeds, offsets, vocab_size)))


def mask_logits_ref(
    scaled: torch.Tensor,  # [B, V] fp32, already divided by temperature
    top_k: torch.Tensor,  # [B] int; <= 0 or >= V = off
    top_p: torch.Tensor,  # [B] fp32 in (0, 1]; 1 = off
    min_p: torch.Tensor,  # [B] fp32 in [0, 1]; 0 = off
) -> torch.Tensor:
    """Sets filtered-out logits to -inf, in vLLM's order: min-p (relative to the most likely
    token), then top-k, then top-p over the distribution renormalised after top-k. Ties at the
    top-k boundary keep the lower token id; the most likely token is never removed."""
    vocab = scaled.shape[-1]
    min_on = min_p > 0
    if bool(min_on.any()):
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp_min(1e-30))[:, None]
        scaled = scaled.masked_fill(min_on[:, None] & (scaled < floor), float("-inf"))
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if not bool(k_on.any() or p_on.any()):
        return scaled
    sorted_vals, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=scaled.device)
    remove = k_on[:, None] & (rank[None, :] >= top_k[:, None])
    probs = torch.softmax(sorted_vals.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | (p_on[:, None] & (mass_before >= top_p[:, None]))
    remove[:, 0] = False
    mask = torch.empty_like(remove).scatter_(-1, sorted_ids, remove)
    return scaled.masked_fill(mask, float("-inf"))


def sample_ref(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B] fp32; < SAMPLING_EPS = greedy
    top_k: torch.Tensor,  # [B] int; -1 or 0 = off
    top_p: torch.Tensor,  # [B] fp32 in (0, 1]
    min_p: torch.Tensor,  # [B] fp32 in [0, 1]
    seeds: torch.Tensor,  # [B] int64
    offsets: torch.Tensor,  # [B] int64; the caller advances it per sampled token
) -> torch.Tensor:
    """Returns sampled token ids [B] int64. Greedy rows take argmax (ties: lowest id)."""
    logits = logits.float()
    greedy = temperature < SAMPLING_EPS
    if bool(greedy.all()):  # skip the noise (the costly part of this reference) for greedy batches
        return logits.argmax(dim=-1)
    scaled = logits / torch.where(greedy, 1.0, temperature.float())[:, None]
    scaled = mask_logits_ref(scaled, top_k, top_p.float(), min_p.float())
    noisy = scaled + gumbel_noise(seeds, offsets, logits.shape[-1])
    return torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))
