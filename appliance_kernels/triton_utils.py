"""Optional Triton import and launcher helpers shared by the kernel files in `appliance_kernels/`.

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


try:  # programmatic dependent launch (SM90+): Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

# Programmatic dependent launch (PDL, Hopper+): a kernel launched with it may start while the
# previous kernel of the stream is still running (in a CUDA graph too), so its launch and block
# scheduling overlap that kernel's tail instead of following it. Every kernel that takes a `PDL`
# constexpr calls `pdl_start(PDL)` (or `pdl_release` then `pdl_wait`) before it reads anything an
# earlier kernel wrote and before it writes anything. The engine turns it on for 16-bit models
# (APPLIANCE_ENABLE_PDL, default on): on the H200 it took the 27B batch-1 step from 14.34 to 13.96
# ms. A float32 model launches plainly: its decode-graph capture once failed in the cuBLAS SGEMM
# after a PDL kernel (run AT, docs/benchmarks.md), which a norm + SGEMM probe alone did not repeat
# (ops/gpu/pdl_probe.py, run AU).
USE_PDL = False
# Under programmatic dependent launch (USE_PDL) a GEMV's programs are scheduled while the previous
# kernel finishes and wait on the device before reading their row ("wait"). They do not let the
# next kernel launch early ("full"): on the H200 (run AS) that made the 27B batch-1 step slower
# (14.68 ms against 13.96 for "wait" and 14.34 without PDL), as did an L2 prefetch of the weight
# rows before the wait (15.06). "off": a plain launch.
GEMV_PDL = "wait"


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


@jit
def pdl_release(PDL: tl.constexpr):
    """Lets the stream's next kernel launch now (its blocks wait in their own pdl_wait)."""
    if PDL:
        gdc_launch_dependents()


@jit
def pdl_wait(PDL: tl.constexpr):
    """Blocks until the previous kernel of the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@jit
def pdl_start(PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)


_PDL_DEVICES: dict[int, bool] = {}


def pdl(t: torch.Tensor) -> dict[str, bool]:
    """Launch options of a kernel with a `PDL` constexpr for tensors on t's device: PDL on CUDA
    SM90+ when USE_PDL (and Triton has it); none elsewhere (the interpreter runs plain)."""
    if not (USE_PDL and t.is_cuda and gdc_wait is not None):
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _PDL_DEVICES[index] else {}


def gemv_pdl(w: torch.Tensor) -> dict:
    """PDL launch options of a GEMV over weight w (GEMV_PDL; none off the GPU)."""
    options = pdl(w) if GEMV_PDL != "off" else {}
    return options | {"RELEASE": True} if options and GEMV_PDL == "full" else options
