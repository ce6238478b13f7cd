"""CPU test setup of conftest.py: kernels run interpreted; TRITON_INTERPRET does not leak."""

from __future__ import annotations

import os

import pytest
from kernel_cases import ON_GPU

from appliance_kernels import attention


@pytest.mark.skipif(ON_GPU, reason="the interpreter is only used without CUDA")
def test_kernels_are_interpreted_and_the_flag_is_restored():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(attention._paged_attention_kernel, InterpretedFunction)
    assert os.environ.get("TRITON_INTERPRET") in (None, "", "0") or pytest.skip(
        "TRITON_INTERPRET was set before the run"
    )


def listed_modules() -> list[str]:
    """conftest.KERNEL_MODULES, read from this directory's conftest.py (`import conftest` may
    find another test directory's)."""
    import ast
    from pathlib import Path

    source = ast.parse((Path(__file__).parent / "conftest.py").read_text())
    listed = next(
        node.value
        for node in source.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "KERNEL_MODULES"
    )
    return ast.literal_eval(listed)


def test_every_module_with_triton_kernels_is_reimported_interpreted():
    """conftest.KERNEL_MODULES must list each appliance_kernels/ module that defines a Triton kernel
    (a missing one keeps CUDA-only launchers: its tests fail on CPU with "0 active drivers")."""
    from pathlib import Path

    KERNEL_MODULES = listed_modules()
    root = Path(__file__).resolve().parents[2] / "appliance_kernels"
    with_kernels = {
        f"appliance_kernels.{path.stem}"
        for path in root.glob("*.py")
        if "@jit" in path.read_text() and path.stem != "triton_utils"
    }
    assert with_kernels, root
    assert not with_kernels - set(KERNEL_MODULES), sorted(with_kernels - set(KERNEL_MODULES))


def test_a_module_binding_another_modules_jit_function_is_reloaded_after_it():
    """`from appliance_kernels.x import some_jit_fn` binds the function at import: conftest must
    reload x first, or the importer keeps the compiled-mode function and fails interpreted ("Cannot
    call @triton.jit'd outside of the scope of a kernel") once both were imported before the
    tests."""
    import ast
    from pathlib import Path

    order = {name: i for i, name in enumerate(listed_modules())}
    root = Path(__file__).resolve().parents[2] / "appliance_kernels"

    def jit_functions(module: str) -> set[str]:
        tree = ast.parse((root / f"{module.split('.')[1]}.py").read_text())
        return {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any(getattr(d, "id", "") == "jit" for d in node.decorator_list)
        }

    late = []
    for module in order:
        tree = ast.parse((root / f"{module.split('.')[1]}.py").read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "") in order):
                continue
            bound = {alias.name for alias in node.names} & jit_functions(node.module)
            if bound and order[node.module] > order[module]:
                late.append(f"{module} binds {sorted(bound)} of {node.module}, listed after it")
    assert not late, late
