"""Programmatic dependent launch (appliance_kernels.triton_utils): a kernel launched with it may run
while the previous kernel of the stream finishes, so every kernel taking a `PDL` constexpr must wait
(pdl_start / pdl_wait) before its first store and before it loads anything but its own constant
inputs. Checked statically over appliance_kernels/*.py; launch options only on CUDA SM90+."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from appliance_kernels import triton_utils

KERNELS = Path(__file__).resolve().parents[2] / "appliance_kernels"
WAITS = {"pdl_start", "pdl_wait"}
# what may come before the wait: index arithmetic, and letting the next kernel launch
EARLY_CALLS = {
    "pdl_release",
    "program_id",
    "arange",
    "where",
    "zeros",
    "to",
    "reshape",
    "cdiv",
}


def call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def pdl_kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                if node.name not in {"pdl_start", "pdl_wait", "pdl_release"}:
                    found.append((f"{path.name}:{node.name}", node))
    return found


def test_pdl_kernels_wait_before_touching_shared_memory() -> None:
    kernels = pdl_kernels()
    assert len(kernels) >= 14, [k for k, _ in kernels]
    for name, fn in kernels:
        calls = sorted(
            (c.lineno, c.col_offset, call_name(c)) for c in ast.walk(fn) if isinstance(c, ast.Call)
        )
        waits = [line for line, _, n in calls if n in WAITS]
        assert waits, f"{name}: no pdl_start / pdl_wait"
        early = [n for line, _, n in calls if line < waits[0] and n not in EARLY_CALLS]
        assert not early, f"{name}: {early} before the PDL wait"


def test_pdl_launch_options_only_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_utils, "USE_PDL", True)
    assert triton_utils.pdl(torch.empty(1)) == {}  # CPU (and the interpreter): plain launches
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        got = triton_utils.pdl(torch.empty(1, device="cuda"))
        assert got == ({"PDL": True, "launch_pdl": True} if hopper else {})
        monkeypatch.setattr(triton_utils, "USE_PDL", False)
        assert triton_utils.pdl(torch.empty(1, device="cuda")) == {}
