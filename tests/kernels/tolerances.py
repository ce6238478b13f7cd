"""The one place that defines how close a kernel must be to its torch reference, per dtype.

Every kernel test compares through `assert_close`, so a tolerance change here applies to all ops."""

from __future__ import annotations

import torch

# (atol, rtol) for element-wise comparisons of outputs in the given dtype
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# ops accumulating over long recurrences / reductions (GDN, attention over long KV): this factor
ACCUMULATING = 4.0
# relative Frobenius error bound for fp8 paths (e4m3: 3-bit mantissa, ~6% per element, averaged)
FP8_REL_ERROR = 0.06
# fp8 GEMM with fp32 output: Hopper's fp8 tensor cores accumulate with a reduced-precision adder
# (Triton's default, like cuBLAS fast-accumulate), so fp32 results carry ~1e-3 relative error
FP8_GEMM_TOLERANCE = (2e-3, 2e-2)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    factor: float = 1.0,
    name: str = "",
    equal_nan: bool = False,
) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        atol=atol * factor,
        rtol=rtol * factor,
        equal_nan=equal_nan,
        msg=lambda m: f"{name}: {m}",
    )


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return float(diff / expected.float().norm().clamp_min(1e-12))


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or int max) so stale contents cannot pass a test."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def assert_same_decode(got: torch.Tensor, want: torch.Tensor, model_dtype: torch.dtype) -> None:
    """Two decode paths' logits [T, V] that differ by a rounding moved or a summation order: of a
    16-bit model, within 0.03 on average and the greedy tokens equal where the top-2 gap is clear
    (> 0.1); of a float32 model, within 2e-4. `want` must be informative (std > 0.5)."""
    assert want.std() > 0.5
    if model_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        return
    assert (got.float() - want.float()).abs().mean() < 0.03
    top2 = want.float().topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
