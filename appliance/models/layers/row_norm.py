"""A decoder sublayer's input at one decode row before its RMSNorm: the first linear that reads it
runs the norm (and the residual add) in its GEMV's K loop (appliance_kernels.fp8_gemv.GemvNorm),
which saves the norm's launch, two per decoder layer; any other reader gets `normed()`, computed
once. Built by the decoder layers where `fuses(h)`; the CPU and every batch of more rows keep the
norm as its own kernel."""

from __future__ import annotations

import torch

from appliance_kernels.fp8_gemv import GemvNorm
from appliance_kernels.triton_utils import use_triton

FUSE_NORMS = True  # ops/bench/bench_static.py --fuse-norms off: the norm kernels, as before


def fuses(h: torch.Tensor) -> bool:
    """One row on the GPU (a decode step at batch 1). The GEMVs of 16-bit weights take a 16-bit
    row (GEMV_DTYPES); under a float32 model only fp8 layers fuse, the others get `normed()`."""
    return FUSE_NORMS and h.shape[0] == 1 and use_triton(h)


class RowNorm:
    def __init__(self, norm, h: torch.Tensor, residual: torch.Tensor | None) -> None:
        """norm: the RMSNorm layer (weight, eps, zero_centered; called to materialise)."""
        self.norm, self.h, self.residual = norm, h, residual
        self.shape = h.shape
        self._normed: torch.Tensor | None = None
        self._new_residual = h if residual is None else None

    def gemv_norm(self) -> GemvNorm:
        """The norm as a GEMV prologue; call it only for a launch that runs (with a residual,
        that launch writes h + residual to the buffer `new_residual` returns)."""
        norm = self.norm
        if self.residual is None:
            return GemvNorm(norm.weight, norm.eps, norm.zero_centered)
        if self._new_residual is None:
            self._new_residual = torch.empty_like(self.h)
        pair = (self.residual, self._new_residual)
        return GemvNorm(norm.weight, norm.eps, norm.zero_centered, *pair)

    def normed(self) -> torch.Tensor:
        """The normed row, as the norm layer computes it (once)."""
        if self._normed is None:
            if self.residual is None:
                self._normed = self.norm(self.h)
            else:  # the same values as any buffer a GEMV filled
                self._normed, self._new_residual = self.norm(self.h, self.residual)
        return self._normed

    def new_residual(self) -> torch.Tensor:
        """h + residual (h without one): the residual stream after this norm."""
        if self._new_residual is None:
            self.normed()
        return self._new_residual
