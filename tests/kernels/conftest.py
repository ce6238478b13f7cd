"""Kernel tests: on a machine without CUDA the Triton launchers run through the Triton interpreter.

`triton.jit` (and triton.language's own jit helpers such as `tl.sum`) read TRITON_INTERPRET when
their module is imported, so the variable is set only while triton's Python modules and `kernels.*`
are (re)imported here, then restored: nothing leaks into other test dirs, whose CPU paths call the
torch references. If another test dir imported triton first, its Python modules are purged and
re-imported (the native `triton._C` extension cannot be loaded twice and is kept). Triton 3.9's
interpreter runs `tl.dot` on the raw bits of bf16 operands and truncates fp32 -> bf16 casts;
`_patch_interpreter_bf16` widens bf16 and fp16 dot operands to fp32 and rounds casts to
nearest-even, as the GPU does (fp32 -> e4m3 casts go through torch for the same reason).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = (
    "appliance_kernels.triton_utils",
    "appliance_kernels.kv_cache",  # before attention and qk_norm_rope: they bind its helpers
    "appliance_kernels.attention",
    "appliance_kernels.gdn_chunk",
    "appliance_kernels.gdn_gate",  # before gdn: it binds gate_values at import
    "appliance_kernels.gdn",
    "appliance_kernels.state_commit",
    "appliance_kernels.conv1d",
    "appliance_kernels.norm",
    "appliance_kernels.rotary",
    "appliance_kernels.qk_norm_rope",
    "appliance_kernels.activation",
    "appliance_kernels.fp8_splitk",  # before fp8 and fp8_block: they bind its launchers at import
    "appliance_kernels.gemv_epilogue",  # before fp8_gemv and gemv_swiglu: they bind its helpers
    "appliance_kernels.gemv_rows",  # before fp8_gemv: it binds gemv_rows and store_rows at import
    "appliance_kernels.fp8_gemv",  # before fp8 and fp8_block, likewise
    "appliance_kernels.gemv_swiglu",  # after fp8_gemv: it binds its helpers at import
    "appliance_kernels.fp8",
    "appliance_kernels.fp8_block",
    "appliance_kernels.moe_route",
    "appliance_kernels.moe",
    "appliance_kernels.moe_sum",
    "appliance_kernels.moe_gemv",  # before moe_triton: it binds fused_moe_gemv at import
    "appliance_kernels.moe_triton",
    "appliance_kernels.sampling_triton",
    "appliance_kernels.sampling",  # after sampling_triton: it binds sample_triton at import
    "appliance_kernels.token_bitmask",
)
INTERPRET = not torch.cuda.is_available()


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if previous != "1":
            stale = [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
            for name in stale:
                if not name.startswith("triton._C"):
                    del sys.modules[name]
        for name in (
            "triton",
            "triton.language",
            "triton.runtime.interpreter",
            "triton.experimental.gluon",
        ):
            importlib.import_module(name)
        for name in KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    if exc.name != name:
                        raise
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _patch_interpreter_bf16() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_bf16_dot_patched", False):
        return
    original = builder.create_dot

    def widen(handle):  # the GPU's dots accumulate in fp32 whatever the operands' type
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        if handle.dtype.scalar == tl.float16:
            return interpreter.TensorHandle(handle.data.astype(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return cast(self, src, dst_type)

    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(codes, tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder._bf16_dot_patched = True


if INTERPRET:
    _import_interpreted()
    _patch_interpreter_bf16()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: full-size kernel test, runs where CUDA is present")
