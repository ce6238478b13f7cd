"""Token sampling (temperature, min-p, top-k, top-p) with counter-based, device-resident randomness.

The dispatcher `sample()` (Triton on CUDA, the reference elsewhere), called by
appliance/engine/sampler.py. The torch reference `sample_ref()`, the hash and SAMPLING_EPS live in
appliance_kernels/sampling_ref.py, the Triton `sample_triton()` with the same signature and
semantics in appliance_kernels/sampling_triton.py; this module re-exports what the engine and the
benchmarks use.
"""

from __future__ import annotations

import torch

from appliance_kernels.sampling_ref import SAMPLING_EPS, sample_ref
from appliance_kernels.sampling_triton import sample_triton
from appliance_kernels.triton_utils import use_triton

__all__ = ["SAMPLING_EPS", "sample", "sample_ref"]


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    min_p: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Dispatcher used by the engine's sampler: Triton on CUDA, the reference elsewhere."""
    if use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)
