"""Optional Triton import and launcher helpers shared by the kernel files in `kernels/`.

Triton is an optional dependency (CPU-only installs lack it): kernels are decorated with `jit`,
which is `triton.jit` when Triton imports and a no-op otherwise; dispatchers check `use_triton`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:  # pragma: no cover - exercised by installs without triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when Triton is importable; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def use_triton(t: torch.Tensor) -> bool:
    """The dispatch rule of every op: Triton on CUDA tensors (Triton present), else the ref."""
    return HAS_TRITON and t.is_cuda


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter (CPU tests): a small fixed machine keeps split heuristics testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride {t.stride()})")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")
