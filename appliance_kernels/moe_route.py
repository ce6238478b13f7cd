"""MoE routing in one kernel: softmax over the router logits, top-k, renormalisation and the cast
of the weights to the activations' dtype (what the reference, appliance_kernels.moe.moe_route_ref
followed by `.to(dtype)`, does in five or six small kernels per layer; at decode sizes each is a
launch gap of its own, ~40 MoE layers a step on Qwen3.5-35B-A3B).

The weights come out in the dtype the experts multiply them in (the reference's cast after it).
One program per token: the row of E logits (E <= MAX_EXPERTS) in registers, softmax in fp32, then
k rounds of argmax (ties to the lower expert id, descending weights as torch.topk returns them).
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import jit, next_pow2, tl

MAX_EXPERTS = 1024
MAX_TOP_K = 32


@jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)  # padding below every probability
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        index = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # the lowest id among ties
        picked_w = tl.where(slots == j, best, picked_w)
        picked_i = tl.where(slots == j, index.to(tl.int64), picked_i)
        p = tl.where(e == index, -2.0, p)
    keep = slots < TOP_K
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(keep, picked_w, 0.0), axis=0)
    w = picked_w.to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + t * TOP_K + slots, w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, picked_i, mask=keep)


def moe_route_triton(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] in `out_dtype` (computed in fp32), topk_ids [T, k] int64), as
    moe_route_ref(...) with the weights cast to `out_dtype`."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= min(num_experts, MAX_TOP_K) or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"moe_route: top_k {top_k} of {num_experts} experts (at most {MAX_TOP_K} of "
            f"{MAX_EXPERTS})"
        )
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    _route_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_K=next_pow2(top_k),
        RENORMALIZE=renormalize,
        num_warps=4 if num_experts >= 256 else 1,
    )
    return weights, ids
