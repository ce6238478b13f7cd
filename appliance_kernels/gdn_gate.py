"""The Gated DeltaNet gates in one pass: decay g = -exp(A_log) * softplus(a + dt_bias) (fp32) and
write strength beta = sigmoid(b). Called by appliance/models/layers/gdn.py on the b / a columns of
the fused input projection (strided rows)."""

from __future__ import annotations

from typing import NamedTuple

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


class RawGates(NamedTuple):
    """The gate inputs before gdn_gating. The GDN recurrence takes these at decode and computes g
    and beta per row itself (appliance_kernels/gdn.py gdn_gated): one launch fewer per layer."""

    a: torch.Tensor  # [T, H] (row stride free, last dim contiguous)
    b: torch.Tensor  # [T, H]
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]

    def rows(self, start: int, end: int | None = None) -> RawGates:
        return RawGates(self.a[start:end], self.b[start:end], self.A_log, self.dt_bias)


def gdn_gating_ref(
    a: torch.Tensor,  # [T, H] (row stride free)
    b: torch.Tensor,  # [T, H]
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> g [T, H] fp32, beta [T, H] in b's dtype."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b)


@jit
def gate_values(a, b, a_log, dt_bias):
    """(g fp32, beta in b's dtype) from fp32 a / a_log / dt_bias and b as loaded: the formula of
    gdn_gating_ref, shared by the gating kernel and the fused recurrence."""
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's rule
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    return -tl.exp(a_log) * softplus, beta.to(b.dtype)


@jit
def _gdn_gating_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    heads,
    stride_a,
    stride_b,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < heads
    a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=ok, other=0.0)
    a_log = tl.load(a_log_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    g, beta = gate_values(a, b, a_log, dt_bias)
    tl.store(g_ptr + row * heads + cols, g, mask=ok)
    tl.store(beta_ptr + row * heads + cols, beta, mask=ok)


def gdn_gating_triton(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as gdn_gating_ref (within fp32 rounding of exp / log)."""
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("b", b)
    rows, heads = a.shape
    if b.shape != a.shape or A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"gdn_gating: a {a.shape}, b {b.shape}, A_log {A_log.shape}")
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, heads, dtype=b.dtype, device=b.device)
    if rows:
        _gdn_gating_kernel[(rows,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            heads,
            a.stride(0),
            b.stride(0),
            BLOCK=next_pow2(heads),
            **pdl(a),
        )
    return g, beta


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher used by the GDN layer: Triton on CUDA, the reference elsewhere."""
    if use_triton(a):
        return gdn_gating_triton(a, b, A_log, dt_bias)
    return gdn_gating_ref(a, b, A_log, dt_bias)
