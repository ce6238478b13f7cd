"""The import rules of the tree: `appliance_kernels/` and `visual/` are libraries that import
nothing of `appliance`, `appliance_kernels/` nothing of `visual`, and there is no import cycle
between files or between `appliance` subpackages. Every `import` statement counts, also the ones
inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "appliance_kernels", "visual")
# Which top-level packages each one may import (besides itself).
ALLOWED = {
    "appliance_kernels": set(),
    "visual": {"appliance_kernels"},
    "appliance": {"appliance_kernels", "visual"},
}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages under `root`."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> project modules it imports (`from a import b` counts as a.b when b is a module)."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _targets(node, module, path.name == "__init__.py")
            # `from a import b`: b if it is a module, else a (the longest existing prefix).
            for name in names[:-1] if isinstance(node, ast.ImportFrom) else names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    deps.add(name)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, deterministic order)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def subpackage(module: str) -> str:
    """appliance.router.scheduler -> appliance.router; appliance.messages -> appliance.messages."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if not module.startswith("appliance."):
            continue
        node = subpackage(module)
        out.setdefault(node, set())
        out[node] |= {subpackage(d) for d in deps if d.startswith("appliance.")} - {node}
    return out


def violations(root: Path) -> list[str]:
    graph = import_graph(root)
    found = []
    for module, deps in sorted(graph.items()):
        top = module.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                found.append(f"upward import: {module} imports {dep}")
    found += ["file cycle: " + " -> ".join(c) for c in all_cycles(graph)]
    found += ["subpackage cycle: " + " -> ".join(c) for c in all_cycles(package_graph(graph))]
    return found


def all_cycles(graph: dict[str, set[str]], limit: int = 50) -> list[list[str]]:
    """Cycles one after another: each found cycle's closing edge is cut before the next search, so
    every independent cycle is reported (not only the first)."""
    graph = {node: set(deps) for node, deps in graph.items()}
    cycles = []
    while len(cycles) < limit and (cycle := find_cycle(graph)):
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def test_the_tree_keeps_the_import_rules() -> None:
    assert violations(ROOT) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


BASE = {
    "appliance/__init__.py": "",
    "appliance/messages.py": "import msgspec\n",
    "appliance/router/__init__.py": "",
    "appliance/router/scheduler.py": "from appliance.messages import StepPlan\n",
    "appliance/engine/__init__.py": "",
    "appliance/engine/runner.py": (
        "from appliance.models import qwen\nimport appliance_kernels.norm\n"
    ),
    "appliance/models/__init__.py": "",
    "appliance/models/qwen.py": "from appliance_kernels import norm\nfrom . import context\n",
    "appliance/models/context.py": "",
    "appliance_kernels/__init__.py": "",
    "appliance_kernels/norm.py": "import torch\n",
    "appliance_kernels/sampling.py": "from appliance_kernels.norm import rms_norm\n",
    "visual/__init__.py": "",
    "visual/vit.py": "from appliance_kernels.norm import rms_norm\n",
}


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    _write(tmp_path, BASE)
    assert violations(tmp_path) == []
    assert import_graph(tmp_path)["appliance.models.qwen"] == {
        "appliance_kernels.norm",
        "appliance.models.context",
    }


@pytest.mark.parametrize(
    "extra, expected",
    [
        # a kernel reading the appliance's env module (lazily, inside a function)
        (
            {"appliance_kernels/norm.py": "def f():\n    from appliance import envs\n"},
            "upward import: appliance_kernels.norm imports appliance",
        ),
        ({"visual/vit.py": "from appliance.messages import X\n"}, "upward import: visual.vit"),
        (
            {"appliance_kernels/norm.py": "import visual.vit\n"},
            "upward import: appliance_kernels.norm imports visual",
        ),
        # two kernel files importing each other (one of them lazily)
        (
            {
                "appliance_kernels/norm.py": (
                    "def f():\n    from appliance_kernels.sampling import s\n"
                )
            },
            "file cycle: appliance_kernels.norm -> appliance_kernels.sampling"
            " -> appliance_kernels.norm",
        ),
        # models reading the engine's forward context while the engine imports the models
        (
            {
                "appliance/engine/context.py": "",
                "appliance/models/context.py": "from ..engine import context\n",
            },
            "subpackage cycle: appliance.engine -> appliance.models -> appliance.engine",
        ),
        # a role importing the launcher, which imports the role back inside a function
        (
            {
                "appliance/launch.py": "def spawn():\n    from appliance.router import process\n",
                "appliance/router/process.py": "from appliance.launch import Addresses\n",
            },
            "file cycle: appliance.launch -> appliance.router.process -> appliance.launch",
        ),
    ],
)
def test_a_deliberate_violation_fails(tmp_path: Path, extra: dict, expected: str) -> None:
    _write(tmp_path, {**BASE, **extra})
    found = violations(tmp_path)
    assert any(v.startswith(expected) for v in found), found
