"""The batch-1 weight-only fp8 GEMV (appliance_kernels/fp8_gemv.py) against its reference (the
product with the dequantised weight), per channel and per tensor, ragged N and K, bias, pipelined or
not; where fp8_linear, fp8_block_linear and the 16-bit `linear` route to it; 27B shapes on the GPU;
the block-scaled variant."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, rel_error

import appliance_kernels.fp8_block
import appliance_kernels.fp8_gemv
import appliance_kernels.gemv_rows
from appliance_kernels.conv1d import causal_conv1d_ref
from appliance_kernels.fp8 import per_tensor_quant_ref, per_token_quant_ref
from appliance_kernels.fp8_block import dequantize_block, fp8_block_linear, quantize_block_ref
from appliance_kernels.fp8_gemv import (
    GEMV_MAX_ROWS,
    GemvConv,
    block_gemv_fits,
    fp8_gemv,
    fp8_gemv_block,
    fp8_gemv_block_ref,
    fp8_gemv_ref,
    gemv_config,
    gemv_wins,
    linear,
)

CONFIGS = [
    {"block_n": 8, "block_k": 128, "num_warps": 2, "stages": 1},
    {"block_n": 4, "block_k": 64, "num_warps": 1, "stages": 3},
]


def channel_weight(n, k, per_channel, seed):
    w = randn(n, k, seed=seed, scale=0.05)
    w_q, s = per_token_quant_ref(w) if per_channel else per_tensor_quant_ref(w)
    return w_q, s.reshape(-1)


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("n,k", [(40, 300), (64, 256), (24, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference_per_channel(n, k, per_channel, config, dtype):
    w_q, s = channel_weight(n, k, per_channel, seed=n + k)
    x = randn(1, k, dtype=dtype, seed=k)
    bias = randn(n, dtype=dtype, seed=5)
    for b in (bias, None):
        expected = fp8_gemv_ref(x, w_q, s, bias=b)
        got = fp8_gemv(x, w_q, s, bias=b, config=config)
        assert got.dtype == dtype and got.shape == (1, n)
        if dtype == torch.bfloat16:
            assert_close(got, expected, torch.bfloat16, name="gemv")
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert fp8_gemv(x[0], w_q, s, config=config).shape == (n,)  # a [K] row gives [N]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n2", [5, 16])
def test_a_tail_weight_is_read_in_the_same_launch(n2, dtype):
    """`tail`: the rows of a small unscaled weight in x's dtype follow W's in the output, from
    one launch, per channel (ragged N, K) and with block scales."""
    x = randn(1, 300, dtype=dtype, seed=1)
    tail = randn(n2, 300, dtype=dtype, seed=2, scale=0.05)
    want_tail = (x.float() @ tail.float().t()).to(dtype)
    w_q, s = channel_weight(40, 300, True, seed=3)
    got = fp8_gemv(x, w_q, s, config=CONFIGS[1], tail=tail)
    assert got.shape == (1, 40 + n2)
    assert_close(got[:, :40], fp8_gemv_ref(x, w_q, s), dtype, name="main rows")
    assert_close(got[:, 40:], want_tail, dtype, name="tail rows")
    b_q, b_s = quantize_block_ref(randn(256, 512, seed=4, scale=0.05), (128, 128))
    xb, tail_b = randn(1, 512, dtype=dtype, seed=5), randn(n2, 512, dtype=dtype, seed=6)
    got = fp8_gemv_block(xb, b_q, b_s, (128, 128), tail=tail_b)
    assert_close(got[:, :256], fp8_gemv_block_ref(xb, b_q, b_s, (128, 128)), dtype, name="block")
    assert_close(got[:, 256:], (xb.float() @ tail_b.float().t()).to(dtype), dtype, name="tail")
    with pytest.raises(ValueError, match="tail"):
        fp8_gemv(x, w_q, s, tail=tail.to(torch.float16))  # not x's dtype


def _conv_case(c, width, dtype, has_init, seed):
    """A GDN conv's weight, states of 3 slots (the row's slot 1) and its GemvConv."""
    weight = randn(c, width, dtype=dtype, seed=seed, scale=0.5)
    states = randn(3, c, width - 1, dtype=dtype, seed=seed + 1)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([has_init], device=DEVICE)
    return weight, states, GemvConv(weight, states, slot, init)


@pytest.mark.parametrize("has_init", [True, False])
@pytest.mark.parametrize(
    "kind,dtype",
    [("channel", torch.bfloat16), ("channel", torch.float32), ("bf16", torch.bfloat16)],
)
def test_a_gdn_conv_runs_as_the_gemv_stores(kind, dtype, has_init):
    """`conv`: the first C outputs of one row leave through the GDN layer's causal conv + SiLU
    and the row's conv state shifts by them (causal_conv1d_ref at one token); the other outputs,
    a tail's included, and the other slots' states are untouched. C ends inside a tile."""
    n, k, c, width = 40, 300, 36, 4
    if kind == "bf16":
        w, s = randn(n, k, dtype=dtype, seed=7, scale=0.05), None
    else:
        w, s = channel_weight(n, k, True, seed=7)
    x = randn(1, k, dtype=dtype, seed=8)
    tail = randn(5, k, dtype=dtype, seed=9, scale=0.05)
    weight, states, conv = _conv_case(c, width, dtype, has_init, seed=10)
    want_states = states.clone()
    plain = fp8_gemv(x, w, s, config=CONFIGS[0], tail=tail)  # the same sums, no conv
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    slots, init = conv.slot, conv.has_initial_state
    want = causal_conv1d_ref(plain[:, :c], weight, want_states, slots, cu, init)
    got = fp8_gemv(x, w, s, config=CONFIGS[0], tail=tail, conv=conv)
    assert torch.equal(got[:, c:], plain[:, c:])
    assert_close(got[:, :c], want, dtype, name="conv rows")
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)


def test_a_gdn_conv_after_a_block_gemv_with_a_tail():
    dtype = torch.bfloat16
    b_q, b_s = quantize_block_ref(randn(256, 512, seed=4, scale=0.05), (128, 128))
    x, tail = randn(1, 512, dtype=dtype, seed=5), randn(6, 512, dtype=dtype, seed=6)
    weight, states, conv = _conv_case(200, 4, dtype, True, seed=11)
    want_states = states.clone()
    plain = fp8_gemv_block(x, b_q, b_s, (128, 128), tail=tail)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    want = causal_conv1d_ref(plain[:, :200], weight, want_states, conv.slot, cu, conv[3])
    got = fp8_gemv_block(x, b_q, b_s, (128, 128), tail=tail, conv=conv)
    assert torch.equal(got[:, 200:], plain[:, 200:])
    assert_close(got[:, :200], want, dtype, name="conv rows")
    torch.testing.assert_close(states, want_states, atol=0, rtol=0)
    with pytest.raises(ValueError, match="conv"):  # more conv channels than outputs
        fp8_gemv_block(x, b_q, b_s, (128, 128), conv=_conv_case(300, 4, dtype, True, 12)[2])
    with pytest.raises(ValueError, match="conv"):  # two rows
        fp8_gemv(randn(2, 512, dtype=dtype), b_q.to(dtype), None, conv=conv)


@pytest.mark.parametrize("scheme", ["channel", "online", "block"])
def test_column_linear_with_a_bf16_tail_layer(monkeypatch, scheme):
    """ColumnLinear.with_tail (the GDN in_proj and its unquantised b / a) where the one-row GEMV
    runs: [layer(x), tail(x)] of the weight-only products; None where it does not, or when the
    tail layer is quantised too."""
    from appliance.models.layers import quant_methods
    from appliance.models.layers.linear import ColumnLinear
    from appliance.models.layers.quant import QuantConfig

    block = (16, 16) if scheme == "block" else None
    kind = "fp8_block" if block else "fp8_channel"
    quant = QuantConfig(kind, block, scheme == "online", (), "fp8")
    main = ColumnLinear(64, [32, 48], quant=quant)
    tail = ColumnLinear(64, [3, 3])
    w = randn(80, 64, seed=7, scale=0.05)
    with torch.no_grad():
        if scheme == "online":
            main.weight.copy_(w)
            main.finish_loading()
        elif block:
            w_q, w_s = quantize_block_ref(w, block)
            main.weight.copy_(w_q)
            main.weight_scale.copy_(w_s)
        else:
            w_q, w_s = per_token_quant_ref(w)
            main.weight.copy_(w_q)
            main.weight_scale.copy_(w_s.reshape(-1))
        tail.weight.copy_(randn(6, 64, seed=8, scale=0.05))
    main, tail = main.to(DEVICE), tail.to(DEVICE)
    x = randn(1, 64, seed=9)
    if DEVICE.type == "cpu":
        assert main.with_tail(x, tail) is None  # no Triton route on the CPU: two GEMMs
    monkeypatch.setattr(quant_methods, "use_triton", lambda t: True)
    monkeypatch.setattr(quant_methods, "one_row_gemv", lambda x, w: True)
    got = main.with_tail(x, tail)
    if block:
        want = fp8_gemv_block_ref(x, main.weight, main.weight_scale, block)
    else:
        want = fp8_gemv_ref(x, main.weight, main.weight_scale)
    torch.testing.assert_close(got, torch.cat([want, x @ tail.weight.t()], -1), atol=1e-4, rtol=0)
    assert main.with_tail(torch.cat([x, x]), tail) is None  # two rows
    assert tail.with_tail(x, tail) is None  # an unquantised layer has no such GEMV
    assert main.with_tail(x, main) is None  # a quantised tail


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
def test_gemv_of_a_bf16_weight_without_scales(config):
    w = randn(40, 300, dtype=torch.bfloat16, seed=4, scale=0.05)
    x = randn(1, 300, dtype=torch.bfloat16, seed=5)
    expected = (x.float() @ w.float().t()).to(torch.bfloat16)
    assert_close(fp8_gemv(x, w, None, config=config), expected, torch.bfloat16, name="bf16 gemv")


def test_gemv_is_closer_to_the_full_precision_layer_than_fp8_activations():
    from appliance_kernels.fp8 import fp8_linear

    w = randn(96, 512, seed=1, scale=0.05)
    x = randn(1, 512, seed=2)
    w_q, s = per_token_quant_ref(w)
    exact = x @ w.t()
    gemv = fp8_gemv(x, w_q, s.reshape(-1))
    both = fp8_linear(x.cpu(), w_q.cpu(), s.reshape(-1).cpu()).to(DEVICE)  # fp8 x fp8 reference
    assert rel_error(gemv, exact) < rel_error(both, exact)


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "pipelined"])
@pytest.mark.parametrize("m", [2, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("weight", ["channel", "tensor", "bf16"])
def test_rows_gemv_matches_reference(m, weight, config):
    n, k = 40, 300
    x = randn(m, k, dtype=torch.bfloat16, seed=k + m)
    bias = randn(n, dtype=torch.bfloat16, seed=6)
    if weight == "bf16":
        w_q, s = randn(n, k, dtype=torch.bfloat16, seed=m, scale=0.05), None
        expected = (x.float() @ w_q.float().t() + bias.float()).to(x.dtype)
    else:
        w_q, s = channel_weight(n, k, weight == "channel", seed=m)
        expected = fp8_gemv_ref(x, w_q, s, bias)
    got = fp8_gemv(x, w_q, s, bias, config)
    assert got.shape == (m, n)
    assert_close(got, expected, torch.bfloat16, name=f"gemv {m} rows")
    for row in range(m):  # each row as the one-row kernel computes it
        assert_close(got[row], fp8_gemv(x[row], w_q, s, bias, config), torch.bfloat16)


def test_gemv_refuses_what_it_does_not_run():
    w_q, s = channel_weight(64, 128, True, seed=0)
    with pytest.raises(ValueError, match="at most"):
        fp8_gemv(randn(GEMV_MAX_ROWS + 1, 128), w_q, s)
    with pytest.raises(ValueError, match="rows of K"):
        fp8_gemv(randn(1, 100), w_q, s)


def test_route_takes_the_gemv_at_one_row():
    assert gemv_wins(1, 5120, 6144) and gemv_wins(1, 34816, 5120) and gemv_wins(1, 5120, 17408)
    assert not gemv_wins(2, 5120, 6144)  # more rows: the fp8 x fp8 kernels


def count_calls(monkeypatch, module, name) -> list:
    """Wraps module.name so each call is recorded; the list of calls."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


