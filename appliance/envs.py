"""The one place that reads the process environment: every APPLIANCE_* flag, typed and defaulted.

Everything else imports `envs` and reads attributes (`envs.APPLIANCE_LOG_LEVEL`); values are read at
attribute access so tests can monkeypatch os.environ. Documented in docs/operations.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    choices: tuple[str, ...] | None = None


def _bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


_REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, default: Any, parse: Callable[[str], Any], doc: str, choices=None) -> None:
    _REGISTRY[name] = EnvVar(name, default, parse, doc, tuple(choices) if choices else None)


_register("APPLIANCE_LOG_LEVEL", "INFO", str.upper, "Root log level: DEBUG, INFO, WARNING, ERROR.")
_register(
    "APPLIANCE_LOG_COLOR", "auto", str.lower, "Colored level names.", ("auto", "always", "never")
)
_register(
    "NO_COLOR", False, lambda s: s != "", "Standard no-color switch; any value disables color."
)
_register(
    "APPLIANCE_LOG_STATS_INTERVAL", 10.0, float, "Seconds between windowed stats lines (0 = off)."
)
_register(
    "APPLIANCE_GDN_PREFILL_BACKEND",
    "auto",
    str.lower,
    "Gated DeltaNet prefill kernel.",
    ("auto", "torch", "triton", "fla", "flashqla"),
)
_register(
    "APPLIANCE_FP8_GEMM",
    "auto",
    str.lower,
    "fp8 scaled GEMM backend.",
    ("auto", "cutlass", "sgl", "triton", "torch"),
)
_register("APPLIANCE_HOME", "~/.cache/appliance", str, "Cache folder (embedded default model).")
_register(
    "APPLIANCE_API_KEY",
    "",
    str,
    "Comma-separated API keys clients must send (Bearer); --api-key wins; empty = no auth.",
)


def get(name: str) -> Any:
    var = _REGISTRY[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    value = var.parse(raw)
    if var.choices is not None and value not in var.choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(var.choices)}")
    return value


def kernel_backends() -> dict[str, str]:
    """The kernel backends the env flags ask for, as `kernels.backends.configure` keywords."""
    return {
        "gdn_prefill": get("APPLIANCE_GDN_PREFILL_BACKEND"),
        "fp8_gemm": get("APPLIANCE_FP8_GEMM"),
    }


def registry() -> dict[str, EnvVar]:
    return dict(_REGISTRY)


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return get(name)
    raise AttributeError(name)
