"""The one-row gate_up + SiLU-and-mul kernel (appliance_kernels/gemv_swiglu.py) against the unfused
math, for 16-bit and fp8 (per channel, per tensor) weights, ragged sizes, pipelined or not; the MLP
taking it only when enabled and where it fits, with the result of its unfused path; 27B shapes on
the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, rel_error

import appliance_kernels.fp8
import appliance_kernels.fp8_gemv
import appliance_kernels.gemv_swiglu
from appliance.models.layers import quant_methods
from appliance.models.layers.mlp import MLP
from appliance.models.layers.quant import QuantConfig
from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.gemv_norm import AddNorm, add_norm_ref
from appliance_kernels.gemv_swiglu import gemv_swiglu, gemv_swiglu_ref, swiglu_fits

CONFIGS = [
    {"block_n": 4, "block_k": 64, "num_warps": 2, "stages": 1},
    {"block_n": 8, "block_k": 128, "num_warps": 4, "stages": 3},
]


def weight(kind, rows, k, seed):
    w = randn(rows, k, seed=seed, scale=0.05)
    if kind == "bf16":
        return w.to(torch.bfloat16), None
    w_q, s = per_token_quant_ref(w) if kind == "channel" else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1)


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
@pytest.mark.parametrize("kind", ["bf16", "channel", "tensor"])
@pytest.mark.parametrize("inter,k", [(64, 256), (40, 300)])
def test_matches_the_unfused_math(inter, k, kind, config):
    x = randn(1, k, dtype=torch.bfloat16, seed=k, scale=2.0)
    w, s = weight(kind, 2 * inter, k, seed=inter)
    got = gemv_swiglu(x, w, s, config)
    assert got.shape == (1, inter) and got.dtype == x.dtype
    assert_close(got, gemv_swiglu_ref(x, w, s), torch.bfloat16, name="swiglu")
    assert gemv_swiglu(x[0], w, s, config).shape == (inter,)  # a [K] row


def test_refuses_what_it_does_not_run():
    w = randn(64, 128, dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="one row"):
        gemv_swiglu(randn(2, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="one row"):
        gemv_swiglu(randn(1, 128, dtype=torch.bfloat16), w[:63])  # odd rows
    with pytest.raises(ValueError, match="16-bit row"):
        gemv_swiglu(randn(1, 128), w.float())


@pytest.mark.parametrize("kind", ["bf16", "channel"])
def test_a_pending_norm_is_finished_inside(kind):
    """x as a split RMSNorm leaves it (appliance_kernels/gemv_norm.py): gate and up times its
    1 / rms, against the norm kernel's row through the unfused math."""
    hidden, inter = 96, 40
    y = randn(1, hidden, dtype=torch.bfloat16, seed=1, scale=3.0)
    add = AddNorm(randn(1, hidden, dtype=torch.bfloat16, seed=2), randn(hidden, seed=3), 1e-6, True)
    pending = add_norm_ref(y, add)
    pending = pending._replace(partials=pending.residual.float().reshape(4, -1).pow(2).sum(-1))
    w, s = weight(kind, 2 * inter, hidden, seed=4)
    got = gemv_swiglu(pending.x_pre, w, s, CONFIGS[1], norm_in=pending)
    want = gemv_swiglu_ref(pending.materialize(), w, s)
    assert rel_error(got, want) < 1e-2  # x_pre rounded before the 1 / rms factor, not after
    assert rel_error(gemv_swiglu(pending.x_pre, w, s, CONFIGS[1]), want) > 0.05  # not a no-op


def test_fits_only_when_enabled_on_cuda_for_one_row(monkeypatch):
    x = randn(1, 128, dtype=torch.bfloat16)
    w = randn(64, 128, dtype=torch.bfloat16)
    assert not swiglu_fits(x, w, None)  # off by default
    monkeypatch.setattr(appliance_kernels.gemv_swiglu, "USE_SWIGLU", True)
    assert not swiglu_fits(x, w, None) or x.is_cuda  # a CPU tensor runs the reference path
    monkeypatch.setattr(appliance_kernels.gemv_swiglu, "use_triton", lambda t: True)
    assert swiglu_fits(x, w, None)
    assert not swiglu_fits(randn(2, 128, dtype=torch.bfloat16), w, None)
    assert not swiglu_fits(x.float(), w.float(), None)
    assert not swiglu_fits(x, w.t().contiguous().t(), None)
    w_q, s = weight("channel", 64, 128, seed=2)
    assert swiglu_fits(x, w_q, s) and not swiglu_fits(x, w_q, s[:4])


@pytest.mark.parametrize("quant", [None, "online"])
def test_mlp_takes_it_with_its_unfused_result(monkeypatch, quant):
    config = QuantConfig("fp8_channel", None, True, (), "online") if quant else None
    mlp = MLP(96, 80, quant=config).to(DEVICE)  # the GPU runs the kernels on its tensors
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(randn(*p.shape, seed=p.numel(), scale=0.1))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.finish_loading()
    mlp = mlp.to(torch.bfloat16) if quant is None else mlp
    if quant:  # the fp8 layers keep their e4m3 weights; only the scales stay fp32
        mlp.gate_up_proj.weight_scale.data = mlp.gate_up_proj.weight_scale.data.float()
    x = randn(1, 96, dtype=torch.bfloat16, seed=5)
    for module in (
        appliance_kernels.gemv_swiglu,
        appliance_kernels.fp8,
        appliance_kernels.fp8_gemv,
    ):  # as on CUDA
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    monkeypatch.setattr(appliance_kernels.fp8, "fp8_gemm_route", lambda *a: "triton")
    unfused = mlp(x)  # the one-row GEMVs and silu_and_mul
    monkeypatch.setattr(appliance_kernels.gemv_swiglu, "USE_SWIGLU", True)
    calls, real = [], quant_methods.gemv_swiglu
    monkeypatch.setattr(quant_methods, "gemv_swiglu", lambda *a: calls.append(a) or real(*a))
    fused = mlp(x)
    assert len(calls) == 1
    assert_close(fused, unfused, torch.bfloat16, name="mlp")
    mlp(randn(2, 96, dtype=torch.bfloat16, seed=6))  # two rows: the unfused path
    assert len(calls) == 1


@gpu
@pytest.mark.parametrize("kind", ["bf16", "channel"])
def test_27b_gate_up_on_the_gpu(kind):
    x = randn(1, 5120, dtype=torch.bfloat16, seed=3)
    w, s = weight(kind, 2 * 17408, 5120, seed=4)
    assert_close(gemv_swiglu(x, w, s), gemv_swiglu_ref(x, w, s), torch.bfloat16)
