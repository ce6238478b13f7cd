"""Gated DeltaNet Triton kernels (fused recurrent decode / verify rows, chunked prefill) against the
torch references, with strided q/k/v/g/beta views and poisoned state slots."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DEVICE, gpu, randn
from tolerances import ACCUMULATING, assert_close, poison

import appliance_kernels.gdn as gdn_kernels
from appliance_kernels.gdn import (
    gdn,
    gdn_chunked_ref,
    gdn_chunked_triton,
    gdn_gated,
    gdn_recurrent_ref,
    gdn_recurrent_triton,
    gdn_ref,
    gdn_verify,
    gdn_verify_gated,
    gdn_verify_ref,
    gdn_verify_triton,
)
from appliance_kernels.gdn_gate import RawGates, gdn_gating_ref


def make_inputs(lens, hk, hv, dk, dv, dtype, seed, has_init):
    """Packed projections viewed per head (as the GDN layer slices them), poisoned pool slots."""
    total = sum(lens)
    mixed = randn(total, 2 * hk * dk + hv * dv, dtype=dtype, seed=seed)
    q = mixed[:, : hk * dk].view(total, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(total, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(total, hv, dv)
    ab = randn(total, 2 * hv, seed=seed + 1)
    g = (-F.softplus(ab[:, :hv]) * 0.7).to(dtype)  # contiguous [T, Hv] log decay
    beta = torch.sigmoid(ab[:, hv:])  # fp32 view with token stride 2*Hv
    batch = len(lens)
    pool = poison(torch.empty(batch + 3, hv, dk, dv, device=DEVICE))
    state_slots = torch.randperm(batch + 3)[:batch].to(DEVICE)
    init = torch.tensor(has_init, device=DEVICE)
    for b in range(batch):
        if has_init[b]:
            pool[state_slots[b]] = randn(hv, dk, dv, seed=seed + 10 + b, scale=0.3)
    cu = torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).int()
    return [q, k, v, g, beta, pool, state_slots, cu, init]


def run_both(ref_fn, triton_fn, inputs, **kwargs):
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    expected = ref_fn(*ref_inputs)
    got = triton_fn(*inputs, **kwargs)
    return got, expected, inputs[5], ref_inputs[5]


def check_pool(pool, ref_pool, slots, dtype):
    assert_close(pool[slots], ref_pool[slots], dtype, factor=ACCUMULATING, name="final state")
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.isnan(pool[others]).all(), "slots outside the batch were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,has_init",
    [([1, 1, 1], [True, False, True]), ([3, 3], [True, True]), ([2, 0, 5], [False, True, True])],
)
def test_recurrent_matches_reference(lens, has_init, dtype):
    inputs = make_inputs(lens, 2, 4, 16, 32, dtype, seed=sum(lens), has_init=has_init)
    out = poison(torch.empty(inputs[2].shape, dtype=dtype, device=DEVICE))
    got, expected, pool, ref_pool = run_both(
        gdn_recurrent_ref, gdn_recurrent_triton, inputs, out=out
    )
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="o")
    check_pool(pool, ref_pool, inputs[6], dtype)


@pytest.mark.parametrize("tile", [{"bv": 16, "warps": 4}, {"bv": 8, "warps": 2}])
def test_recurrent_with_narrower_value_blocks(tile, monkeypatch):
    """gdn.RECURRENT_TILE: more programs a head, each fewer value columns; the same results."""
    monkeypatch.setattr(gdn_kernels, "RECURRENT_TILE", tile)
    inputs = make_inputs([1, 3, 2], 2, 4, 16, 40, torch.float32, seed=19, has_init=[1, 0, 1])
    got, expected, pool, ref_pool = run_both(gdn_recurrent_ref, gdn_recurrent_triton, inputs)
    assert_close(got, expected, torch.float32, factor=ACCUMULATING)
    check_pool(pool, ref_pool, inputs[6], torch.float32)


def test_recurrent_with_the_state_read_before_the_wait(monkeypatch):
    """PRELOAD_STATE moves the state, slot and flag loads ahead of the PDL wait (a no-op without
    PDL, as here and in the kernel tests on CUDA): the same kernel, the reference's result."""
    monkeypatch.setattr(gdn_kernels, "PRELOAD_STATE", True)
    lens, has_init = [1, 2, 0, 1], [True, False, True, True]
    inputs = make_inputs(lens, 2, 4, 16, 32, torch.bfloat16, seed=9, has_init=has_init)
    out = poison(torch.empty(inputs[2].shape, dtype=torch.bfloat16, device=DEVICE))
    got, expected, pool, ref_pool = run_both(
        gdn_recurrent_ref, gdn_kernels.gdn_recurrent_triton, inputs, out=out
    )
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="o")
    check_pool(pool, ref_pool, inputs[6], torch.bfloat16)


