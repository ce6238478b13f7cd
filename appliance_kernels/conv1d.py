"""Depthwise causal conv1d with per-request state (the GDN short conv): varlen prefill and decode in
one reference op. Called by appliance/models/layers/gdn.py.

conv_states[state_slot] holds the last K-1 inputs of the request (its left context); the op reads it
when has_initial_state, and overwrites it with the last K-1 inputs after this step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance_kernels.triton_utils import (
    check_last_dim_contiguous,
    jit,
    next_pow2,
    pdl,
    pdl_start,
    tl,
    use_triton,
)


def causal_conv1d_ref(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    activation: str | None = "silu",
) -> torch.Tensor:
    """Returns [T, C] in x's dtype and updates conv_states in place."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    cu = cu_seqlens.tolist()
    for b, (slot, has_init) in enumerate(zip(state_slots.tolist(), has_initial_state.tolist())):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        xs = x[start:end].t()  # [C, L]
        if has_init:
            left = conv_states[slot].to(x.dtype)
        else:
            left = torch.zeros(x.shape[1], width - 1, dtype=x.dtype, device=x.device)
        full = torch.cat([left, xs], dim=1)  # [C, K-1+L]
        y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=x.shape[1])[0]
        if activation == "silu":
            y = F.silu(y)
        out[start:end] = y.t().to(x.dtype)
        conv_states[slot] = full[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_verify_ref(
    x: torch.Tensor,  # [T, C] — each request's rows are its MTP verify rows
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1] committed left context (read only)
    conv_windows: torch.Tensor,  # [num_state_slots, C, K - 1 + max_rows] working slot
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    activation: str | None = "silu",
) -> torch.Tensor:
    """Conv over verify rows; the committed state is untouched and the wide working slot gets
    [left context | rows], so accepting row j commits window[:, j + 1 : j + K]."""
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(state_slots.tolist()):
        s, e = cu[b], cu[b + 1]
        full = torch.cat([conv_states[slot].to(x.dtype), x[s:e].t()], dim=1)  # [C, K-1+rows]
        y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=x.shape[1])[0]
        if activation == "silu":
            y = F.silu(y)
        out[s:e] = y.t().to(x.dtype)
        conv_windows[slot, :, : full.shape[1]] = full.to(conv_windows.dtype)
    return out


# -------------------------------------------------------------------------------------------------
# Triton. `_conv1d_fwd_kernel`: one program per (request, channel block, token block) computes
# outputs, reading the left context from the old state. The new state (last K-1 inputs of [old | x])
# is written inside that kernel when one token block covers every request (decode: one launch) and
# by `_conv1d_state_kernel` otherwise, so no program overwrites a state another program still reads.
# The verify variant leaves the committed state alone and writes [old state | rows] to the window.
# -------------------------------------------------------------------------------------------------


