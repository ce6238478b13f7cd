"""The RMSNorm split across two one-row GEMVs (appliance_kernels/gemv_norm.py): the producing GEMV's
`add_norm` epilogue (new residual, x_pre, partial sums of squares) and the consuming GEMV's
`norm_in` factor, in the per-channel / bf16 kernel and the block-scaled one, against the unsplit
path (the projection, the norm kernel's reference, the next projection)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, randn
from tolerances import assert_close, rel_error

from appliance_kernels.conv1d import causal_conv1d_ref
from appliance_kernels.fp8 import per_token_quant_ref
from appliance_kernels.fp8_block import quantize_block_ref
from appliance_kernels.fp8_gemv import (
    GemvConv,
    fp8_gemv,
    fp8_gemv_block,
    fp8_gemv_block_ref,
    fp8_gemv_ref,
)
from appliance_kernels.gemv_norm import AddNorm, PendingNorm, add_norm_ref, rstd_ref
from appliance_kernels.norm import rms_norm_ref

H, K = 96, 160  # the residual width (producer N, consumer K) and the producer's K
CONFIG = {"block_n": 8, "block_k": 64, "num_warps": 2, "stages": 2}
BLOCK_CONFIG = {"block_n": 8, "block_k": 64, "num_warps": 2, "stages": 2}


def _weights(kind: str, n: int, k: int, seed: int):
    """(weight, scale, runner(x, **extras), reference(x)) of one kind of one-row GEMV."""
    w = randn(n, k, seed=seed, scale=0.08)
    if kind == "bf16":
        w = w.to(torch.bfloat16)
        return (
            lambda x, **kw: fp8_gemv(x, w, None, config=CONFIG, **kw),
            lambda x: fp8_gemv_ref(x, w, torch.ones(1, device=DEVICE)),
        )
    if kind == "channel":
        w_q, s = per_token_quant_ref(w)
        s = s.reshape(-1)
        return (
            lambda x, **kw: fp8_gemv(x, w_q, s, config=CONFIG, **kw),
            lambda x: fp8_gemv_ref(x, w_q, s),
        )
    w_q, s = quantize_block_ref(w, (32, 32))
    return (
        lambda x, **kw: fp8_gemv_block(x, w_q, s, (32, 32), config=BLOCK_CONFIG, **kw),
        lambda x: fp8_gemv_block_ref(x, w_q, s, (32, 32)),
    )


def _add(zero_centered: bool, seed: int, hidden: int = H) -> AddNorm:
    residual = randn(1, hidden, dtype=torch.bfloat16, seed=seed, scale=2.0)
    weight = randn(hidden, seed=seed + 1, scale=0.3) + (0.0 if zero_centered else 1.0)
    return AddNorm(residual, weight, 1e-6, zero_centered)


@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize(
    "kind,hidden", [("bf16", H), ("channel", H), ("block", H), ("channel", 90)]
)
def test_producer_adds_the_residual_and_sums_squares(kind, hidden, zero_centered):
    """90 rows: the last program's rows past the end are masked out of its partial."""
    run, ref = _weights(kind, hidden, K, seed=3)
    x = randn(1, K, dtype=torch.bfloat16, seed=4)
    add = _add(zero_centered, seed=7, hidden=hidden)
    got = run(x, add_norm=add)
    assert isinstance(got, PendingNorm)
    assert got.partials.numel() == -(-hidden // 8)  # one per program
    want = add_norm_ref(ref(x), add)
    assert_close(got.residual, want.residual, torch.bfloat16, name="residual")
    assert_close(got.x_pre, want.x_pre, torch.bfloat16, name="x_pre")
    torch.testing.assert_close(got.partials.sum(), want.partials.sum(), rtol=2e-2, atol=0)
    # the materialised row is the norm kernel's output of that residual
    normed, _ = rms_norm_ref(got.residual, add.weight, add.eps, zero_centered)
    assert torch.equal(got.materialize(), normed)


@pytest.mark.parametrize("kind,hidden", [("bf16", H), ("channel", H), ("block", H), ("bf16", 90)])
def test_consumer_scales_by_the_pending_rms(kind, hidden):
    """90 columns: a K loop with a masked last step."""
    run, ref = _weights(kind, 72, hidden, seed=11)
    y = randn(1, hidden, dtype=torch.bfloat16, seed=12, scale=3.0)
    pending = add_norm_ref(y, _add(True, seed=13, hidden=hidden))
    # split into several partials the way a producer leaves them
    parts = pending.residual.float().reshape(-1, hidden // 6).pow(2).sum(-1)
    pending = pending._replace(partials=parts)
    got = run(pending.x_pre, norm_in=pending)
    exact = (ref(pending.x_pre).float() * rstd_ref(pending)).to(torch.bfloat16)
    assert_close(got, exact, torch.bfloat16, name="norm_in")
    unsplit = ref(pending.materialize())  # the norm kernel, then the projection
    assert rel_error(got, unsplit) < 1e-2  # x_pre rounded before the factor, not after


@pytest.mark.parametrize("kind", ["bf16", "channel", "block"])
def test_producer_feeds_consumer_with_tail_and_conv(kind):
    """o_proj -> (add + norm) -> a GDN in_proj with a bf16 tail and the conv, against the unsplit
    chain."""
    produce, produce_ref = _weights(kind, H, K, seed=21)
    n, conv_c, width = 64, 32, 4
    consume, consume_ref = _weights(kind, n, H, seed=22)
    tail = randn(16, H, dtype=torch.bfloat16, seed=23, scale=0.08)
    conv_w = randn(conv_c, width, seed=24, scale=0.3)
    states = randn(3, conv_c, width - 1, dtype=torch.bfloat16, seed=25)
    slot = torch.tensor([1], device=DEVICE)
    init = torch.tensor([True], device=DEVICE)
    x = randn(1, K, dtype=torch.bfloat16, seed=26)
    add = _add(True, seed=27)

    want_states = states.clone()
    normed, want_res = rms_norm_ref(produce_ref(x), add.weight, add.eps, True, add.residual)
    proj = torch.cat(
        [consume_ref(normed), fp8_gemv_ref(normed, tail, torch.ones(1, device=DEVICE))], dim=-1
    )
    conv_out = causal_conv1d_ref(
        proj[:, :conv_c], conv_w, want_states, slot, torch.tensor([0, 1], device=DEVICE), init
    )
    want = torch.cat([conv_out, proj[:, conv_c:]], dim=-1)

    pending = produce(x, add_norm=add)
    got_states = states.clone()
    got = consume(
        pending.x_pre, tail=tail, conv=GemvConv(conv_w, got_states, slot, init), norm_in=pending
    )
    assert_close(pending.residual, want_res, torch.bfloat16, name="residual")
    assert rel_error(got, want) < 1e-2
    assert rel_error(got_states, want_states) < 1e-2


def test_bad_inputs_are_named():
    run, _ = _weights("channel", H, K, seed=31)
    x = randn(2, K, dtype=torch.bfloat16, seed=32)
    with pytest.raises(ValueError, match="one row"):
        run(x, add_norm=_add(True, seed=33))
    add = _add(True, seed=34)
    with pytest.raises(ValueError, match="residual"):
        run(x[:1], add_norm=add._replace(residual=add.residual.float()))
