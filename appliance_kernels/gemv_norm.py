"""The RMSNorm between two one-row GEMVs, split across them (batch-1 decode, no kernel of its own).

A decoder layer runs `h, r = norm(y + r)` after its attention / GDN output projection and after its
MLP down projection, and the next GEMV reads h. At one row the norm is a launch of its own whose
time is mostly the wait for the GEMV before it and the flush the GEMV after it waits for (2-3 µs,
129 a step on the 27B). Its work splits without a kernel: the producing GEMV's programs own disjoint
rows of y, so each adds its rows to the residual (`AddNorm`), stores the new residual, stores
x_pre = (y + r) * (1 + w) and one partial sum of squares; the sum of squares over every row is a
scalar, and a scalar commutes with the next linear map, so the consuming GEMV (`PendingNorm`)
reads x_pre as its row and multiplies each output by 1 / rms = rsqrt(sum(partials) / H + eps)
where it stores it. The partials are summed in a fixed order by every consumer program (no atomics:
the result does not depend on which producer program ran first).

Rounding: the residual sum is rounded to the activation dtype as appliance_kernels/norm.py rounds
it; x_pre is rounded before the 1 / rms factor instead of after (|difference| about one ulp of the
normed row). `PendingNorm.materialize` is the unsplit norm of the same residual (the route of any
consumer that cannot take the split form).

The kernels' side (the producer's epilogue, the consumer's factor) is in
appliance_kernels/gemv_epilogue.py beside the GEMVs' other epilogues; this module holds no Triton
code, so the kernel tests' interpreter reloads (tests/kernels/conftest.py) leave one PendingNorm
class for the layers' isinstance checks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from appliance_kernels import norm
from appliance_kernels.triton_utils import next_pow2

# Under PDL (appliance_kernels/triton_utils.py) a GEMV does not let the next kernel launch early
# (GEMV_PDL "wait"): the norm kernel between two GEMVs did, hiding the second GEMV's launch. True:
# a producing GEMV (add_norm) lets the consuming GEMV launch as its own programs start (27B
# batch-1 step with steps in flight, H200, run CT in docs/benchmarks.md: 0.04-0.10 ms faster).
RELEASE_PRODUCERS = True


class AddNorm(NamedTuple):
    """What a producing GEMV adds and normalises its output with."""

    residual: torch.Tensor  # [1, H]: the residual stream before this output is added
    weight: torch.Tensor  # [H]: the norm's weight
    eps: float
    zero_centered: bool  # (1 + w) (Qwen3.5) or w


class PendingNorm(NamedTuple):
    """A normed row not yet normalised: the consuming GEMV's input (`norm_in`)."""

    x_pre: torch.Tensor  # [1, H]: residual * (1 + w) (or * w), in the activation dtype
    residual: torch.Tensor  # [1, H]: the new residual stream (output + old residual)
    partials: torch.Tensor  # [P] fp32: sums of squares of the residual over P row blocks
    weight: torch.Tensor  # the norm's, for `materialize`
    eps: float
    zero_centered: bool

    def materialize(self) -> torch.Tensor:
        """The normed row as the norm kernel computes it from the same residual."""
        return norm.rms_norm(self.residual, self.weight, self.eps, self.zero_centered)[0]


def add_norm_ref(y: torch.Tensor, add: AddNorm) -> PendingNorm:
    """The producer's side in torch: y [1, H] (the projection as stored) -> PendingNorm with one
    partial."""
    dtype = y.dtype
    residual = (y.float() + add.residual.float()).to(dtype)
    s = residual.float()
    w = add.weight.float()
    x_pre = s * (1.0 + w) if add.zero_centered else s * w.to(dtype).float()
    partials = s.pow(2).sum().reshape(1)
    return PendingNorm(x_pre.to(dtype), residual, partials, add.weight, add.eps, add.zero_centered)


def rstd_ref(pending: PendingNorm) -> torch.Tensor:
    """1 / rms of the pending row (fp32 scalar tensor)."""
    hidden = pending.x_pre.shape[-1]
    return torch.rsqrt(pending.partials.sum() / hidden + pending.eps)


def check_pending(x: torch.Tensor, pending: PendingNorm) -> None:
    if x.numel() != x.shape[-1] or pending.partials.dtype != torch.float32:
        raise ValueError(
            f"norm_in: one row x (got {tuple(x.shape)}) and fp32 partials "
            f"(got {pending.partials.dtype})"
        )


def norm_in_args(pending: PendingNorm | None, fallback: torch.Tensor) -> tuple[tuple, dict]:
    """A GEMV kernel's (partials, count, eps) arguments and constexprs for `norm_in`."""
    if pending is None:
        return (fallback, 0, 0.0), {}
    parts = pending.partials.numel()
    return (pending.partials, parts, float(pending.eps)), {
        "NORM_IN": True,
        "PARTS": next_pow2(parts),
    }


def add_norm_args(
    add: AddNorm | None, out: torch.Tensor, programs: int
) -> tuple[tuple, dict, tuple[torch.Tensor, torch.Tensor] | None]:
    """A GEMV kernel's (residual, new residual, weight, partials) arguments and constexprs for
    `add_norm`, and the (new residual, partials) it fills (None without)."""
    if add is None:
        return (out, out, out, out), {}, None
    residual = add.residual.reshape(out.shape)
    if (
        residual.dtype != out.dtype
        or not residual.is_contiguous()
        or add.weight.numel() != out.numel()
    ):
        raise ValueError(
            f"add_norm: a contiguous residual of the output's shape and dtype and a weight of its "
            f"size (residual {tuple(add.residual.shape)} {add.residual.dtype}, weight "
            f"{tuple(add.weight.shape)}, output {tuple(out.shape)} {out.dtype})"
        )
    new_residual = torch.empty_like(out)
    partials = torch.empty(programs, dtype=torch.float32, device=out.device)
    args = (residual, new_residual, add.weight, partials)
    return args, {"ADD_NORM": True, "ZC": add.zero_centered}, (new_residual, partials)


def producer_pdl(options: dict) -> dict:
    """A producing GEMV's PDL launch options (RELEASE_PRODUCERS)."""
    return options | {"RELEASE": True} if options and RELEASE_PRODUCERS else options


def pending(out: torch.Tensor, add: AddNorm, filled) -> PendingNorm:
    new_residual, partials = filled
    return PendingNorm(out, new_residual, partials, add.weight, add.eps, add.zero_centered)
