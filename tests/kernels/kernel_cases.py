"""Helpers shared by the kernel tests: the device, the full-size (GPU) marker and input builders."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


# the marks of a GPU-only case, also for one parameter set: pytest.param(..., marks=GPU_ONLY)
GPU_ONLY = (pytest.mark.skipif(not ON_GPU, reason="full-size case needs CUDA"), pytest.mark.gpu)


def gpu(func):
    """Full-size case: `pytest -m gpu tests/kernels` on the GPU machine; skipped on CPU."""
    for mark in GPU_ONLY:
        func = mark(func)
    return func


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(
    *shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    """Fresh random input built on the CPU (same values on every device), moved to DEVICE."""
    return (torch.randn(*shape, generator=generator(seed)) * scale).to(DEVICE, dtype)