def test_linear_takes_the_gemv_for_one_16bit_row_or_a_long_k(monkeypatch):
    monkeypatch.setattr(appliance_kernels.fp8_gemv, "use_triton", lambda t: True)  # as on CUDA
    monkeypatch.setattr(appliance_kernels.gemv_rows, "USE_ROWS", False)  # the routes without it
    calls = count_calls(monkeypatch, appliance_kernels.fp8_gemv, "fp8_gemv")
    w = randn(48, 300, dtype=torch.bfloat16, seed=1, scale=0.05)
    bias = randn(48, dtype=torch.bfloat16, seed=2)
    x = randn(1, 300, dtype=torch.bfloat16, seed=3)
    got = linear(x, w, bias)
    assert len(calls) == 1 and got.shape == (1, 48)
    assert_close(got, torch.nn.functional.linear(x, w, bias), torch.bfloat16, name="linear")
    assert linear(x[0], w).shape == (48,) and len(calls) == 2  # a [K] row as well
    linear(randn(2, 300, dtype=torch.bfloat16), randn(160, 300, dtype=torch.bfloat16))  # K < 2N
    linear(randn(5, 300, dtype=torch.bfloat16), w)  # more rows than the rows kernel takes
    linear(x.float(), w.float())  # fp32: cuBLAS
    linear(x, w.t().contiguous().t())  # a transposed weight: cuBLAS
    assert len(calls) == 2
    rows = randn(3, 300, dtype=torch.bfloat16, seed=6)  # 3 rows, K >= 2N: the rows kernel
    assert_close(linear(rows, w, bias), torch.nn.functional.linear(rows, w, bias), torch.bfloat16)
    assert len(calls) == 3
    grid = randn(2, 4, 300, dtype=torch.bfloat16, seed=7)[:, 1:3]  # 4 rows, not one stride
    assert_close(linear(grid, w), torch.nn.functional.linear(grid, w), torch.bfloat16)
    assert len(calls) == 4
    monkeypatch.setattr(appliance_kernels.fp8_gemv, "USE_GEMV", False)
    linear(x, w)
    linear(rows, w)
    assert len(calls) == 4


