"""CPU test setup of conftest.py: kernels run interpreted; TRITON_INTERPRET does not leak."""

from __future__ import annotations

import os

import pytest
from kernel_cases import ON_GPU

from kernels import attention


@pytest.mark.skipif(ON_GPU, reason="the interpreter is only used without CUDA")
def test_kernels_are_interpreted_and_the_flag_is_restored():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(attention._paged_attention_kernel, InterpretedFunction)
    assert os.environ.get("TRITON_INTERPRET") in (None, "", "0") or pytest.skip(
        "TRITON_INTERPRET was set before the run"
    )


def test_every_module_with_triton_kernels_is_reimported_interpreted():
    """conftest.KERNEL_MODULES must list each kernels/ module that defines a Triton kernel (a
    missing one keeps CUDA-only launchers: its tests fail on CPU with "0 active drivers")."""
    import ast
    from pathlib import Path

    # read from this directory's conftest.py (`import conftest` may find another test dir's)
    source = ast.parse((Path(__file__).parent / "conftest.py").read_text())
    listed = next(
        node.value
        for node in source.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "KERNEL_MODULES"
    )
    KERNEL_MODULES = ast.literal_eval(listed)
    root = Path(__file__).resolve().parents[2] / "kernels"
    with_kernels = {
        f"kernels.{path.stem}"
        for path in root.glob("*.py")
        if "@jit" in path.read_text() and path.stem != "triton_utils"
    }
    assert with_kernels, root
    assert not with_kernels - set(KERNEL_MODULES), sorted(with_kernels - set(KERNEL_MODULES))