@pytest.mark.parametrize("dv", [16, 32])  # 16 x 16 heads: the tiny test models' (bf16 tile floor)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_reference(dtype, dv):
    lens, has_init = [70, 5, 130], [True, False, True]
    inputs = make_inputs(lens, 2, 4, 16, dv, dtype, seed=3, has_init=has_init)
    out = poison(torch.empty(inputs[2].shape, dtype=dtype, device=DEVICE))
    got, expected, pool, ref_pool = run_both(gdn_chunked_ref, gdn_chunked_triton, inputs, out=out)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="o")
    check_pool(pool, ref_pool, inputs[6], dtype)


def test_mixed_batch_split_between_kernels_matches_gdn_ref():
    """What the dispatcher does on CUDA: short requests recurrent, long ones chunked, one output."""
    lens, has_init = [1, 67, 4, 0], [True, True, False, False]
    inputs = make_inputs(lens, 1, 2, 16, 16, torch.float32, seed=5, has_init=has_init)
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    expected = gdn_ref(*ref_inputs)
    out = poison(torch.empty(inputs[2].shape, device=DEVICE))
    out = gdn_recurrent_triton(*inputs, max_len=4, out=out)
    assert torch.isnan(out[1:68]).all()  # the long request was left to the chunked kernel
    out = gdn_chunked_triton(*inputs, min_len=4, out=out)
    assert_close(out, expected, torch.float32, factor=ACCUMULATING, name="o")
    check_pool(inputs[5], ref_inputs[5], inputs[6][:3], torch.float32)  # len-0 request untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_fill_candidates_and_keep_committed_state(dtype):
    lens = [3, 2, 4]
    inputs = make_inputs(lens, 2, 4, 16, 16, dtype, seed=9, has_init=[True] * 3)
    q, k, v, g, beta, pool, slots, cu, _ = inputs
    candidates = poison(torch.empty(pool.shape[0], 4, *pool.shape[1:], device=DEVICE))
    ref_candidates = candidates.clone()
    committed = pool.clone()
    expected = gdn_verify_ref(q, k, v, g, beta, pool, ref_candidates, slots, cu)
    out = poison(torch.empty(v.shape, dtype=dtype, device=DEVICE))
    got = gdn_verify_triton(q, k, v, g, beta, pool, candidates, slots, cu, out=out)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="o")
    assert torch.equal(pool.nan_to_num(7.0), committed.nan_to_num(7.0)), "committed state changed"
    assert_close(
        candidates, ref_candidates, dtype, factor=ACCUMULATING, name="candidates", equal_nan=True
    )
    assert torch.isnan(candidates[slots[0], 3]).all()  # a 3-row request fills rows 0..2 only
    assert_close(
        gdn_verify(q, k, v, g, beta, pool, candidates, slots, cu),
        expected,
        dtype,
        factor=ACCUMULATING,
        name="dispatcher",
    )


def raw_gates(total: int, hv: int, dtype: torch.dtype, seed: int) -> RawGates:
    """Gate inputs as the layer has them: a / b strided columns of one projection output."""
    proj = randn(total, 2 * hv + 3, dtype=dtype, seed=seed) * 4
    proj[0, 0] = 30.0  # softplus's linear branch
    A_log = randn(hv, seed=seed + 1).abs().log().to(dtype)
    return RawGates(proj[:, :hv], proj[:, hv + 3 :], A_log, randn(hv, seed=seed + 2).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrence_with_raw_gates_matches_gating_then_reference(dtype):
    """gates= computes g / beta inside the recurrence: the same as gdn_gating_ref first (beta
    rounded to b's dtype as the gating kernel stores it), for decode and verify rows."""
    lens = [1, 3, 2]
    inputs = make_inputs(lens, 2, 4, 16, 32, dtype, seed=21, has_init=[True, False, True])
    q, k, v, _, _, pool, slots, cu, init = inputs
    gates = raw_gates(sum(lens), 4, dtype, seed=22)
    g, beta = gdn_gating_ref(*gates)
    ref_pool = pool.clone()
    expected = gdn_recurrent_ref(q, k, v, g, beta, ref_pool, slots, cu, init)
    out = poison(torch.empty(v.shape, dtype=dtype, device=DEVICE))
    got = gdn_recurrent_triton(q, k, v, None, None, pool, slots, cu, init, out=out, gates=gates)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="o")
    check_pool(pool, ref_pool, slots, dtype)

    candidates = poison(torch.empty(pool.shape[0], 4, *pool.shape[1:], device=DEVICE))
    ref_candidates = candidates.clone()
    expected = gdn_verify_ref(q, k, v, g, beta, pool, ref_candidates, slots, cu)
    got = gdn_verify_triton(q, k, v, None, None, pool, candidates, slots, cu, gates=gates)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="verify o")
    assert_close(
        candidates, ref_candidates, dtype, factor=ACCUMULATING, name="candidates", equal_nan=True
    )


