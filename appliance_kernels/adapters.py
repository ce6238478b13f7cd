"""Adapters that run an op through an optional external library behind the op's own signature
(selected in appliance_kernels.backends): fp8 GEMM via torch._scaled_mm / sglang-kernel / vLLM
cutlass, GDN chunked prefill via fla-core / flash-qla, paged attention via flashinfer. Called by the
dispatchers in appliance_kernels/fp8.py, gdn.py and attention.py; imports no other kernels module
(the dispatchers keep the fallbacks to our own kernels and references).
"""

from __future__ import annotations

import os

import torch

# ---------------------------------------------- fp8 ----------------------------------------------

FP8_ADAPTERS = ("torch", "sgl", "cutlass")


def _per_channel(scale_b: torch.Tensor, n: int) -> torch.Tensor:
    """cuBLASLt row-wise / sgl / cutlass take a scale per output channel: expand per-tensor."""
    if scale_b.dtype == torch.float32 and scale_b.numel() == n and scale_b.is_contiguous():
        return scale_b.view(n)  # the usual case, checked without launching anything
    scale_b = scale_b.float().reshape(-1)
    return scale_b.expand(n).contiguous() if scale_b.numel() == 1 else scale_b


def _per_row(scale_a: torch.Tensor, m: int) -> torch.Tensor:
    if scale_a.dtype == torch.float32 and scale_a.numel() == m and scale_a.is_contiguous():
        return scale_a.view(m, 1)
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
    """The scaled GEMM through an external library: "torch" (cuBLASLt row-wise scales, SM90+; the
    fp8_scaled_mm dispatcher routes "torch" below SM90 to the reference), "sgl" or "cutlass"."""
    m, n = a_q.shape[0], b_q.shape[0]
    if backend == "torch":
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
    raise ValueError(f"fp8 GEMM adapter {backend!r}: expected one of {', '.join(FP8_ADAPTERS)}")


# ---------------------------------------------- GDN ----------------------------------------------


# fla-core (0.6+) hands its own chunk_gated_delta_rule to flash-qla whenever flash_qla imports,
# unless this switch of fla's backend registry is "0" (it reads it at every call)
FLA_FLASHQLA_SWITCH = "FLA_FLASH_QLA"


def _chunk_gated_delta_rule(backend: str):
    """The chunk kernel the backend names: flash-qla's, or fla-core's own Triton one."""
    if backend == "flashqla":
        from flash_qla import chunk_gated_delta_rule

        return chunk_gated_delta_rule
    if os.environ.get(FLA_FLASHQLA_SWITCH) != "0":
        os.environ[FLA_FLASHQLA_SWITCH] = "0"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


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
    chunk_gated_delta_rule = _chunk_gated_delta_rule(backend)
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


# ------------------------------------------- attention -------------------------------------------

FLASHINFER_WORKSPACE_BYTES = 256 * 2**20
# decode kernels on CUDA cores exist for these q-per-kv group sizes; others use the tensor-core path
_FI_CUDA_CORE_GROUPS = (1, 2, 4, 8)


class _FlashInferPlans:
    """One flashinfer wrapper per (device, kind) and the plan of the last batch metadata seen.

    The model calls attention once per layer with the same metadata tensors, so the plan (host
    work plus a sync) is made once per forward: the cache key is the identity of those tensors,
    and it holds them, so a later forward's tensors cannot reuse their ids."""

    def __init__(self) -> None:
        self.workspaces: dict[torch.device, torch.Tensor] = {}
        self.wrappers: dict[tuple, object] = {}
        self.last: dict[tuple, tuple] = {}

    def wrapper(self, device: torch.device, decode: bool, tensor_cores: bool):
        import flashinfer

        key = (device, decode, tensor_cores)
        if key not in self.wrappers:
            if device not in self.workspaces:
                self.workspaces[device] = torch.empty(
                    FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device
                )
            ws = self.workspaces[device]
            if decode:
                self.wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=tensor_cores
                )
            else:
                self.wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", backend="fa2"
                )
        return self.wrappers[key]


_FI = _FlashInferPlans()


def _page1_table(req_to_token, req_slots, seq_lens):
    """CSR page table with one token per page: indptr [B+1], indices [sum(lens)], last_len [B]."""
    lens = seq_lens.long()
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(lens, 0)
    rows = req_to_token[req_slots.long()]  # [B, max_len]
    keep = torch.arange(rows.shape[1], device=rows.device)[None, :] < lens[:, None]
    indices = rows[keep].to(torch.int32)
    return indptr, indices, torch.ones_like(indptr[1:])


def paged_attention_flashinfer(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_len]
    req_slots: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    max_q_len: int | None = None,
    kv_scales: tuple[float, float] | None = None,  # (k, v) dequantisation scales of an fp8 cache
) -> torch.Tensor:
    """Same result as appliance_kernels.attention.paged_attention_ref through flashinfer's paged
    wrappers, our token-granular cache viewed as pages of one token (no copy). Decode batches (one q
    row per request) use the decode wrapper; verify rows and prefill the FA2 prefill wrapper, causal
    with the q rows as the last tokens of each sequence. An fp8 (e4m3) cache is planned with
    kv_data_type e4m3 and its scales go to `run` as flashinfer's float `k_scale` / `v_scale` (folded
    into sm_scale / applied to the output, the semantics of our kernels); the wrappers never run
    inside CUDA graphs here, so host floats are safe."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    decode = max_q_len == 1 and q.shape[0] == req_slots.shape[0]
    group = num_q_heads // num_kv_heads
    tensor_cores = decode and group not in _FI_CUDA_CORE_GROUPS
    wrapper = _FI.wrapper(q.device, decode, tensor_cores)
    meta = (req_to_token, req_slots, cu_seqlens_q, seq_lens)
    key = (q.device, decode, tensor_cores)
    # identity only (inference tensors have no version counter): the runner builds req_slots,
    # cu_seqlens_q and seq_lens anew for every forward, after writing that forward's req_to_token
    # (and the dtypes: a plan is made for one q / kv dtype, flashinfer refuses another)
    stamp = tuple(id(t) for t in meta) + (num_q_heads, num_kv_heads, head_dim, q.dtype)
    stamp += (k_cache.dtype,)
    cached = _FI.last.get(key)
    if cached is None or cached[0] != stamp:
        indptr, indices, last_len = _page1_table(req_to_token, req_slots, seq_lens)
        common = dict(q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
        if decode:
            wrapper.plan(
                indptr, indices, last_len, num_q_heads, num_kv_heads, head_dim, 1, **common
            )
        else:
            wrapper.plan(
                cu_seqlens_q.to(torch.int32),
                indptr,
                indices,
                last_len,
                num_q_heads,
                num_kv_heads,
                head_dim,
                1,
                causal=True,
                **common,
            )
        _FI.last[key] = (stamp, meta)  # holding meta keeps the ids in the stamp unique
    q = q if q.is_contiguous() else q.contiguous()
    scales = {}
    if k_cache.dtype == torch.float8_e4m3fn:
        k_scale, v_scale = kv_scales if kv_scales is not None else (1.0, 1.0)
        scales = dict(k_scale=float(k_scale), v_scale=float(v_scale))
    return wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)), **scales)