def test_block_linear_takes_the_gemv_at_one_row(monkeypatch):
    monkeypatch.setattr(appliance_kernels.fp8_block, "use_triton", lambda t: t.shape[0] == 1)
    calls = count_calls(monkeypatch, appliance_kernels.fp8_block, "fp8_gemv_block")
    w_q, s = quantize_block_ref(randn(256, 384, seed=4, scale=0.05).cpu(), (128, 128))
    w_q, s = w_q.to(DEVICE), s.to(DEVICE)
    x = randn(1, 384, dtype=torch.bfloat16, seed=5)
    got = fp8_block_linear(x, w_q, s, (128, 128))
    assert len(calls) == 1
    assert_close(got, fp8_gemv_block_ref(x, w_q, s, (128, 128)), torch.bfloat16, name="route")
    fp8_block_linear(randn(2, 384, dtype=torch.bfloat16), w_q, s, (128, 128))  # 2 rows: GEMM
    assert len(calls) == 1
    assert block_gemv_fits((128, 128), 5120, 6144) and block_gemv_fits((128, 128), 34816, 5120)
    assert not block_gemv_fits((128, 96), 5120, 6144)  # a K step would split a scale column
    assert not block_gemv_fits((4, 128), 5120, 6144)  # a tile would span scale rows


