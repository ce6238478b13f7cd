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
