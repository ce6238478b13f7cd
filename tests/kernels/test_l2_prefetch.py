"""The side-stream L2 prefetch (appliance_kernels/l2_prefetch.py): how many bytes it asks for,
that it launches nothing where it cannot run (CPU, off, too many rows), and on the GPU that the
prefetch kernel runs over a whole weight and leaves every value as it was."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu

from appliance_kernels import l2_prefetch as l2


def test_prefetch_bytes_are_whole_16_byte_runs_inside_the_weight():
    w = torch.empty(100, 33, dtype=torch.bfloat16)  # 6600 bytes
    assert l2.prefetch_bytes(w, 1.0) == 6592  # all of it, rounded down to 16
    assert l2.prefetch_bytes(w, 4000 / 2**20) == 4000
    assert l2.prefetch_bytes(w, 17 / 2**20) == 16
    assert l2.prefetch_bytes(w, 0.0) == 0


def test_nothing_is_launched_off_cuda_or_when_off():
    w = torch.randn(64, 64)
    assert l2.side_prefetch(w, 1.0, rows=1) is None  # CPU tensor
    l2.join(None)  # no stream to join: a no-op
    l2.l2_prefetch(w, 16)  # nothing to do on the CPU


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mib", [0.001, 1.0, 64.0])
def test_prefetch_runs_and_changes_nothing(dtype, mib):
    """The kernel covers the first MiB (or all) of a 27B out_proj-sized weight on a side stream,
    joined back; the weight's bytes and a GEMM over it are what they were."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs SM90")
    w = torch.randn(5120, 6144, device=DEVICE).to(dtype)
    before = w.clone()
    x = torch.randn(2, 6144, device=DEVICE, dtype=torch.bfloat16)
    want = x @ before.to(torch.bfloat16).t()
    side = l2.side_prefetch(w, mib, rows=1)
    assert side is not None
    got = x @ w.to(torch.bfloat16).t()
    l2.join(side)
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(got, want)
    assert l2.side_prefetch(w, mib, rows=l2.SIDE_PREFETCH_MAX_ROWS + 1) is None
