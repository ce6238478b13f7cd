"""Adapters that run an op through an optional external library behind the op's own signature
(selected in kernels.backends): fp8 GEMM via torch._scaled_mm / sglang-kernel / vLLM cutlass, GDN
chunked prefill via fla-core / flash-qla. Called by the dispatchers in kernels/fp8.py and gdn.py.
"""

from __future__ import annotations

import torch

from kernels.fp8 import fp8_scaled_mm_ref

# ---------------------------------------------- fp8 ----------------------------------------------


def _per_channel(scale_b: torch.Tensor, n: int) -> torch.Tensor:
    """cuBLASLt row-wise / sgl / cutlass take a scale per output channel: expand per-tensor."""
    scale_b = scale_b.float().reshape(-1)
    return scale_b.expand(n).contiguous() if scale_b.numel() == 1 else scale_b


def _per_row(scale_a: torch.Tensor, m: int) -> torch.Tensor:
    scale_a = scale_a.float().reshape(-1)
    return (scale_a.expand(m) if scale_a.numel() == 1 else scale_a).reshape(m, 1).contiguous()


def fp8_scaled_mm_external(
    backend: str,
    a_q: torch.Tensor,  # [M, K] e4m3
    b_q: torch.Tensor,  # [N, K] e4m3
    scale_a: torch.Tensor,  # [M, 1] or [1]
    scale_b: torch.Tensor,  # [N] / [N, 1] or [1]
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    m, n = a_q.shape[0], b_q.shape[0]
    if backend == "torch" and torch.cuda.get_device_capability(a_q.device) >= (9, 0):
        # cuBLASLt: b column-major (the transposed view of the row-major weight), scales (M,1)/(1,N)
        return torch._scaled_mm(
            a_q,
            b_q.t(),
            scale_a=_per_row(scale_a, m),
            scale_b=_per_channel(scale_b, n).reshape(1, n),
            bias=bias,
            out_dtype=out_dtype,
        )
    if backend == "sgl":
        from sgl_kernel import fp8_scaled_mm

        return fp8_scaled_mm(
            a_q,
            b_q.t(),
            _per_row(scale_a, m),
            _per_channel(scale_b, n).reshape(n, 1),
            out_dtype,
            bias,
        )
    if backend == "cutlass":
        from vllm import _custom_ops

        return _custom_ops.cutlass_scaled_mm(
            a_q,
            b_q.t(),
            scale_a=_per_row(scale_a, m),
            scale_b=_per_channel(scale_b, n).reshape(n, 1),
            out_dtype=out_dtype,
            bias=bias,
        )
    return fp8_scaled_mm_ref(a_q, b_q, scale_a, scale_b, out_dtype, bias)


# ---------------------------------------------- GDN ----------------------------------------------


def gdn_chunked_external(
    backend: str,
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_state_slots, Hv, Dk, Dv] fp32
    state_slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B + 1]
    has_initial_state: torch.Tensor,  # [B]
    *,
    min_len: int,
    out: torch.Tensor,  # [T, Hv, Dv]; rows of requests longer than min_len are written
) -> torch.Tensor:
    """fla-core / flash-qla `chunk_gated_delta_rule` over the requests longer than min_len: their
    rows are packed, states gathered from the pool (zeros without an initial state) and scattered
    back."""
    if backend == "flashqla":
        from flash_qla import chunk_gated_delta_rule
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    picked = torch.nonzero(lens > min_len).flatten()
    if picked.numel() == 0:
        return out
    starts = cu_seqlens[:-1].long()[picked]
    sel_lens = lens[picked]
    rows = torch.repeat_interleave(starts - torch.cumsum(sel_lens, 0) + sel_lens, sel_lens)
    rows = rows + torch.arange(rows.numel(), device=rows.device)  # token ids of the picked requests
    cu = torch.zeros(picked.numel() + 1, dtype=torch.int64, device=q.device)
    cu[1:] = torch.cumsum(sel_lens, 0)
    slots = state_slots.long()[picked]
    init = torch.where(has_initial_state[picked].view(-1, 1, 1, 1), ssm_states[slots], 0.0)
    o, final = chunk_gated_delta_rule(
        q[rows].unsqueeze(0),
        k[rows].unsqueeze(0),
        v[rows].unsqueeze(0),
        g=g[rows].float().unsqueeze(0),
        beta=beta[rows].float().unsqueeze(0),
        scale=q.shape[-1] ** -0.5,
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    out[rows] = o[0].to(out.dtype)
    ssm_states[slots] = final.to(ssm_states.dtype)
    return out
