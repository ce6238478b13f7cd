"""The one-launch MLP (appliance_kernels/gemv_mlp.py) against the unfused math: 16-bit and fp8
weights (per channel, per tensor, block scales), ragged sizes and segments, a pending norm in and
the split norm's add out; the counters left at zero for the next launch; the MLP layer taking it
only when enabled and where it fits, with its unfused result; 27B shapes on the GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, assert_same_decode, rel_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from fp8_cases import runner  # noqa: E402
from test_conv_in_gemv import _one_row_gemvs_with_convs, checkpoints  # noqa: E402, F401
from test_qwen3_5_parity import engine_logits  # noqa: E402

import appliance_kernels.fp8
import appliance_kernels.fp8_block
import appliance_kernels.fp8_gemv
import appliance_kernels.gemv_mlp
from appliance.models.layers import mlp as mlp_module
from appliance.models.layers import quant_methods
from appliance.models.layers.mlp import MLP
from appliance.models.layers.quant import QuantConfig
from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.fp8_block import quantize_block_ref
from appliance_kernels.gemv_mlp import _SYNC, gemv_mlp, gemv_mlp_ref, mlp_fits, stalled
from appliance_kernels.gemv_norm import AddNorm, add_norm_ref

BLOCK = (16, 32)
CONFIGS = {
    # 2-step segments: several segments per row block, ragged last ones; one tile a program
    "small": {"block_a": 4, "block_n": 8, "block_k": 64, "num_warps": 2, "stages": 1,
              "seg_steps": 2, "per_sm": 0},
    # persistent: several tiles a program, one program an SM
    "persistent": {"block_a": 4, "block_n": 8, "block_k": 64, "num_warps": 2, "stages": 1,
                   "seg_steps": 2, "per_sm": 1},
    # pipelined K loops, more persistent programs than tiles of either phase, one segment
    "wide": {"block_a": 8, "block_n": 16, "block_k": 32, "num_warps": 4, "stages": 3,
             "seg_steps": 64, "per_sm": 8},
}  # fmt: skip


def weight(kind, rows, k, seed, block=BLOCK):
    w = randn(rows, k, seed=seed, scale=0.05)
    if kind == "bf16":
        return w.to(torch.bfloat16), None
    if kind == "block":
        return quantize_block_ref(w, block)
    w_q, s = per_token_quant_ref(w) if kind == "channel" else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1)


def mlp_weights(kind, inter, k, hidden, seed=0, block=BLOCK):
    w_gu, s_gu = weight(kind, 2 * inter, k, seed + 1, block)
    w_d, s_d = weight(kind, hidden, inter, seed + 2, block)
    return w_gu, s_gu, w_d, s_d, block if kind == "block" else None


def sync_is_zero() -> bool:
    """The counters all back at zero, and no stall flagged."""
    return all(int(t.abs().sum()) == 0 for t in _SYNC.values())


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["bf16", "channel", "tensor", "block"])
@pytest.mark.parametrize("inter,k,hidden", [(320, 256, 96), (176, 96, 40)])
def test_matches_the_unfused_math(inter, k, hidden, kind, config):
    if kind == "block" and (inter % BLOCK[0] or k % BLOCK[1]):
        pytest.skip("block scales: I a multiple of block_n")  # refused: see test_refuses
    x = randn(1, k, dtype=torch.bfloat16, seed=k, scale=2.0)
    weights = mlp_weights(kind, inter, k, hidden)
    got = gemv_mlp(x, *weights[:4], block=weights[4], config=CONFIGS[config])
    assert got.shape == (1, hidden) and got.dtype == x.dtype
    assert_close(got, gemv_mlp_ref(x, *weights), torch.bfloat16, name="mlp")
    assert sync_is_zero()  # the last program put the counters back
    again = gemv_mlp(x[0], *weights[:4], block=weights[4], config=CONFIGS[config])
    assert torch.equal(again, got[0])  # a [K] row; the same sums in the same order


def test_per_channel_and_per_tensor_scales_mixed():
    """gate_up scaled per channel, down per tensor, and the other way round."""
    inter, k, hidden = 128, 64, 40
    x = randn(1, k, dtype=torch.bfloat16, seed=2)
    for kinds in (("channel", "tensor"), ("tensor", "channel")):
        w_gu, s_gu = weight(kinds[0], 2 * inter, k, seed=1)
        w_d, s_d = weight(kinds[1], hidden, inter, seed=2)
        got = gemv_mlp(x, w_gu, s_gu, w_d, s_d, config=CONFIGS["small"])
        assert rel_error(got, gemv_mlp_ref(x, w_gu, s_gu, w_d, s_d)) < 5e-3, kinds


def test_a_wait_that_never_ends_is_flagged_not_hung(monkeypatch):
    """Down tiles whose gate_up tiles never run (the ticket counter started past them) give up
    after MAX_SPINS polls: the launch returns, `stalled` says so, the counters are reset."""
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "MAX_SPINS", 4)
    x = randn(1, 64, dtype=torch.bfloat16)
    weights = mlp_weights("bf16", 128, 64, 16)
    gemv_mlp(x, *weights[:4], config=CONFIGS["small"])  # the workspace exists
    sync = next(iter(_SYNC.values()))
    sync[0] = 128 // CONFIGS["small"]["block_a"]  # every gate_up ticket taken already
    assert not stalled()
    gemv_mlp(x, *weights[:4], config=CONFIGS["small"])
    assert stalled()
    sync[-1] = 0
    assert sync_is_zero() and not stalled()
    good = gemv_mlp(x, *weights[:4], config=CONFIGS["small"])  # the next launch is right again
    assert_close(good, gemv_mlp_ref(x, *weights), torch.bfloat16)


def test_ragged_block_k_and_rows_against_the_reference():
    """K and H not multiples of the tiles (masked loads), I a multiple of block_n only."""
    inter, k, hidden = 48, 200, 52
    x = randn(1, k, dtype=torch.float16, seed=3)
    weights = mlp_weights("block", inter, k, hidden, seed=7)
    got = gemv_mlp(x, *weights[:4], block=weights[4], config=CONFIGS["small"])
    assert_close(got, gemv_mlp_ref(x, *weights), torch.float16, name="mlp")


@pytest.mark.parametrize("kind", ["bf16", "channel", "block"])
def test_a_pending_norm_in_and_the_split_norm_out(kind):
    """x as a split RMSNorm leaves it (gemv_norm.py): gate and up times its 1 / rms; with
    add_norm the output is added to the residual and left pending for the next GEMV."""
    inter, k = 320, 96
    y = randn(1, k, dtype=torch.bfloat16, seed=1, scale=3.0)
    add_in = AddNorm(randn(1, k, dtype=torch.bfloat16, seed=2), randn(k, seed=3), 1e-6, True)
    pending = add_norm_ref(y, add_in)
    pending = pending._replace(partials=pending.residual.float().reshape(4, -1).pow(2).sum(-1))
    weights = mlp_weights(kind, inter, k, k, seed=4)
    cfg = CONFIGS["small"]
    got = gemv_mlp(pending.x_pre, *weights[:4], block=weights[4], config=cfg, norm_in=pending)
    want = gemv_mlp_ref(pending.materialize(), *weights)
    assert rel_error(got, want) < 1e-2  # x_pre rounded before the 1 / rms factor, not after
    plain = gemv_mlp(pending.x_pre, *weights[:4], block=weights[4], config=cfg)
    assert rel_error(plain, want) > 0.05  # not a no-op

    add_out = AddNorm(randn(1, k, dtype=torch.bfloat16, seed=5), randn(k, seed=6), 1e-6, False)
    out = gemv_mlp(pending.x_pre, *weights[:4], weights[4], cfg, norm_in=pending, add_norm=add_out)
    want_out = add_norm_ref(got, add_out)
    assert torch.equal(out.residual, want_out.residual)
    assert_close(out.x_pre, want_out.x_pre, torch.bfloat16, name="x_pre")
    assert out.partials.numel() == -(-k // cfg["block_n"])
    torch.testing.assert_close(out.partials.sum(), want_out.partials.sum(), rtol=1e-5, atol=1e-3)
    assert sync_is_zero()


def test_refuses_what_it_does_not_run():
    x = randn(1, 64, dtype=torch.bfloat16)
    w_gu, _, w_d, _, _ = mlp_weights("bf16", 32, 64, 16)
    with pytest.raises(ValueError, match="one row"):
        gemv_mlp(randn(2, 64, dtype=torch.bfloat16), w_gu, None, w_d, None)
    with pytest.raises(ValueError, match="one row"):
        gemv_mlp(x, w_gu[:62], None, w_d, None)  # not [2I, K] for down's I
    with pytest.raises(ValueError, match="16-bit row"):
        gemv_mlp(x.float(), w_gu.float(), None, w_d.float(), None)
    q_gu, s_gu, q_d, s_d, _ = mlp_weights("channel", 32, 64, 16)
    with pytest.raises(ValueError, match="both fp8 with scales"):
        gemv_mlp(x, q_gu, s_gu, w_d, None)
    b_gu, bs_gu, b_d, bs_d, _ = mlp_weights("block", 40, 64, 16)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gemv_mlp(x, b_gu, bs_gu, b_d, bs_d, BLOCK)  # I = 40 over block_n 16
    with pytest.raises(ValueError, match="without scales"):
        gemv_mlp(x, w_gu, None, w_d, None, BLOCK)
    with pytest.raises(ValueError, match="segments"):
        gemv_mlp(x, w_gu, None, w_d, None, config=CONFIGS["small"] | {"block_a": 3})
    assert sync_is_zero()  # nothing launched


def test_fits_only_when_enabled_on_cuda_for_one_row(monkeypatch):
    x = randn(1, 64, dtype=torch.bfloat16)
    w_gu, _, w_d, _, _ = mlp_weights("bf16", 32, 64, 16)
    assert not mlp_fits(x, w_gu, None, w_d, None, None)  # off by default
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "USE_FUSED_MLP", True)
    assert not mlp_fits(x, w_gu, None, w_d, None, None) or x.is_cuda  # CPU: the references
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "use_triton", lambda t: True)
    assert mlp_fits(x, w_gu, None, w_d, None, None)
    assert not mlp_fits(randn(2, 64, dtype=torch.bfloat16), w_gu, None, w_d, None, None)
    assert not mlp_fits(x.float(), w_gu.float(), None, w_d.float(), None, None)
    assert not mlp_fits(x, w_gu.t().contiguous().t(), None, w_d, None, None)
    q = mlp_weights("channel", 32, 64, 16)
    assert mlp_fits(x, *q) and not mlp_fits(x, q[0], q[1][:4], *q[2:])
    assert not mlp_fits(x, q[0], q[1], w_d, None, None)  # one fp8, one 16-bit
    b = mlp_weights("block", 128, 128, 16)
    assert mlp_fits(randn(1, 128, dtype=torch.bfloat16), *b)
    assert not mlp_fits(x, *mlp_weights("block", 40, 64, 16))  # I not a multiple of block_n


@pytest.mark.parametrize("quant", [None, "online", "block"])
@pytest.mark.parametrize("add", [False, True])
def test_mlp_takes_it_with_its_unfused_result(monkeypatch, quant, add):
    hidden, inter = 96, 128
    config = {
        None: None,
        "online": QuantConfig("fp8_channel", None, True, (), "online"),
        "block": QuantConfig("fp8_block", (32, 32), False, (), "fp8"),
    }[quant]
    mlp = MLP(hidden, inter, quant=config).to(DEVICE)  # the GPU runs the kernels on its tensors
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(randn(*p.shape, seed=p.numel(), scale=0.5).to(p.dtype))
            elif name.endswith("weight_scale"):
                p.copy_(randn(*p.shape, seed=p.numel()).abs() * 0.01 + 0.005)
            else:
                p.copy_(randn(*p.shape, seed=p.numel(), scale=0.1))
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.finish_loading()
    mlp = mlp.to(torch.bfloat16) if quant is None else mlp
    for layer in (mlp.gate_up_proj, mlp.down_proj):  # the scales stay fp32
        if layer.weight_scale is not None:
            layer.weight_scale.data = layer.weight_scale.data.float()
    x = randn(1, hidden, dtype=torch.bfloat16, seed=5)
    add_norm = AddNorm(randn(1, hidden, dtype=torch.bfloat16, seed=6), randn(hidden), 1e-6, True)
    add_norm = add_norm if add else None
    for module in (
        appliance_kernels.gemv_mlp,
        appliance_kernels.fp8,
        appliance_kernels.fp8_block,
        appliance_kernels.fp8_gemv,
        quant_methods,
    ):  # as on CUDA
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    monkeypatch.setattr(appliance_kernels.fp8, "fp8_gemm_route", lambda *a: "triton")
    unfused = mlp(x, add_norm)  # the one-row GEMVs and silu_and_mul
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "USE_FUSED_MLP", True)
    small = CONFIGS["small"]
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "MLP_TILE", small | {"block_k": 32})
    calls, real = [], mlp_module.gemv_mlp
    monkeypatch.setattr(mlp_module, "gemv_mlp", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    fused = mlp(x, add_norm)
    assert len(calls) == 1
    if add:
        assert_close(fused.residual, unfused.residual, torch.bfloat16, name="residual")
        assert_close(fused.materialize(), unfused.materialize(), torch.bfloat16, name="normed")
    else:
        assert_close(fused, unfused, torch.bfloat16, name="mlp")
    mlp(randn(2, hidden, dtype=torch.bfloat16, seed=7))  # two rows: the layers
    assert len(calls) == 1


@pytest.mark.parametrize(
    "name,quantization,options",
    [
        (name, q, {"dtype": "bfloat16"})
        for name, q in (("dense", ""), ("dense", "fp8"), ("block", ""))
    ],
)
def test_the_model_gives_the_layers_logits(
    checkpoints,  # noqa: F811 - the fixture imported above
    monkeypatch,
    name,
    quantization,
    options,
):
    """Teacher-forced decode of a tiny Qwen3.5, one token a step, every one-row linear on the
    GEMV kernels (the interpreter here): with the one-launch MLP (a pending norm in, the next
    layer's left pending out) the logits are the layers' up to summation order."""
    _one_row_gemvs_with_convs(monkeypatch)
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "use_triton", lambda t: True)
    ids = [5, 17, 29, 41, 53]
    want = engine_logits(runner(checkpoints[name], quantization, **options), [ids], chunk=1)[0]
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "USE_FUSED_MLP", True)
    small = CONFIGS["small"] | {"block_k": 32}  # several segments of the tiny intermediate
    monkeypatch.setattr(appliance_kernels.gemv_mlp, "MLP_TILE", small)
    taken, real = [], mlp_module.gemv_mlp
    monkeypatch.setattr(
        mlp_module,
        "gemv_mlp",
        lambda *a, **kw: taken.append((kw["norm_in"], kw["add_norm"])) or real(*a, **kw),
    )
    fused = runner(checkpoints[name], quantization, **options)
    got = engine_logits(fused, [ids], chunk=1)[0]
    assert taken and any(n is not None for n, _ in taken) and any(a is not None for _, a in taken)
    assert_same_decode(got, want, fused.dtype)


@gpu
@pytest.mark.parametrize("kind", ["bf16", "channel", "block"])
def test_27b_mlp_on_the_gpu(kind):
    """The 27B MLP (H 5120, I 17408) with the default tiles and grid, twice in a row (the
    counters reset by the first launch serve the second), and in a CUDA graph replayed."""
    x = randn(1, 5120, dtype=torch.bfloat16, seed=3)
    weights = mlp_weights(kind, 17408, 5120, 5120, seed=4, block=(128, 128))
    want = gemv_mlp_ref(x, *weights)
    first = gemv_mlp(x, *weights[:4], block=weights[4])
    assert_close(first, want, torch.bfloat16, name="mlp")
    assert torch.equal(gemv_mlp(x, *weights[:4], block=weights[4]), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_mlp(x, *weights[:4], block=weights[4])
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert sync_is_zero() and not stalled()
