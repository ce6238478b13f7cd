"""The import rule of kernels/: the bottom of the stack. Every `import` statement in kernels/*.py,
those inside functions included, names no `appliance` / `visual` module and the kernels modules
import one another without a cycle; every name the callers import from kernels still exists."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
FORBIDDEN = ("appliance", "visual")
CALLER_DIRS = ("appliance", "visual", "ops")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, package: str) -> set[str]:
    """Absolute names of the modules a source imports, anywhere in it (`package` anchors relative
    imports); `from pkg import sub` also counts pkg.sub when pkg/sub.py exists."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, node.module or ""]).strip(".") if node.level else node.module
            found.add(base)
            for alias in node.names:
                if ROOT.joinpath(*base.split("."), f"{alias.name}.py").is_file():
                    found.add(f"{base}.{alias.name}")
    return found


def kernels_graph() -> dict[str, set[str]]:
    return {
        module_name(path): imports_of(path.read_text(), "kernels")
        for path in sorted(KERNELS.glob("*.py"))
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the graph's own nodes, as a path that returns to its start."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node] & graph.keys()):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_parser_sees_lazy_submodule_and_relative_imports():
    source = (
        "from kernels import backends\n"
        "def f():\n"
        "    from kernels.sampling_triton import sample_triton\n"
        "    from .fp8 import FP8_MAX\n"
        "    import appliance.envs\n"
    )
    assert imports_of(source, "kernels") == {
        "kernels",
        "kernels.backends",
        "kernels.sampling_triton",
        "kernels.fp8",
        "appliance.envs",
    }


def test_the_cycle_finder_reports_a_cycle():
    graph = {
        "kernels.a": {"torch", "kernels.b"},
        "kernels.b": {"kernels.c"},
        "kernels.c": {"kernels.a"},
    }
    assert find_cycle(graph) == ["kernels.a", "kernels.b", "kernels.c", "kernels.a"]
    graph["kernels.c"] = set()
    assert find_cycle(graph) is None


def test_kernels_import_nothing_of_the_project():
    offenders = {
        module: sorted(m for m in imports if m.split(".")[0] in FORBIDDEN)
        for module, imports in kernels_graph().items()
    }
    assert {module: found for module, found in offenders.items() if found} == {}


def test_kernels_modules_import_one_way():
    assert find_cycle(kernels_graph()) is None


def caller_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from kernels... import name` in appliance/, visual/, ops/."""
    found = []
    for folder in CALLER_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kernels"):
                    rel = str(path.relative_to(ROOT))
                    found += [(rel, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("where,module,name", caller_imports())
def test_names_the_callers_import_exist(where, module, name):
    imported = importlib.import_module(module)
    submodule = ROOT.joinpath(*module.split("."), f"{name}.py").is_file()
    assert hasattr(imported, name) or submodule, f"{where}: from {module} import {name}"
