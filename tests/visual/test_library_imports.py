"""`visual` is a library below `appliance`: no module of it imports `appliance` (at the top, inside
functions or under TYPE_CHECKING), and its modules import each other without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "visual"


def _imports(path: Path) -> set[str]:
    """Every module name an import statement in `path` names (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x` is visual, `from .. import x` is above it
                base = f"{'visual' if node.level == 1 else ''}.{base}".strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from visual import x`
    return names


def _graph() -> dict[str, set[str]]:
    modules = {
        ("visual" if p.stem == "__init__" else f"visual.{p.stem}"): p
        for p in sorted(PACKAGE.glob("*.py"))
    }
    return {name: _imports(path) for name, path in modules.items()}


def test_visual_imports_nothing_of_appliance():
    offenders = {
        module: sorted(n for n in names if n == "appliance" or n.startswith("appliance."))
        for module, names in _graph().items()
    }
    assert {m: n for m, n in offenders.items() if n} == {}


def test_visual_modules_import_each_other_without_cycles():
    graph = _graph()
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    assert edges["visual.reservation"] >= {"visual.encoder", "visual.preprocess"}  # sees imports
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in edges[module]:
            visit(dep, (*path, module))
        done.add(module)

    for module in edges:
        visit(module, ())
