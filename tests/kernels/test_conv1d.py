"""Causal conv1d Triton kernel (varlen prefill, decode update, verify rows with per-row states)
against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn
from tolerances import assert_close, poison

from appliance_kernels.conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_triton,
    causal_conv1d_verify,
    causal_conv1d_verify_ref,
    causal_conv1d_verify_triton,
)


def make_inputs(lens, channels, width, dtype, seed, has_init, x_view=True):
    total = sum(lens)
    if x_view:  # the conv input is a column slice of the fused projection output
        x = randn(total, channels + 40, dtype=dtype, seed=seed)[:, 8 : 8 + channels]
    else:
        x = randn(total, channels, dtype=dtype, seed=seed)
    weight = randn(channels, width, dtype=dtype, seed=seed + 1, scale=0.5)
    batch = len(lens)
    states = poison(torch.empty(batch + 4, channels, width - 1, dtype=dtype, device=DEVICE))
    slots = torch.randperm(batch + 4)[:batch].to(DEVICE)
    for b in range(batch):
        if has_init[b]:
            states[slots[b]] = randn(channels, width - 1, dtype=dtype, seed=seed + 5 + b)
    cu = torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).int()
    return [x, weight, states, slots, cu, torch.tensor(has_init, device=DEVICE)]


def check_states(states, ref_states, written, dtype):
    assert_close(states[written], ref_states[written], dtype, name="states", equal_nan=True)
    others = torch.ones(states.shape[0], dtype=torch.bool, device=DEVICE)
    others[written] = False
    assert torch.isnan(states[others]).all(), "slots outside the batch were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,has_init,activation",
    [
        ([1, 1, 1], [True, False, True], "silu"),  # decode update
        ([2, 1], [True, True], None),  # short rows: state mixes old columns and new inputs
        ([70, 0, 5, 130], [False, True, True, True], "silu"),
    ],  # varlen prefill, several token blocks
    ids=["decode", "short", "prefill"],
)
def test_conv1d_matches_reference(lens, has_init, activation, dtype):
    inputs = make_inputs(lens, 48, 4, dtype, seed=len(lens), has_init=has_init)
    ref_states = inputs[2].clone()
    expected = causal_conv1d_ref(inputs[0], inputs[1], ref_states, *inputs[3:], activation)
    out = poison(torch.empty(inputs[0].shape, dtype=dtype, device=DEVICE))
    got = causal_conv1d_triton(*inputs, activation, out=out)
    assert_close(got, expected, dtype, name="out")
    check_states(inputs[2], ref_states, inputs[3], dtype)  # a len-0 request keeps its state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_fill_windows_and_keep_committed_state(dtype):
    lens = [3, 4, 1]
    inputs = make_inputs(lens, 40, 4, dtype, seed=2, has_init=[True] * 3)
    x, weight, states, slots, cu, _ = inputs
    windows = poison(torch.empty(states.shape[0], 40, 3 + 5, dtype=dtype, device=DEVICE))
    ref_windows = windows.clone()
    committed = states.clone()
    expected = causal_conv1d_verify_ref(x, weight, states, ref_windows, slots, cu)
    out = poison(torch.empty(x.shape, dtype=dtype, device=DEVICE))
    got = causal_conv1d_verify_triton(x, weight, states, windows, slots, cu, out=out)
    assert_close(got, expected, dtype, name="out")
    assert torch.equal(states.nan_to_num(7.0), committed.nan_to_num(7.0)), "committed state changed"
    assert torch.equal(windows.nan_to_num(7.0), ref_windows.nan_to_num(7.0))
    assert torch.isnan(windows[slots[2], :, 4:]).all()  # a 1-row request fills 3 + 1 columns
    assert_close(causal_conv1d_verify(x, weight, states, windows, slots, cu), expected, dtype)


def test_dispatcher_matches_reference():
    inputs = make_inputs([3, 1], 16, 4, torch.float32, seed=4, has_init=[True, True])
    ref_states = inputs[2].clone()
    expected = causal_conv1d_ref(inputs[0], inputs[1], ref_states, *inputs[3:])
    assert_close(causal_conv1d(*inputs), expected, torch.float32)


@gpu
@pytest.mark.parametrize(
    "lens",
    [[1] * 256, [4] * 64, [8192], [3000, 1, 17, 2000]],
    ids=["decode256", "verify64x4", "prefill8k", "mixed"],
)
def test_full_size_qwen35_27b(lens):
    inputs = make_inputs(lens, 10240, 4, torch.bfloat16, seed=1, has_init=[True] * len(lens))
    ref_states = inputs[2].clone()
    expected = causal_conv1d_ref(inputs[0], inputs[1], ref_states, *inputs[3:])
    got = causal_conv1d(*inputs)
    assert_close(got, expected, torch.bfloat16, name="out")
    check_states(inputs[2], ref_states, inputs[3], torch.bfloat16)


@gpu
def test_full_size_verify_rows():
    inputs = make_inputs([4] * 64, 10240, 4, torch.bfloat16, seed=3, has_init=[True] * 64)
    x, weight, states, slots, cu, _ = inputs
    windows = torch.zeros(states.shape[0], 10240, 3 + 4, dtype=torch.bfloat16, device=DEVICE)
    ref_windows = windows.clone()
    expected = causal_conv1d_verify_ref(x, weight, states, ref_windows, slots, cu)
    got = causal_conv1d_verify(x, weight, states, windows, slots, cu, max_q_len=4)
    assert_close(got, expected, torch.bfloat16, name="out")
    assert torch.equal(windows[slots], ref_windows[slots])


def test_layer_mixed_prefill_and_verify_batch_through_the_triton_kernels(monkeypatch):
    """A GDN layer step holding a long prefill chunk and MTP verify rows: the conv kernels (Triton,
    interpreted) give the reference path's output. The verify call's row bound is the window
    capacity, not the batch's longest chunk (a 6-row prefill beside 4-row verify requests once
    raised 'rows do not fit windows' on the GPU)."""
    import appliance_kernels.conv1d as conv1d_module
    from appliance.models.context import ForwardContext, forward_context
    from appliance.models.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(
        hidden=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4, eps=1e-6
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    q_lens, rows = [6, 4, 4], 4  # one plain prefill chunk, then two verify requests (k = 3)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())

    def run(force_triton: bool) -> torch.Tensor:
        # on a CUDA machine (no interpreter) the Triton side runs on the device
        dev = DEVICE if force_triton else torch.device("cpu")
        monkeypatch.setattr(conv1d_module, "use_triton", lambda t: force_triton)
        gen = torch.Generator().manual_seed(1)
        layer.to(dev)
        layer.conv_states = torch.randn(3, layer.conv_dim, 3, generator=gen).to(dev)
        layer.ssm_states = (torch.randn(3, 4, 8, 8, generator=gen) * 0.1).to(dev)
        layer.ssm_candidates = torch.zeros(3, rows, 4, 8, 8, device=dev)
        layer.conv_windows = torch.zeros(3, layer.conv_dim, 3 + rows, device=dev)
        ctx = ForwardContext(
            req_slots=torch.arange(3, device=dev),
            cu_seqlens_q=cu.to(dev),
            seq_lens=(torch.tensor(q_lens) + 5).to(dev),
            has_initial_state=torch.ones(3, dtype=torch.bool, device=dev),
            out_kv_slots=torch.zeros(sum(q_lens), dtype=torch.long, device=dev),
            req_to_token=torch.zeros(3, 16, dtype=torch.int32, device=dev),
            q_lens=q_lens,
            all_decode=False,
            num_plain_reqs=1,
            num_plain_tokens=6,
        )
        x = torch.randn(sum(q_lens), 32, generator=gen).to(dev)
        with torch.no_grad(), forward_context(ctx):
            return layer(x).cpu()

    expected = run(False)
    got = run(True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
