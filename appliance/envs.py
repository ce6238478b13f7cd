"""The one place that reads the process environment: every APPLIANCE_* flag, typed and defaulted.

Everything else imports `envs` and reads attributes (`envs.APPLIANCE_LOG_LEVEL`); values are read at
attribute access so tests can monkeypatch os.environ. Documented in docs/operations.md.
"""

from __future__ import annotations

import math
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


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"one of {', '.join(_TRUE + _FALSE)}")
    return word in _TRUE


def _number(text: str) -> float:
    """A finite number >= 0 (the numeric flags are seconds; 0 = off)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number >= 0") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("a number >= 0")
    return value


def _seconds(floor: float) -> Callable[[str], float]:
    """A number of seconds: 0 (off) or at least `floor` (a flood of log lines otherwise)."""

    def parse(text: str) -> float:
        value = _number(text)
        if 0 < value < floor:
            raise ValueError(f"0 (off) or a number >= {floor:g}")
        return value

    return parse


def _keys(text: str) -> str:
    """Comma-separated API keys: set, it must hold one (", " would switch authentication off)."""
    if text and not any(part.strip() for part in text.split(",")):
        raise ValueError("at least one key (comma-separated), or unset for no authentication")
    return text


_REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, default: Any, parse: Callable[[str], Any], doc: str, choices=None) -> None:
    _REGISTRY[name] = EnvVar(name, default, parse, doc, tuple(choices) if choices else None)


_register(
    "APPLIANCE_LOG_LEVEL",
    "INFO",
    str.upper,
    "Root log level.",
    ("DEBUG", "INFO", "WARNING", "ERROR"),
)
_register(
    "APPLIANCE_LOG_COLOR", "auto", str.lower, "Colored level names.", ("auto", "always", "never")
)
_register(
    "NO_COLOR", False, lambda s: s != "", "Standard no-color switch; any value disables color."
)
_register(
    "APPLIANCE_LOG_STATS_INTERVAL",
    10.0,
    _seconds(0.1),
    "Seconds between windowed stats lines (0 = off).",
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
_register(
    "APPLIANCE_DISABLE_MTP_FUSED_GRAPH",
    False,
    _bool,
    "MTP: accept drafts on the host after an eager verify (off: the fused device step, graphed).",
)
_register(
    "APPLIANCE_ENABLE_PDL",
    True,
    _bool,
    "Launch the Triton kernels with programmatic dependent launch (Hopper+, 16-bit models): each "
    "may start while the previous kernel finishes. 0 = plain launches.",
)
_register(
    "APPLIANCE_GPU_BUSY_LOG",
    0.0,
    _seconds(0.1),
    "Seconds between worker log lines of the device's busy share while serving (0 = off).",
)
_register(
    "APPLIANCE_HEARTBEAT_TIMEOUT",
    8.0,
    _seconds(2.0),
    "Seconds a role may go without a heartbeat (one a second) before the launcher fails the "
    "appliance naming it, as if it died (0 = off).",
)
_register(
    "APPLIANCE_TORCH_PROFILER_DIR",
    "",
    str,
    "Folder of the workers' torch.profiler traces (POST /start_profile without an output_dir); "
    "empty = <tmp>/appliance-profiles.",
)
_register("APPLIANCE_HOME", "~/.cache/appliance", str, "Cache folder (embedded default model).")
_register(
    "APPLIANCE_DEFAULT_MODEL",
    "auto",
    str.lower,
    "Model served when none is given: auto = the trained one shipped in appliance/assets/default "
    "when its files are there, else the tiny random one; random = always the tiny random one.",
    choices=("auto", "random"),
)
_register(
    "APPLIANCE_API_KEY",
    "",
    _keys,
    "Comma-separated API keys clients must send (Bearer); --api-key wins; empty = no auth.",
)


class EnvError(ValueError):
    """An APPLIANCE_* flag holds a value it does not accept; the message names flag, value and
    the accepted values."""


def get(name: str) -> Any:
    """The flag's typed value (its default when unset or empty); EnvError when it is invalid."""
    var = _REGISTRY[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        value = var.parse(raw)
    except ValueError as exc:  # a parser's message says what it accepts
        raise EnvError(f"{name}={raw!r}: expected {exc}") from None
    if var.choices is not None and value not in var.choices:
        raise EnvError(f"{name}={raw!r}: expected one of {', '.join(var.choices)}")
    return value


def get_or_default(name: str) -> Any:
    """`get`, but the default for an invalid value: for code that must run before `validate`
    reports it (logging set-up)."""
    try:
        return get(name)
    except EnvError:
        return _REGISTRY[name].default


def validate() -> None:
    """Reads every flag once; one EnvError naming each invalid flag (the launcher calls this before
    any process starts)."""
    errors = []
    for name in _REGISTRY:
        try:
            get(name)
        except EnvError as exc:
            errors.append(str(exc))
    if errors:
        raise EnvError("; ".join(errors))


def kernel_backends() -> dict[str, str]:
    """The kernel backends the env flags ask for, as `appliance_kernels.backends.configure`
    keywords."""
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
