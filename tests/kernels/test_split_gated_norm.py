"""The GDN gated norm split between the decode recurrence and the out_proj GEMV
(appliance_kernels/head_norm.py): the recurrence's producer side against split_gated_norm_ref,
the split form against the unsplit gated norm, the one-row GEMV's `head_norm` against the same
GEMV on the materialised row (16-bit, fp8 per channel and block weights, with the next norm's
add_norm epilogue), and the layer's logits with SPLIT_GATED_NORM against the norm kernel's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import DEVICE, GPU_ONLY, gpu, randn
from tolerances import ACCUMULATING, assert_close, assert_same_decode, poison

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from fp8_cases import runner  # noqa: E402
from test_conv_in_gemv import _one_row_gemvs_with_convs, checkpoints  # noqa: E402, F401
from test_gdn import make_inputs, raw_gates  # noqa: E402
from test_qwen3_5_parity import engine_logits  # noqa: E402

import appliance_kernels.gdn as gdn_kernels  # noqa: E402
from appliance.models.layers import gdn  # noqa: E402
from appliance_kernels.fp8 import per_token_quant_ref  # noqa: E402
from appliance_kernels.fp8_block import quantize_block_ref  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv, fp8_gemv_block  # noqa: E402
from appliance_kernels.gdn import gdn_recurrent_ref, gdn_recurrent_triton  # noqa: E402
from appliance_kernels.gdn_gate import gdn_gating_ref  # noqa: E402
from appliance_kernels.gemv_norm import AddNorm, PendingNorm  # noqa: E402
from appliance_kernels.head_norm import (  # noqa: E402
    GateNorm,
    PendingHeadNorm,
    split_gated_norm_ref,
)
from appliance_kernels.norm import gated_rms_norm_ref  # noqa: E402

IDS = [5, 17, 29, 41, 53, 65]


def _gate_norm(total: int, hv: int, dv: int, dtype, seed: int) -> GateNorm:
    proj = randn(total, hv * dv + 5, dtype=dtype, seed=seed)  # z: a strided view, as in the layer
    z = proj[:, 5:].view(total, hv, dv)
    return GateNorm(z, (1.0 + randn(dv, seed=seed + 1, scale=0.2)).to(dtype), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "dv,tile,parts",
    [
        (64, None, 2),  # two full value blocks of 32
        (48, None, 2),  # a masked second block
        (64, {"bv": 16, "warps": 2}, 4),  # narrower blocks (gdn.RECURRENT_TILE): more partials
    ],
)
def test_recurrence_produces_the_split_norm(dtype, dv, tile, parts, monkeypatch):
    monkeypatch.setattr(gdn_kernels, "RECURRENT_TILE", tile)
    lens = [1, 1, 2]
    inputs = make_inputs(lens, 2, 4, 16, dv, dtype, seed=31, has_init=[True, False, True])
    q, k, v, _, _, pool, slots, cu, init = inputs
    gates = raw_gates(sum(lens), 4, dtype, seed=32)
    gate = _gate_norm(sum(lens), 4, dv, dtype, seed=33)
    g, beta = gdn_gating_ref(*gates)
    o = gdn_recurrent_ref(q, k, v, g, beta, pool.clone(), slots, cu, init)
    want = split_gated_norm_ref(o, gate, 2 if dv == 64 else 1)
    out = poison(torch.empty(v.shape, dtype=dtype, device=DEVICE))
    got = gdn_recurrent_triton(
        q, k, v, None, None, pool, slots, cu, init, out=out, gates=gates, gate_norm=gate
    )
    assert isinstance(got, PendingHeadNorm) and got.partials.shape == (4, 4, parts)
    assert_close(got.y, want.y, dtype, factor=ACCUMULATING, name="y")
    torch.testing.assert_close(got.partials.sum(-1), want.partials.sum(-1), rtol=1e-2, atol=1e-3)
    assert_close(got.materialize(), want.materialize(), dtype, factor=ACCUMULATING, name="normed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_form_equals_the_gated_norm(dtype):
    """materialize(split_gated_norm_ref(o)) == gated_rms_norm_ref(o) up to one rounding."""
    o = randn(3, 4, 64, dtype=dtype, seed=41)
    gate = _gate_norm(3, 4, 64, dtype, seed=42)
    got = split_gated_norm_ref(o, gate, 4).materialize().reshape(12, 64)
    want = gated_rms_norm_ref(o.reshape(12, 64), gate.z.reshape(12, 64), gate.weight, gate.eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _pending(heads: int, head_dim: int, parts: int, seed: int) -> PendingHeadNorm:
    o = randn(1, heads, head_dim, dtype=torch.bfloat16, seed=seed, scale=3.0)
    return split_gated_norm_ref(o, _gate_norm(1, heads, head_dim, torch.bfloat16, seed + 1), parts)


def _weights(kind: str, n: int, k: int, seed: int):
    w = randn(n, k, seed=seed, scale=k**-0.5)
    if kind == "bf16":
        return w.to(torch.bfloat16), None
    if kind == "channel":
        q, s = per_token_quant_ref(w)
        return q, s.reshape(-1)
    return quantize_block_ref(w, (32, 32))


def _gemv(kind, x, w, s, config, **extras):
    if kind == "block":
        return fp8_gemv_block(x, w, s, (32, 32), config=config, **extras)
    return fp8_gemv(x, w, s, config=config, **extras)


@pytest.mark.parametrize("kind", ["bf16", "channel", "block"])
@pytest.mark.parametrize("block_k,k_heads", [(128, 8), (256, 5)])  # K steps of 2 heads; a tail
def test_gemv_finishes_the_head_norm(kind, block_k, k_heads):
    head_dim, n = 64, 96
    pending = _pending(k_heads, head_dim, 2, seed=51)
    w, s = _weights(kind, n, k_heads * head_dim, seed=52)
    config = {"block_n": 16 if kind != "block" else 32, "block_k": block_k, "num_warps": 4}
    got = _gemv(kind, pending.y, w, s, config, head_norm=pending)
    want = _gemv(kind, pending.materialize(), w, s, config)
    assert_close(got, want, torch.bfloat16, factor=ACCUMULATING, name="x W^T")

    residual = randn(1, n, dtype=torch.bfloat16, seed=53)
    add = AddNorm(residual, randn(n, seed=54, scale=0.1).to(torch.bfloat16), 1e-6, True)
    got = _gemv(kind, pending.y, w, s, config, head_norm=pending, add_norm=add)
    want = _gemv(kind, pending.materialize(), w, s, config, add_norm=add)
    assert isinstance(got, PendingNorm)
    assert_close(got.materialize(), want.materialize(), torch.bfloat16, factor=ACCUMULATING)


def test_head_norm_needs_k_steps_of_whole_heads():
    pending = _pending(4, 64, 2, seed=61)
    w, s = _weights("channel", 32, 256, seed=62)
    config = {"block_n": 16, "block_k": 32, "num_warps": 4}
    with pytest.raises(ValueError, match="whole heads"):
        fp8_gemv(pending.y, w, s, config=config, head_norm=pending)


@pytest.mark.parametrize(
    "name,quantization,options",
    [  # off by default: on CPU one whole model (~20 s in the interpreter), all three on the GPU
        pytest.param("dense", "", {"dtype": "bfloat16"}, marks=GPU_ONLY),
        ("dense", "fp8", {}),
        pytest.param("block", "", {}, marks=GPU_ONLY),
    ],
)
def test_split_norm_gives_the_norm_kernels_logits(
    checkpoints,  # noqa: F811 - the fixture imported above
    monkeypatch,
    name,
    quantization,
    options,
):
    """Teacher-forced decode, one token a step, every one-row linear on the GEMV (the
    interpreter here): the split norm's logits equal the norm kernel's."""
    _one_row_gemvs_with_convs(monkeypatch)
    seen = []
    import appliance.models.layers.quant_methods as quant_methods

    for fn in ("fp8_gemv", "fp8_gemv_block"):
        real = getattr(quant_methods, fn)

        def counted(*args, _real=real, **kwargs):
            seen.append(kwargs.get("head_norm") is not None)
            return _real(*args, **kwargs)

        monkeypatch.setattr(quant_methods, fn, counted)
    monkeypatch.setattr(gdn, "SPLIT_GATED_NORM", True)
    split = runner(checkpoints[name], quantization, **options)
    got = engine_logits(split, [IDS], chunk=1)[0]
    assert any(seen)  # the norm did finish inside out_proj's GEMVs
    monkeypatch.setattr(gdn, "SPLIT_GATED_NORM", False)
    seen.clear()
    want = engine_logits(runner(checkpoints[name], quantization, **options), [IDS], chunk=1)[0]
    assert not any(seen)
    assert_same_decode(got, want, split.dtype)  # one rounding moved (head_norm.py)


@gpu
def test_full_size_27b_decode_split_norm():
    """The 27B's GDN shapes at one row: 48 value heads of 128, out_proj 5120 x 6144."""
    lens = [1]
    inputs = make_inputs(lens, 16, 48, 128, 128, torch.bfloat16, seed=71, has_init=[True])
    q, k, v, _, _, pool, slots, cu, init = inputs
    gates = raw_gates(1, 48, torch.bfloat16, seed=72)
    gate = _gate_norm(1, 48, 128, torch.bfloat16, seed=73)
    g, beta = gdn_gating_ref(*gates)
    o = gdn_recurrent_ref(q, k, v, g, beta, pool.clone(), slots, cu, init)
    want = split_gated_norm_ref(o, gate, 4)
    got = gdn_recurrent_triton(
        q, k, v, None, None, pool, slots, cu, init, gates=gates, gate_norm=gate
    )
    assert_close(got.materialize(), want.materialize(), torch.bfloat16, factor=ACCUMULATING)
    for kind in ("bf16", "channel"):
        w, s = _weights(kind, 5120, 6144, seed=74)
        out = fp8_gemv(got.y, w, s, head_norm=got)
        assert_close(out, fp8_gemv(got.materialize(), w, s), torch.bfloat16, factor=ACCUMULATING)


def test_row_linear_materialises_a_head_norm_off_the_gemv_route():
    """Where out_proj's one-row GEMV is not the route (a CPU tensor: the torch path), a
    PendingHeadNorm is materialised first: the same output as the materialised row."""
    from appliance.models.layers.linear import RowLinear

    pending = PendingHeadNorm(*(t.cpu() for t in _pending(4, 64, 2, seed=81)[:2]), 1e-6)
    layer = RowLinear(256, 48)
    with torch.no_grad():
        layer.weight.copy_(randn(48, 256, seed=82, scale=0.06).cpu())
    layer = layer.to(torch.bfloat16)
    assert not layer.takes_head_norm(pending.y, 64)
    torch.testing.assert_close(layer(pending), layer(pending.materialize()), rtol=0, atol=0)