@gpu
@pytest.mark.parametrize("n,k", [(5120, 5120), (34816, 5120), (5120, 17408), (5120, 6144)])
def test_full_size_16bit_and_block_routes(n, k):
    w = randn(n, k, seed=n, scale=0.05, dtype=torch.bfloat16)
    x = randn(1, k, dtype=torch.bfloat16, seed=k)
    assert rel_error(linear(x, w), x.float() @ w.float().t()) < 1e-2
    rows = randn(4, k, dtype=torch.bfloat16, seed=k + 1)  # the rows kernel where K >= 2N
    assert rel_error(linear(rows, w), rows.float() @ w.float().t()) < 1e-2
    w_q, s = quantize_block_ref(w.float(), (128, 128))
    expected = fp8_gemv_block_ref(x, w_q, s, (128, 128))
    assert rel_error(fp8_block_linear(x, w_q, s, (128, 128)), expected) < 1e-2


def test_wide_tile_is_the_widest_projections_tile(monkeypatch):
    """fp8_gemv.WIDE_TILE (bench_static.py --fp8-gemv-wide-tile) sets gate_up's tile alone; a
    32-row tile reads per-channel weights right."""
    wide = {"block_n": 32, "block_k": 256, "num_warps": 4, "stages": 5}
    monkeypatch.setattr(appliance_kernels.fp8_gemv, "WIDE_TILE", wide)
    assert gemv_config(34816, 5120) == wide and gemv_config(5120, 17408) != wide
    w_q, s = channel_weight(96, 512, True, seed=3)
    x = randn(1, 512, dtype=torch.bfloat16, seed=4)
    got = fp8_gemv(x, w_q, s, config=wide)
    assert_close(got, fp8_gemv_ref(x, w_q, s), torch.bfloat16, name="wide tile")


