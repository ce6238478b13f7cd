"""The MTP state commit (appliance_kernels/state_commit.py) against its torch reference: the
accepted row's SSM candidate and conv window columns land in each request's pool slot, in every
layer, and no other slot changes."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, gpu, randn

from appliance_kernels.state_commit import commit_states, commit_states_ref, commit_states_triton


def _pools(layers, slots, rows, state, channels, width, conv_dtype, seed=0):
    ssm = randn(layers, slots, *state, seed=seed)
    cand = randn(layers, slots, rows, *state, seed=seed + 1)
    conv = randn(layers, slots, channels, width, dtype=conv_dtype, seed=seed + 2)
    win = randn(layers, slots, channels, width + rows, dtype=conv_dtype, seed=seed + 3)
    return ssm, cand, conv, win


def _check(commit, layers, slots, rows, state, channels, width, conv_dtype, chosen, accepted):
    ssm, cand, conv, win = _pools(layers, slots, rows, state, channels, width, conv_dtype)
    want_ssm, want_conv = ssm.clone(), conv.clone()
    slot_t = torch.tensor(chosen, dtype=torch.int64, device=DEVICE)
    row_t = torch.tensor(accepted, dtype=torch.int64, device=DEVICE)
    commit_states_ref(want_ssm, cand, want_conv, win, slot_t, row_t)
    for s, r in zip(chosen, accepted):  # the reference itself, spelled out
        assert torch.equal(want_ssm[:, s], cand[:, s, r])
        assert torch.equal(want_conv[:, s], win[:, s, :, r + 1 : r + 1 + width])
    commit(ssm, cand, conv, win, slot_t, row_t)
    assert torch.equal(ssm, want_ssm)
    assert torch.equal(conv, want_conv)


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
def test_commit_matches_reference(conv_dtype):
    # a state of 5000 elements spans two programs of SSM_BLOCK with a ragged tail
    _check(commit_states_triton, 3, 6, 4, (5, 25, 40), 37, 3, conv_dtype, [4, 1, 5], [3, 0, 2])


def test_one_request_first_row_and_dispatcher():
    _check(commit_states_triton, 2, 3, 2, (2, 4, 8), 10, 3, torch.float32, [2], [0])
    _check(commit_states, 2, 3, 2, (2, 4, 8), 10, 3, torch.float32, [0, 2], [1, 1])


def test_reference_in_layer_chunks():
    """The reference gathers a few layers at a time (its temporary bounded): same result."""
    ssm, cand, conv, win = _pools(5, 4, 3, (2, 4, 8), 6, 3, torch.float32)
    slots, rows = torch.tensor([3, 0], device=DEVICE), torch.tensor([2, 1], device=DEVICE)
    whole = [t.clone() for t in (ssm, conv)]
    commit_states_ref(whole[0], cand, whole[1], win, slots, rows)
    commit_states_ref(ssm, cand, conv, win, slots, rows, chunk_bytes=1)  # one layer a time
    assert torch.equal(ssm, whole[0]) and torch.equal(conv, whole[1])


def test_rejects_a_strided_state():
    ssm, cand, conv, win = _pools(2, 3, 2, (2, 4, 8), 10, 3, torch.float32)
    slots, rows = torch.tensor([1], device=DEVICE), torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        commit_states_triton(ssm[..., :4], cand[..., :4], conv, win, slots, rows)


@gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_full_size_qwen35_27b(batch):
    """The 27B pools: 48 GDN layers, 48 x 128 x 128 fp32 states, conv 10240 x 3 in bf16, k = 3."""
    _check(
        commit_states_triton,
        48,
        batch + 3,
        4,
        (48, 128, 128),
        10240,
        3,
        torch.bfloat16,
        list(range(2, batch + 2)),
        [i % 4 for i in range(batch)],
    )
