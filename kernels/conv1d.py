"""Depthwise causal conv1d with per-request state (the GDN short conv): varlen prefill and decode in one
reference op. Called by appliance/models/layers/gdn.py.

conv_states[state_slot] holds the last K-1 inputs of the request (its left context); the op reads it
when has_initial_state, and overwrites it with the last K-1 inputs after this step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl, use_triton


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
        conv_states[slot] = full[:, -(width - 1):].to(conv_states.dtype)
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
    width = weight.shape[1]
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


# ---------------------------------------------------------------------------------------------------
# Triton. `_conv1d_fwd_kernel`: one program per (request, channel block, token block) computes
# outputs, reading the left context from the old state. The new state (and, for verify rows, the
# state after each row) is written by `_store_states`, which runs inside the forward kernel when one
# token block covers every request (decode / verify: one launch) and as a second kernel otherwise, so
# no program overwrites a state another program still reads.
# State after row p of a request = columns p+1 .. p+K-1 of [old_state | x].
# ---------------------------------------------------------------------------------------------------


@jit
def _store_states(
    x_ptr, state_ptr, slots_ptr, inter_ptr, b, start, length, cc, c_ok,
    stride_xt, stride_ss, stride_sc, has_init,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, HAS_INTER: tl.constexpr, BLOCK_T: tl.constexpr,
):
    j = tl.arange(0, BLOCK_W)  # state column
    j_ok = j < WIDTH - 1
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # gather every value first: the final state may overwrite the old one in place
    final = _window(x_ptr, state_ptr, slot, start, length, length - 1, j, j_ok, cc, c_ok,
                    stride_xt, stride_ss, stride_sc, has_init, WIDTH)
    if HAS_INTER:
        for i in range(0, length):
            inter = tl.load(inter_ptr + start + i).to(tl.int64)
            if inter >= 0:
                win = _window(x_ptr, state_ptr, slot, start, length, i, j, j_ok, cc, c_ok,
                              stride_xt, stride_ss, stride_sc, has_init, WIDTH)
                tl.store(state_ptr + inter * stride_ss + cc[None, :] * stride_sc + j[:, None], win,
                         mask=j_ok[:, None] & c_ok[None, :])
    tl.store(state_ptr + slot * stride_ss + cc[None, :] * stride_sc + j[:, None], final,
             mask=j_ok[:, None] & c_ok[None, :])


@jit
def _window(x_ptr, state_ptr, slot, start, length, row, j, j_ok, cc, c_ok,
            stride_xt, stride_ss, stride_sc, has_init, WIDTH: tl.constexpr):
    """[BLOCK_W, BLOCK_C]: the K-1 inputs ending at `row` (old-state columns where row - K + 2 < 0)."""
    src = row + 1 + j - (WIDTH - 1)  # token index inside the request; < 0 -> old state column
    from_x = j_ok & (src >= 0)
    from_state = j_ok & (src < 0) & (src + WIDTH - 1 >= 0)
    xv = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + cc[None, :],
                 mask=from_x[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    sv = tl.load(state_ptr + slot * stride_ss + cc[None, :] * stride_sc + (src + WIDTH - 1)[:, None],
                 mask=(from_state & has_init)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    return (xv + sv).to(state_ptr.dtype.element_ty)


@jit
def _conv1d_fwd_kernel(
    x_ptr, w_ptr, out_ptr, state_ptr, slots_ptr, cu_ptr, has_init_ptr, inter_ptr,
    stride_xt, stride_ot, stride_wc, stride_ss, stride_sc, channels,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SILU: tl.constexpr, FUSE_STATE: tl.constexpr, HAS_INTER: tl.constexpr,
):
    b = tl.program_id(0)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cc < channels
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    init_flag = tl.load(has_init_ptr + b) != 0
    has_init = tl.arange(0, BLOCK_T) < BLOCK_T * init_flag.to(tl.int32)  # scalar flag as a vector
    p = t0 + tl.arange(0, BLOCK_T)  # row inside the request
    p_ok = p < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        src = p - (WIDTH - 1) + tap
        xv = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * stride_xt + cc[None, :],
                     mask=(p_ok & (src >= 0))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        sv = tl.load(state_ptr + slot * stride_ss + cc[None, :] * stride_sc + (src + WIDTH - 1)[:, None],
                     mask=(p_ok & (src < 0) & has_init)[:, None] & c_ok[None, :],
                     other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cc * stride_wc + tap, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + p).to(tl.int64)[:, None] * stride_ot + cc[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])
    if FUSE_STATE:
        j_init = tl.arange(0, BLOCK_W) < BLOCK_W * init_flag.to(tl.int32)
        _store_states(x_ptr, state_ptr, slots_ptr, inter_ptr, b, start, length, cc, c_ok,
                      stride_xt, stride_ss, stride_sc, j_init,
                      WIDTH, BLOCK_W, HAS_INTER, BLOCK_T)


@jit
def _conv1d_state_kernel(
    x_ptr, state_ptr, slots_ptr, cu_ptr, has_init_ptr, inter_ptr,
    stride_xt, stride_ss, stride_sc, channels,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, HAS_INTER: tl.constexpr,
):
    b = tl.program_id(0)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    if length == 0:
        return
    init_flag = tl.load(has_init_ptr + b) != 0
    j_init = tl.arange(0, BLOCK_W) < BLOCK_W * init_flag.to(tl.int32)
    _store_states(x_ptr, state_ptr, slots_ptr, inter_ptr, b, start, length, cc, cc < channels,
                  stride_xt, stride_ss, stride_sc, j_init, WIDTH, BLOCK_W, HAS_INTER, 1)


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
    intermediate_state_slots: torch.Tensor | None = None,  # [T] verify rows: state after row t
    out: torch.Tensor | None = None,  # [T, C]
) -> torch.Tensor:
    """Same result as causal_conv1d_ref (prefill, decode update, and the speculative variant that also
    keeps the state after every verify row)."""
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
    fuse = max_q_len <= block_t
    inter = intermediate_state_slots
    if inter is not None and not fuse:
        raise ValueError(f"conv1d: intermediate states only for requests of <= {block_t} rows")
    block_w = next_pow2(max(width - 1, 1))
    common = dict(WIDTH=width, BLOCK_W=block_w, HAS_INTER=inter is not None)
    inter_arg = inter if inter is not None else state_slots
    grid = (batch, -(-channels // block_c), -(-max_q_len // block_t))
    _conv1d_fwd_kernel[grid](
        x, weight, out, conv_states, state_slots, cu_seqlens, has_initial_state, inter_arg,
        x.stride(0), out.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        channels, BLOCK_T=block_t, BLOCK_C=block_c, SILU=activation == "silu", FUSE_STATE=fuse,
        **common,
    )
    if not fuse:
        _conv1d_state_kernel[(batch, -(-channels // 256))](
            x, conv_states, state_slots, cu_seqlens, has_initial_state, inter_arg,
            x.stride(0), conv_states.stride(0), conv_states.stride(1), channels,
            BLOCK_C=256, **common,
        )
    return out


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
    intermediate_state_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher used by the model layers: Triton on CUDA, the reference elsewhere (the reference
    handles intermediate states by stepping one row at a time)."""
    if use_triton(x):
        return causal_conv1d_triton(x, weight, conv_states, state_slots, cu_seqlens,
                                    has_initial_state, activation, max_q_len=max_q_len,
                                    intermediate_state_slots=intermediate_state_slots)
    if intermediate_state_slots is None:
        return causal_conv1d_ref(x, weight, conv_states, state_slots, cu_seqlens, has_initial_state,
                                 activation)
    return causal_conv1d_ref_with_states(x, weight, conv_states, state_slots, cu_seqlens,
                                         has_initial_state, intermediate_state_slots, activation)


def causal_conv1d_ref_with_states(
    x, weight, conv_states, state_slots, cu_seqlens, has_initial_state,
    intermediate_state_slots: torch.Tensor,  # [T]: state after row t -> conv_states[slot] (-1: none)
    activation: str | None = "silu",
) -> torch.Tensor:
    """Reference for verify rows that also keep every row's state: one reference step per row."""
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    inter = intermediate_state_slots.tolist()
    one = torch.tensor([0, 1], dtype=cu_seqlens.dtype, device=x.device)
    for b in range(state_slots.shape[0]):
        for t in range(cu[b], cu[b + 1]):
            init = has_initial_state[b : b + 1]
            if t > cu[b]:
                init = torch.ones_like(init)
            out[t : t + 1] = causal_conv1d_ref(x[t : t + 1], weight, conv_states,
                                               state_slots[b : b + 1], one, init, activation)
            if inter[t] >= 0:
                conv_states[inter[t]] = conv_states[state_slots[b]]
    return out
