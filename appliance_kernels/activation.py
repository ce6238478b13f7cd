"""SiLU-and-mul for SwiGLU MLPs. Called by appliance/models/layers/mlp.py and
appliance_kernels/moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] laid out [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=ok)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (row stride free) -> [T, I]; same result as silu_and_mul_ref."""
    check_last_dim_contiguous("x", x)
    rows, width = x.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(next_pow2(inter), 2048)
    _silu_and_mul_kernel[(rows, -(-inter // block))](
        x,
        out,
        inter,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
        **pdl(x),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatcher used by the MLP layers: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