def test_gated_dispatchers_match_gating_then_reference():
    """gdn_gated / gdn_verify_gated (what the layer calls) == gdn_gating, then gdn / gdn_verify."""
    lens = [1, 70]
    inputs = make_inputs(lens, 2, 4, 16, 16, torch.float32, seed=23, has_init=[True, False])
    q, k, v, _, _, pool, slots, cu, init = inputs
    gates = raw_gates(sum(lens), 4, torch.float32, seed=24)
    g, beta = gdn_gating_ref(*gates)
    ref_pool = pool.clone()
    expected = gdn_ref(q, k, v, g, beta, ref_pool, slots, cu, init)
    got = gdn_gated(q, k, v, gates, pool, slots, cu, init, max_q_len=70)
    assert_close(got, expected, torch.float32, factor=ACCUMULATING)
    check_pool(pool, ref_pool, slots, torch.float32)
    candidates = torch.zeros(pool.shape[0], 70, *pool.shape[1:], device=DEVICE)
    expected = gdn_verify_ref(q, k, v, g, beta, pool, candidates.clone(), slots, cu)
    got = gdn_verify_gated(q, k, v, gates, pool, candidates, slots, cu)
    assert_close(got, expected, torch.float32, factor=ACCUMULATING)


def test_dispatcher_matches_gdn_ref():
    inputs = make_inputs([1, 70], 2, 4, 16, 16, torch.float32, seed=4, has_init=[True, False])
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    assert_close(gdn(*inputs), gdn_ref(*ref_inputs), torch.float32, factor=ACCUMULATING)


@gpu
@pytest.mark.parametrize(
    "lens",
    [[1] * 64, [1] * 256, [4] * 16, [8192], [3000, 1, 2000, 1], [1024] * 8],
    ids=["decode64", "decode256", "rows16x4", "prefill8k", "mixed", "prefill8x1k"],
)
def test_full_size_qwen35_27b(lens):
    inputs = make_inputs(
        lens, 16, 48, 128, 128, torch.bfloat16, seed=1, has_init=[True] * len(lens)
    )
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    expected = gdn_ref(*ref_inputs)
    got = gdn(*inputs)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="o")
    slots = inputs[6]
    assert_close(inputs[5][slots], ref_inputs[5][slots], torch.bfloat16, factor=ACCUMULATING)


@gpu
def test_full_size_decode_with_raw_gates():
    """The layer's decode call on the GPU: the gates computed inside the recurrence."""
    lens = [1] * 64
    inputs = make_inputs(lens, 16, 48, 128, 128, torch.bfloat16, seed=3, has_init=[True] * 64)
    q, k, v, _, _, pool, slots, cu, init = inputs
    gates = raw_gates(64, 48, torch.bfloat16, seed=4)
    ref_pool = pool.clone()
    expected = gdn_ref(q, k, v, *gdn_gating_ref(*gates), ref_pool, slots, cu, init)
    got = gdn_gated(q, k, v, gates, pool, slots, cu, init, max_q_len=1)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="o")
    assert_close(pool[slots], ref_pool[slots], torch.bfloat16, factor=ACCUMULATING)


@gpu
def test_full_size_verify_rows():
    inputs = make_inputs([4] * 64, 16, 48, 128, 128, torch.bfloat16, seed=2, has_init=[True] * 64)
    q, k, v, g, beta, pool, slots, cu, _ = inputs
    candidates = torch.zeros(pool.shape[0], 4, *pool.shape[1:], device=DEVICE)
    ref_candidates = candidates.clone()
    expected = gdn_verify_ref(q, k, v, g, beta, pool, ref_candidates, slots, cu)
    got = gdn_verify(q, k, v, g, beta, pool, candidates, slots, cu)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="o")
    assert_close(candidates[slots], ref_candidates[slots], torch.bfloat16, factor=ACCUMULATING)


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@gpu
@pytest.mark.skipif(
    not (_importable("fla") and _importable("flash_qla")), reason="needs fla-core and flash-qla"
)
def test_fla_and_flashqla_each_run_their_own_chunk_kernel():
    """With both libraries installed, fla-core would hand its chunk kernel to flash-qla: the "fla"
    backend must still run fla's own kernel (different rounding), and each stays near gdn_ref."""
    from fla.backends import _get_operation_registry

    from appliance_kernels.adapters import FLA_FLASHQLA_SWITCH, gdn_chunked_external

    lens, init = [3000, 2000], [True, False]
    inputs = make_inputs(lens, 16, 48, 128, 128, torch.bfloat16, seed=5, has_init=init)
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    expected = gdn_ref(*ref_inputs).float()
    outs = {}
    for backend, tolerance in (("fla", 0.01), ("flashqla", 0.05)):
        run = list(inputs)
        run[5] = inputs[5].clone()
        out = torch.empty_like(expected, dtype=torch.bfloat16)
        outs[backend] = gdn_chunked_external(backend, *run, min_len=0, out=out).float()
        err = ((outs[backend] - expected).norm() / expected.norm()).item()
        print(f"{backend}: relative error {err:.4f} against gdn_ref")
        assert err < tolerance, (backend, err)
    assert os.environ[FLA_FLASHQLA_SWITCH] == "0"
    active = _get_operation_registry("gated_delta_rule").get_active()
    assert active is None or active.backend_type != "flash_qla", active
    assert not torch.equal(outs["fla"], outs["flashqla"]), "fla ran flash-qla's kernel"
