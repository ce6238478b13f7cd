"""Every `from appliance_kernels... import name` in appliance/, visual/ and ops/ (those inside
functions included, as in the benchmarks) names something appliance_kernels/ still has. The import
direction and the absence of cycles are checked for the whole tree in tests/test_import_rules.py."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALLER_DIRS = ("appliance", "visual", "ops")


def caller_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from appliance_kernels... import name` under CALLER_DIRS."""
    found = []
    for folder in CALLER_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "appliance_kernels"
                ):
                    where = str(path.relative_to(ROOT))
                    found += [(where, node.module, alias.name) for alias in node.names]
    return found


# parsed once, at collection: CPython 3.11's ast.parse can fail with "AST constructor recursion
# depth mismatch" when called later, after other tests left the interpreter's C recursion counter
# off (seen in CI once the Triton interpreter and xgrammar ran before it)
CALLERS = caller_imports()


def test_the_callers_import_from_kernels():
    modules = {module for _, module, _ in CALLERS}
    assert {
        "appliance_kernels.backends",
        "appliance_kernels.sampling",
        "appliance_kernels.attention",
    } <= modules


@pytest.mark.parametrize("where,module,name", CALLERS)
def test_names_the_callers_import_exist(where, module, name):
    imported = importlib.import_module(module)
    submodule = ROOT.joinpath(*module.split("."), f"{name}.py").is_file()
    assert hasattr(imported, name) or submodule, f"{where}: from {module} import {name}"
