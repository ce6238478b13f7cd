"""MTP state commit: after acceptance, each request's GDN state becomes the one after its last
accepted verify row, in every GDN layer at once. Called by appliance/engine/pools.py.

The stacked pools (engine/pools.py): ssm [L, S, Hv, Dk, Dv] fp32 and its per-row candidates
[L, S, R, Hv, Dk, Dv]; conv [L, S, C, W] and the working windows [L, S, C, W + R] whose columns
j + 1 .. j + W are the conv state after row j. For request b (pool slot slots[b], accepted row
rows[b]): ssm[:, slot] = candidates[:, slot, row], conv[:, slot] = windows[:, slot, :, row + 1 :
row + 1 + W].

Torch advanced indexing does this as a gather into a temporary and an index_put, four launches a
chunk of layers and both passes through index kernels (0.4 ms for the 150 MB of a 27B request's
SSM state on the H200: run AJ). The Triton kernels copy each state once, straight from candidate
to pool, one launch per kind.
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import jit, next_pow2, tl, use_triton

SSM_BLOCK = 4096  # state elements per program (16 KB of fp32)


def commit_states_ref(
    ssm: torch.Tensor,  # [L, S, *state]
    candidates: torch.Tensor,  # [L, S, R, *state]
    conv: torch.Tensor,  # [L, S, C, W]
    windows: torch.Tensor,  # [L, S, C, W + R]
    slots: torch.Tensor,  # [B] int64
    rows: torch.Tensor,  # [B] int64, the accepted row of each request (0 .. R - 1)
    chunk_bytes: int = 256 * 2**20,
) -> None:
    """The gathered states are a temporary: a few layers at a time keeps it near chunk_bytes
    (all 48 layers of a 16-request 27B batch would be 2.4 GB)."""
    per_layer = slots.numel() * ssm[0, 0].numel() * ssm.element_size()
    step = max(1, chunk_bytes // max(1, per_layer))
    for first in range(0, ssm.shape[0], step):
        layers = slice(first, first + step)
        ssm[layers, slots] = candidates[layers, slots, rows].to(ssm.dtype)
    width = conv.shape[-1]
    cols = rows[:, None] + 1 + torch.arange(width, device=slots.device)  # [B, W]
    picked = windows[:, slots]  # [L, B, C, W + R]
    index = cols[None, :, None, :].expand(picked.shape[0], -1, picked.shape[2], -1)
    conv[:, slots] = picked.gather(3, index).to(conv.dtype)


@jit
def _ssm_commit_kernel(
    ssm_ptr,
    cand_ptr,
    slots_ptr,
    rows_ptr,
    numel,  # elements of one layer's state of one request
    stride_sl,
    stride_ss,
    stride_cl,
    stride_cs,
    stride_cr,
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    src = cand_ptr + layer * stride_cl + slot * stride_cs + row * stride_cr
    value = tl.load(src + offs, mask=ok)
    dst = ssm_ptr + layer * stride_sl + slot * stride_ss
    tl.store(dst + offs, value.to(ssm_ptr.dtype.element_ty), mask=ok)


@jit
def _conv_commit_kernel(
    conv_ptr,
    win_ptr,
    slots_ptr,
    rows_ptr,
    channels,
    width,
    stride_vl,
    stride_vs,
    stride_vc,
    stride_wl,
    stride_ws,
    stride_wc,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.arange(0, BLOCK_W)
    ok = (c < channels)[:, None] & (w < width)[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    src = win_ptr + layer * stride_wl + slot * stride_ws + c[:, None] * stride_wc
    value = tl.load(src + (row + 1 + w)[None, :], mask=ok)
    dst = conv_ptr + layer * stride_vl + slot * stride_vs + c[:, None] * stride_vc + w[None, :]
    tl.store(dst, value.to(conv_ptr.dtype.element_ty), mask=ok)


def _state_contiguous(t: torch.Tensor, lead: int) -> bool:
    """Whether the dims after the first `lead` form one contiguous block."""
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def commit_states_triton(ssm, candidates, conv, windows, slots, rows) -> None:
    """Same result as commit_states_ref."""
    layers, batch = ssm.shape[0], slots.shape[0]
    if layers == 0 or batch == 0:
        return
    if not (_state_contiguous(ssm, 2) and _state_contiguous(candidates, 3)):
        raise ValueError("commit_states: each state must be one contiguous block")
    if conv.stride(-1) != 1 or windows.stride(-1) != 1:
        raise ValueError("commit_states: conv columns must be contiguous")
    numel = ssm[0, 0].numel()
    _ssm_commit_kernel[(layers, batch, -(-numel // SSM_BLOCK))](
        ssm,
        candidates,
        slots,
        rows,
        numel,
        ssm.stride(0),
        ssm.stride(1),
        candidates.stride(0),
        candidates.stride(1),
        candidates.stride(2),
        BLOCK=SSM_BLOCK,
        num_warps=4,
    )
    channels, width = conv.shape[2], conv.shape[3]
    block_w = next_pow2(width)
    block_c = max(1, 2048 // block_w)
    _conv_commit_kernel[(layers, batch, -(-channels // block_c))](
        conv,
        windows,
        slots,
        rows,
        channels,
        width,
        conv.stride(0),
        conv.stride(1),
        conv.stride(2),
        windows.stride(0),
        windows.stride(1),
        windows.stride(2),
        BLOCK_C=block_c,
        BLOCK_W=block_w,
        num_warps=4,
    )


def commit_states(ssm, candidates, conv, windows, slots, rows) -> None:
    """Dispatcher used by the pools: Triton on CUDA, the reference elsewhere."""
    if use_triton(ssm):
        commit_states_triton(ssm, candidates, conv, windows, slots, rows)
    else:
        commit_states_ref(ssm, candidates, conv, windows, slots, rows)
