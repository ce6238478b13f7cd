"""The GDN layer's gated output norm split between the decode recurrence and the out_proj GEMV
(batch-1 decode, no kernel of its own).

Per value head the layer computes w * rmsnorm(o) * silu(z) (appliance_kernels/norm.py
gated_rms_norm_ref) and out_proj reads it: at one row a launch of its own between two others (48
a step on the 27B, 2.1 µs each in run DI.1's profile). Its only part that is not elementwise is
each head's 1 / rms(o), one scalar per head. The recurrence's programs each own a block of one
head's value columns, so with a `GateNorm` each stores y = o * w * silu(z) for its columns and one
partial sum of squares of o (`PendingHeadNorm`); the consuming GEMV's K steps cover whole heads,
so it multiplies each head's columns of its row by rsqrt(sum(partials) / D + eps) as it loads them
(appliance_kernels/gemv_epilogue.py `head_scaled`). No program waits on another; every consumer
program sums the partials in the same order.

Rounding: o is rounded to the activation dtype first, as the recurrence stores it for the unsplit
norm; y is rounded before the per-head factor, where the unsplit norm rounds rmsnorm(o), then w
times it, then the product with silu(z): about one ulp of the normed row apart.
`PendingHeadNorm.materialize` applies the factor in torch (the route of a consumer that cannot
take the split form). Off by default (appliance/models/layers/gdn.py SPLIT_GATED_NORM) until the
H200 has timed it. Like gemv_norm.py this module holds no Triton code (one class for isinstance
checks under the kernel tests' interpreter reloads).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from appliance_kernels.triton_utils import next_pow2


class GateNorm(NamedTuple):
    """What the recurrence applies to its output before storing it (all but the 1 / rms)."""

    z: torch.Tensor  # [T, H, D]: the gate (a view of the in_proj output, read in place)
    weight: torch.Tensor  # [D]: the norm's weight
    eps: float


class PendingHeadNorm(NamedTuple):
    """A gated-normed GDN output without its per-head 1 / rms: the out_proj GEMV's `head_norm`."""

    y: torch.Tensor  # [T, H * D]: o * w * silu(z), in the activation dtype
    partials: torch.Tensor  # [T, H, P] fp32: sums of squares of o over P column blocks a head
    eps: float

    @property
    def head_dim(self) -> int:
        return self.y.shape[-1] // self.partials.shape[1]

    def rstd(self) -> torch.Tensor:
        """[T, H] fp32: each head's 1 / rms(o)."""
        return torch.rsqrt(self.partials.sum(-1) / self.head_dim + self.eps)

    def materialize(self) -> torch.Tensor:
        """[T, H * D]: the normed output, each head's columns times its 1 / rms."""
        t, h, _ = self.partials.shape
        y = self.y.float().reshape(t, h, -1) * self.rstd()[..., None]
        return y.reshape(self.y.shape).to(self.y.dtype)


def split_gated_norm_ref(o: torch.Tensor, gate: GateNorm, parts: int) -> PendingHeadNorm:
    """The producer's side in torch: o [T, H, D] (the recurrence's output in the activation
    dtype) -> PendingHeadNorm with `parts` partial sums a head (D split into equal blocks)."""
    t, h, d = o.shape
    if d % parts:
        raise ValueError(f"split gated norm: head dim {d} in {parts} equal blocks")
    of = o.float()
    y = of * gate.weight.float() * F.silu(gate.z.float())
    partials = of.pow(2).reshape(t, h, parts, d // parts).sum(-1)
    return PendingHeadNorm(y.to(o.dtype).reshape(t, h * d), partials, gate.eps)


def head_norm_fits(k: int, head_dim: int, block_k: int) -> bool:
    """Whether a GEMV with K steps of block_k can take a head norm over heads of head_dim."""
    return k % head_dim == 0 and block_k % head_dim == 0 and head_dim & (head_dim - 1) == 0


def check_head_norm(x: torch.Tensor, pending: PendingHeadNorm, block_k: int) -> None:
    k = x.shape[-1]
    t, h, _ = pending.partials.shape
    if (
        x.numel() != k
        or t != 1
        or h * pending.head_dim != k
        or not pending.partials.is_contiguous()
        or pending.partials.dtype != torch.float32
        or not head_norm_fits(k, pending.head_dim, block_k)
    ):
        raise ValueError(
            f"head_norm: one row of H * D columns, K steps of whole heads and contiguous fp32 "
            f"partials [1, H, P] (x {tuple(x.shape)}, partials {tuple(pending.partials.shape)}, "
            f"K step {block_k})"
        )


def head_norm_args(
    pending: PendingHeadNorm | None, x: torch.Tensor, block_k: int, fallback: torch.Tensor
) -> tuple[tuple, dict]:
    """A GEMV kernel's (partials, parts a head, eps) arguments and constexprs for `head_norm`."""
    if pending is None:
        return (fallback, 0, 0.0), {}
    check_head_norm(x, pending, block_k)
    parts = pending.partials.shape[-1]
    consts = {"HEAD_D": pending.head_dim, "HPARTS": next_pow2(parts)}
    return (pending.partials, parts, float(pending.eps)), consts
