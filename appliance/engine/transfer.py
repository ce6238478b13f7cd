"""Host values to the device without a stream sync. `torch.tensor(values, device="cuda")` copies
from pageable memory and then waits for the whole stream (the step launched before it included):
that would stall a step submitted while the previous one runs. Used by the batch builder, the
request table and the sampler."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) list as a tensor on `device`: staged in pinned memory, copied non-blocking (the
    caching host allocator keeps the staging block until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
