"""Backend selection for the ops that have external alternatives: attention, GDN prefill, fp8 GEMM.

Called once per worker process (`configure`, from appliance/engine/runner.py with the values it
read from APPLIANCE_GDN_PREFILL_BACKEND, APPLIANCE_FP8_GEMM and `--attention-backend`) and by the
`appliance backends` command (`resolve_backends`); the op dispatchers read the choice with
`selected(kind)`. This module reads no flags itself: every request defaults to "auto".

Rules (a requested backend that cannot run falls back with exactly one warning naming the reason):
- every kind resolves to `torch` (the reference ops) on a machine without CUDA;
- attention: auto -> triton (own kernel); flashinfer (appliance_kernels.adapters: its paged decode /
FA2
  prefill wrappers over our cache viewed as one-token pages) on SM80+ when `flashinfer` imports;
- gdn_prefill: auto -> triton; fla when `fla` imports; flashqla only on SM90+ with `flash_qla`
  importable (~2.9x faster than fla's Triton chunk kernel but less accurate, so never automatic);
- fp8_gemm: auto -> cutlass when vLLM's op imports (SM90+); else on SM90+ sgl = sglang-kernel's
  `fp8_scaled_mm` when it imports (the fastest on the H200 at 14 of 15 27B shapes in two runs, up
  to 1.8x cuBLASLt at decode sizes; the 15th, M = 256 x K = 17408, within 1-5% of cuBLASLt); else
  `MIXED_FP8` = our Triton kernel for M <= FP8_TRITON_MAX_M rows (1.0-1.5x cuBLASLt up to M = 64)
  and torch (`torch._scaled_mm`, cuBLASLt row-wise scales) above; triton on SM89; torch below SM89
  (dequantise + matmul). Block-scaled weights (Qwen's -FP8 repos) under the mixed default or torch
  take cuBLASLt's 128 x 128 block recipe where `fp8_block.cublaslt_block_wins` (prefill sizes) and
  the Triton block GEMM elsewhere. docs/benchmarks.md has the figures behind the rules.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CHOICES: dict[str, tuple[str, ...]] = {
    "attention": ("auto", "triton", "flashinfer", "torch"),
    "gdn_prefill": ("auto", "triton", "fla", "flashqla", "torch"),
    "fp8_gemm": ("auto", "cutlass", "sgl", "triton", "torch"),
}
OPTIONAL_MODULES = ("triton", "flashinfer", "fla", "flash_qla", "sgl_kernel", "vllm")
AUTO = "auto"  # the default request of every kind (the env flags default to it as well)
FP8_TRITON_MAX_M = 64
MIXED_FP8 = f"triton(M<={FP8_TRITON_MAX_M})+torch"  # auto on SM90+ without vLLM or sglang-kernel


@dataclass(frozen=True)
class Platform:
    """What the resolution depends on; tests build fake ones."""

    cuda: bool  # a CUDA device is visible
    capability: tuple[int, int]  # compute capability of device 0, (0, 0) without CUDA
    importable: frozenset[str]  # optional modules found on sys.path


def detect_platform() -> Platform:
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(0) if cuda else (0, 0)
    found = frozenset(m for m in OPTIONAL_MODULES if importlib.util.find_spec(m) is not None)
    return Platform(cuda, tuple(capability), found)


def _resolve_attention(requested: str, p: Platform) -> tuple[str, str | None]:
    own = "triton" if "triton" in p.importable else "torch"
    if requested == "flashinfer":
        if "flashinfer" not in p.importable:
            return own, "flashinfer is not importable"
        if p.capability < (8, 0):
            sm = f"SM{p.capability[0]}{p.capability[1]}"
            return own, f"flashinfer needs SM80+, this GPU is {sm}"
        return "flashinfer", None
    if requested == "triton" and own != "triton":
        return "torch", "triton is not importable"
    return (own if requested == AUTO else requested), None


def _resolve_gdn(requested: str, p: Platform) -> tuple[str, str | None]:
    own = "triton" if "triton" in p.importable else "torch"
    if requested == "flashqla":
        if p.capability < (9, 0):
            return own, f"flashqla needs SM90+, this GPU is SM{p.capability[0]}{p.capability[1]}"
        if "flash_qla" not in p.importable:
            return own, "flash_qla is not importable"
        return "flashqla", None
    if requested == "fla":
        return ("fla", None) if "fla" in p.importable else (own, "fla (fla-core) is not importable")
    if requested == "triton" and own != "triton":
        return "torch", "triton is not importable"
    return (own if requested == AUTO else requested), None


def _fp8_auto(p: Platform) -> str:
    if p.capability >= (9, 0):
        if "vllm" in p.importable:
            return "cutlass"
        if "sgl_kernel" in p.importable:
            return "sgl"
        return MIXED_FP8 if "triton" in p.importable else "torch"
    if p.capability >= (8, 9) and "triton" in p.importable:
        return "triton"
    return "torch"


def _resolve_fp8(requested: str, p: Platform) -> tuple[str, str | None]:
    auto = _fp8_auto(p)
    sm = f"SM{p.capability[0]}{p.capability[1]}"
    needs = {
        "cutlass": ((9, 0), "vllm"),
        "sgl": ((9, 0), "sgl_kernel"),
        "triton": ((8, 9), "triton"),
    }
    if requested in needs:
        capability, module = needs[requested]
        if p.capability < capability:
            return auto, f"{requested} needs SM{capability[0]}{capability[1]}+, this GPU is {sm}"
        if module not in p.importable:
            return auto, f"{module} is not importable"
        return requested, None
    if requested == "torch" and p.capability < (9, 0):
        # cuBLASLt row-wise scaling exists only on SM90+; below it torch means dequantise + matmul
        return "torch", None
    return (auto if requested == AUTO else requested), None


_RESOLVERS = {
    "attention": _resolve_attention,
    "gdn_prefill": _resolve_gdn,
    "fp8_gemm": _resolve_fp8,
}


def resolve_backends(
    attention: str = AUTO,
    gdn_prefill: str = AUTO,
    fp8_gemm: str = AUTO,
    platform: Platform | None = None,
) -> dict[str, str]:
    """The backend each kind resolves to on this machine; one warning line per fallback. A value
    outside CHOICES[kind] raises ValueError naming the kind and the accepted values."""
    platform = platform or detect_platform()
    result: dict[str, str] = {}
    for kind, requested in (
        ("attention", attention),
        ("gdn_prefill", gdn_prefill),
        ("fp8_gemm", fp8_gemm),
    ):
        requested = requested.lower()
        if requested not in CHOICES[kind]:
            accepted = ", ".join(CHOICES[kind])
            raise ValueError(f"{kind} backend {requested!r}: expected one of {accepted}")
        if not platform.cuda:
            name, reason = "torch", (None if requested in (AUTO, "torch") else "no CUDA device")
        else:
            name, reason = _RESOLVERS[kind](requested, platform)
        if reason is not None:
            log.warning("%s backend %r unavailable (%s); using %r", kind, requested, reason, name)
        result[kind] = name
    return result


_selected: dict[str, str] | None = None


def configure(
    attention: str = AUTO,
    gdn_prefill: str = AUTO,
    fp8_gemm: str = AUTO,
    platform: Platform | None = None,
) -> dict[str, str]:
    """Resolve once per process (worker start) and log the table; dispatchers use `selected`.
    The caller passes the values it read from its own flags (appliance: envs and --options)."""
    global _selected
    _selected = resolve_backends(attention, gdn_prefill, fp8_gemm, platform)
    log.info("kernel backends: %s", " ".join(f"{k}={v}" for k, v in _selected.items()))
    return dict(_selected)


def selected(kind: str) -> str:
    """The configured backend of `kind`; a process that never called `configure` gets "auto"."""
    if _selected is None:
        configure()
    assert _selected is not None
    return _selected[kind]


def reset() -> None:
    """Forget the configured table (tests)."""
    global _selected
    _selected = None
