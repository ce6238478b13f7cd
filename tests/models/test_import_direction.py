"""Imports inside the appliance run one way: the engine uses the models, never the reverse. Parses
every module under appliance/models/ (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "appliance" / "models"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module (and `from` target) a file imports; relative ones resolved."""
    package = list(path.relative_to(MODELS.parents[1]).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_models_never_import_the_engine():
    files = sorted(MODELS.rglob("*.py"))
    assert files
    offenders = {
        str(path.relative_to(MODELS)): sorted(
            n for n in imported_modules(path) if n.split(".")[:2] == ["appliance", "engine"]
        )
        for path in files
    }
    assert {path: names for path, names in offenders.items() if names} == {}