@jit
def _final_state(
    x_ptr,
    state_ptr,
    slot,
    start,
    length,
    cc,
    c_ok,
    stride_xt,
    stride_ss,
    stride_sc,
    init_flag,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """state <- columns length .. length+K-2 of [old_state | x] (old columns where length < K-1)."""
    j = tl.arange(0, BLOCK_W)
    j_ok = j < WIDTH - 1
    has_init = j < BLOCK_W * init_flag.to(tl.int32)  # the scalar flag as a vector (interpreter)
    src = length + j - (WIDTH - 1)  # row inside the request; < 0 -> old state column src + K - 1
    xv = tl.load(
        x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + cc[None, :],
        mask=(j_ok & (src >= 0))[:, None] & c_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    state_row = state_ptr + slot * stride_ss + cc[None, :] * stride_sc
    sv = tl.load(
        state_row + (src + WIDTH - 1)[:, None],
        mask=(j_ok & (src < 0) & has_init)[:, None] & c_ok[None, :],
        other=0.0,
    )
    tl.store(
        state_ptr + slot * stride_ss + cc[None, :] * stride_sc + j[:, None],
        (xv + sv.to(tl.float32)).to(state_ptr.dtype.element_ty),
        mask=j_ok[:, None] & c_ok[None, :],
    )


@jit
def _conv1d_fwd_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    state_ptr,
    win_ptr,
    slots_ptr,
    cu_ptr,
    has_init_ptr,
    stride_xt,
    stride_ot,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_ws,
    stride_wcc,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SILU: tl.constexpr,
    FUSE_STATE: tl.constexpr,
    VERIFY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    b = tl.program_id(0)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cc < channels
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if VERIFY:
        init_flag = length >= 0  # verify rows always continue from the committed state
    else:
        init_flag = tl.load(has_init_ptr + b) != 0
    has_init = tl.arange(0, BLOCK_T) < BLOCK_T * init_flag.to(tl.int32)
    p = t0 + tl.arange(0, BLOCK_T)  # row inside the request
    p_ok = p < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    state_row = state_ptr + slot * stride_ss + cc[None, :] * stride_sc
    for tap in tl.static_range(WIDTH):
        src = p - (WIDTH - 1) + tap
        xv = tl.load(
            x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + cc[None, :],
            mask=(p_ok & (src >= 0))[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        sv = tl.load(
            state_row + (src + WIDTH - 1)[:, None],
            mask=(p_ok & (src < 0) & has_init)[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + cc * stride_wc + tap, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(
        out_ptr + (start + p).to(tl.int64)[:, None] * stride_ot + cc[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=p_ok[:, None] & c_ok[None, :],
    )
    if VERIFY:
        j = tl.arange(0, BLOCK_W)
        j_ok = j < WIDTH - 1
        old = tl.load(
            state_ptr + slot * stride_ss + cc[None, :] * stride_sc + j[:, None],
            mask=j_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        win = win_ptr + slot * stride_ws + cc[None, :] * stride_wcc
        tl.store(
            win + j[:, None], old.to(win_ptr.dtype.element_ty), mask=j_ok[:, None] & c_ok[None, :]
        )
        rows = tl.load(
            x_ptr + (start + p).to(tl.int64)[:, None] * stride_xt + cc[None, :],
            mask=p_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        tl.store(
            win + (WIDTH - 1 + p)[:, None],
            rows.to(win_ptr.dtype.element_ty),
            mask=p_ok[:, None] & c_ok[None, :],
        )
    elif FUSE_STATE:
        _final_state(
            x_ptr,
            state_ptr,
            slot,
            start,
            length,
            cc,
            c_ok,
            stride_xt,
            stride_ss,
            stride_sc,
            init_flag,
            WIDTH,
            BLOCK_W,
        )


@jit
def _conv1d_state_kernel(
    x_ptr,
    state_ptr,
    slots_ptr,
    cu_ptr,
    has_init_ptr,
    stride_xt,
    stride_ss,
    stride_sc,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    if length == 0:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    _final_state(
        x_ptr,
        state_ptr,
        slot,
        start,
        length,
        cc,
        cc < channels,
        stride_xt,
        stride_ss,
        stride_sc,
        tl.load(has_init_ptr + b) != 0,
        WIDTH,
        BLOCK_W,
    )


def _conv_launch(
    x,
    weight,
    conv_states,
    windows,
    state_slots,
    cu_seqlens,
    has_initial_state,
    activation,
    max_q_len,
    out,
):
    check_last_dim_contiguous("x", x)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if weight.shape[0] != channels or conv_states.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv1d: x {x.shape} weight {weight.shape} states {conv_states.shape}")
    if weight.stride(1) != 1 or conv_states.stride(2) != 1:
        raise ValueError("conv1d: weight rows and state rows must be contiguous")
    if activation not in (None, "silu"):
        raise ValueError(f"conv1d: activation {activation!r} not in (None, 'silu')")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    batch = state_slots.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    block_t = min(next_pow2(max(max_q_len, 1)), 64)
    block_c = 256 if block_t <= 8 else 128
    verify = windows is not None
    if verify and (max_q_len > block_t or windows.shape[2] < width - 1 + max_q_len):
        raise ValueError(f"conv1d verify: {max_q_len} rows do not fit windows {windows.shape}")
    fuse = max_q_len <= block_t
    block_w = next_pow2(max(width - 1, 1))
    win = windows if verify else conv_states
    grid = (batch, -(-channels // block_c), -(-max_q_len // block_t))
    _conv1d_fwd_kernel[grid](
        x,
        weight,
        out,
        conv_states,
        win,
        state_slots,
        cu_seqlens,
        has_initial_state if has_initial_state is not None else state_slots,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        win.stride(0),
        win.stride(1),
        channels,
        WIDTH=width,
        BLOCK_W=block_w,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        SILU=activation == "silu",
        FUSE_STATE=fuse,
        VERIFY=verify,
        **pdl(x),
    )
    if not fuse:
        _conv1d_state_kernel[(batch, -(-channels // 256))](
            x,
            conv_states,
            state_slots,
            cu_seqlens,
            has_initial_state,
            x.stride(0),
            conv_states.stride(0),
            conv_states.stride(1),
            channels,
            WIDTH=width,
            BLOCK_W=block_w,
            BLOCK_C=256,
        )
    return out


def causal_conv1d_triton(
    x: torch.Tensor,  # [T, C] (token stride free)
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    activation: str | None = "silu",
    *,
    max_q_len: int | None = None,  # host bound on rows per request; given -> no device sync
    out: torch.Tensor | None = None,  # [T, C]
) -> torch.Tensor:
    """Same result as causal_conv1d_ref (varlen prefill and decode update)."""
    return _conv_launch(
        x,
        weight,
        conv_states,
        None,
        state_slots,
        cu_seqlens,
        has_initial_state,
        activation,
        max_q_len,
        out,
    )


def causal_conv1d_verify_triton(
    x: torch.Tensor,  # [T, C] MTP verify rows
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1] committed (read only)
    conv_windows: torch.Tensor,  # [num_state_slots, C, K - 1 + max_rows]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    activation: str | None = "silu",
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as causal_conv1d_verify_ref."""
    if conv_windows.stride(2) != 1:
        raise ValueError("conv1d verify: window rows must be contiguous")
    return _conv_launch(
        x,
        weight,
        conv_states,
        conv_windows,
        state_slots,
        cu_seqlens,
        None,
        activation,
        max_q_len,
        out,
    )


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B] bool
    activation: str | None = "silu",
    *,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Dispatcher used by the model layers: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        return causal_conv1d_triton(
            x,
            weight,
            conv_states,
            state_slots,
            cu_seqlens,
            has_initial_state,
            activation,
            max_q_len=max_q_len,
        )
    return causal_conv1d_ref(
        x, weight, conv_states, state_slots, cu_seqlens, has_initial_state, activation
    )


def causal_conv1d_verify(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_states: torch.Tensor,  # [num_state_slots, C, K - 1]
    conv_windows: torch.Tensor,  # [num_state_slots, C, K - 1 + max_rows]
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    activation: str | None = "silu",
    *,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Dispatcher for the causal_conv1d_verify_ref contract: Triton on CUDA, else the reference."""
    if use_triton(x):
        return causal_conv1d_verify_triton(
            x,
            weight,
            conv_states,
            conv_windows,
            state_slots,
            cu_seqlens,
            activation,
            max_q_len=max_q_len,
        )
    return causal_conv1d_verify_ref(
        x, weight, conv_states, conv_windows, state_slots, cu_seqlens, activation
    )