@gpu
@pytest.mark.parametrize("n,k", [(5120, 5120), (34816, 5120), (5120, 17408), (5120, 6144)])
def test_full_size_27b_shapes(n, k):
    from appliance_kernels.fp8 import fp8_linear

    w_q, s = per_token_quant_ref(randn(n, k, seed=n, scale=0.05))
    x = randn(1, k, dtype=torch.bfloat16, seed=k)
    expected = fp8_gemv_ref(x, w_q, s.reshape(-1))
    assert rel_error(fp8_gemv(x, w_q, s.reshape(-1)), expected) < 1e-2
    assert rel_error(fp8_linear(x, w_q, s.reshape(-1)), expected) < 1e-2  # the route takes it


@pytest.mark.parametrize(
    "config",
    [
        {"block_n": 8, "block_k": 256, "num_warps": 2, "stages": 1},
        {"block_n": 16, "block_k": 128, "num_warps": 2, "stages": 3},
    ],
    ids=["two-groups", "one-group"],
)
@pytest.mark.parametrize("n,k", [(256, 512), (160, 300), (128, 1000)])
def test_block_gemv_matches_reference(n, k, config):
    w_q, s = quantize_block_ref(randn(n, k, seed=n, scale=0.05).cpu(), (128, 128))
    s = s * torch.linspace(0.5, 2.0, s.numel()).reshape(s.shape)  # scales differ per block
    w_q, s = w_q.to(DEVICE), s.to(DEVICE)
    x = randn(1, k, dtype=torch.bfloat16, seed=k)
    bias = randn(n, dtype=torch.bfloat16, seed=3)
    for b in (bias, None):
        expected = fp8_gemv_block_ref(x, w_q, s, (128, 128), b)
        got = fp8_gemv_block(x, w_q, s, (128, 128), b, config)
        assert_close(got, expected, torch.bfloat16, name="block gemv")
    dense = x.float() @ dequantize_block(w_q.cpu(), s.cpu(), (128, 128)).to(DEVICE).t()
    torch.testing.assert_close(expected.float(), dense, atol=2e-2, rtol=2e-2)


def test_block_gemv_refuses_tiles_across_scale_blocks():
    w_q, s = quantize_block_ref(randn(128, 256).cpu(), (64, 128))
    with pytest.raises(ValueError, match="block"):
        fp8_gemv_block(randn(1, 256), w_q.to(DEVICE), s.to(DEVICE), (4, 128))
    with pytest.raises(ValueError, match="block"):  # a K step must hold whole scale columns
        cfg = {"block_n": 8, "block_k": 64, "num_warps": 2}
        fp8_gemv_block(randn(1, 256), w_q.to(DEVICE), s.to(DEVICE), (64, 128), config=cfg)
