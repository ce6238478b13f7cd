"""Benchmark cases for ops/bench/bench_ops.py: inputs at Qwen3.5-27B shapes (35B-A3B for MoE) and
the peers each op is compared with. Each generator yields (op, case, ours, work, unit, peers)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from appliance_kernels import attention, conv1d, fp8, gdn, kv_cache, norm, qk_norm_rope, rotary
from appliance_kernels.activation import silu_and_mul, silu_and_mul_ref

DEV = "cuda"
BF16 = torch.bfloat16
HQ, HKV, HEAD_DIM = 24, 4, 256  # Qwen3.5-27B full attention
HK, HV, DK, DV, CONV_DIM = 16, 48, 128, 128, 10240  # Qwen3.5-27B Gated DeltaNet
HIDDEN, INTER = 5120, 17408


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def maybe_compile(fn, enabled: bool):
    return torch.compile(fn, dynamic=False) if enabled else None


# ------------------------------------------- attention -------------------------------------------


def _kv_batch(q_lens, kv_len):
    batch = len(q_lens)
    slots = batch * kv_len
    k_cache = torch.randn(slots, HKV, HEAD_DIM, device=DEV, dtype=BF16)
    v_cache = torch.randn(slots, HKV, HEAD_DIM, device=DEV, dtype=BF16)
    req_to_token = torch.randperm(slots, device=DEV, dtype=torch.int64).int().view(batch, kv_len)
    total = sum(q_lens)
    q = torch.randn(total, HQ, HEAD_DIM, device=DEV, dtype=BF16)
    cu = torch.tensor([0] + list(q_lens), device=DEV).cumsum(0).int()
    seq = torch.full((batch,), kv_len, device=DEV, dtype=torch.int32)
    slots_b = torch.arange(batch, device=DEV, dtype=torch.int32)
    return q, k_cache, v_cache, req_to_token, slots_b, cu, seq


def _flashinfer_peer(args, scale, q_len) -> dict:
    """flashinfer's paged decode / FA2 prefill on the same paged cache (our backend adapter; the
    plan is made on the first call and reused, as across a step's layers)."""
    if not has("flashinfer"):
        return {}
    from appliance_kernels.adapters import paged_attention_flashinfer

    def run():
        return paged_attention_flashinfer(*args, scale, max_q_len=q_len)

    return {"flashinfer": run}


def attention_cases(compile_peers: bool) -> Iterator[tuple]:
    scale = HEAD_DIM**-0.5
    for batch, q_len, kv_len in (
        (1, 1, 32768),
        (16, 1, 4096),
        (64, 1, 4096),
        (256, 1, 4096),
        (64, 4, 4096),
    ):
        args = _kv_batch([q_len] * batch, kv_len)
        q, k_cache, v_cache, r2t = args[:4]
        dense_k = k_cache[r2t.long()].transpose(1, 2)  # [B, Hkv, L, D], a copy in logical order
        dense_v = v_cache[r2t.long()].transpose(1, 2)
        dense_q = q.view(batch, q_len, HQ, HEAD_DIM).transpose(1, 2)
        work = 2 * batch * kv_len * HKV * HEAD_DIM * 2

        def ours(args=args, q_len=q_len):
            return attention.paged_attention_triton(*args, scale, max_q_len=q_len)

        def sdpa(q=dense_q, k=dense_k, v=dense_v, causal=q_len > 1):
            return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)

        name = "decode" if q_len == 1 else "verify"
        yield (
            "attn_" + name,
            f"B={batch} q={q_len} kv={kv_len}",
            ours,
            work,
            "GB/s",
            {"sdpa_dense": sdpa} | _flashinfer_peer(args, scale, q_len),
        )
        del dense_k, dense_v
    for tokens in (8192,):
        args = _kv_batch([tokens], tokens)
        q = args[0]
        dense_k = args[1][args[3].long()].transpose(1, 2)
        dense_v = args[2][args[3].long()].transpose(1, 2)
        dense_q = q.view(1, tokens, HQ, HEAD_DIM).transpose(1, 2)
        flops = 4 * HQ * HEAD_DIM * tokens * tokens / 2

        def ours_p(args=args, tokens=tokens):
            return attention.paged_attention_triton(*args, scale, max_q_len=tokens)

        def sdpa_p(q=dense_q, k=dense_k, v=dense_v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def cudnn_p(q=dense_q, k=dense_k, v=dense_v):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kr = k.repeat_interleave(HQ // HKV, dim=1)
            vr = v.repeat_interleave(HQ // HKV, dim=1)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        yield (
            "attn_prefill",
            f"T={tokens} causal",
            ours_p,
            flops,
            "TFLOP/s",
            {"sdpa_dense": sdpa_p, "sdpa_cudnn(+repeat kv)": cudnn_p}
            | _flashinfer_peer(args, scale, tokens),
        )


# ---------------------------------------------- GDN ----------------------------------------------


def _gdn_inputs(lens):
    total = sum(lens)
    q = torch.randn(total, HK, DK, device=DEV, dtype=BF16)
    k = torch.randn(total, HK, DK, device=DEV, dtype=BF16)
    v = torch.randn(total, HV, DV, device=DEV, dtype=BF16)
    g = -F.softplus(torch.randn(total, HV, device=DEV)) * 0.5
    beta = torch.sigmoid(torch.randn(total, HV, device=DEV))
    batch = len(lens)
    pool = torch.randn(batch + 1, HV, DK, DV, device=DEV) * 0.1
    slots = torch.arange(batch, device=DEV, dtype=torch.int32)
    cu = torch.tensor([0] + list(lens), device=DEV).cumsum(0).int()
    init = torch.ones(batch, dtype=torch.bool, device=DEV)
    return q, k, v, g, beta, pool, slots, cu, init


def gdn_cases(compile_peers: bool) -> Iterator[tuple]:
    fla = None
    if has("fla"):
        from fla.ops import gated_delta_rule as fla_gdn

        fla = (fla_gdn.chunk_gated_delta_rule, fla_gdn.fused_recurrent_gated_delta_rule)
    for batch in (1, 16, 64, 256):
        args = _gdn_inputs([1] * batch)
        work = 2 * batch * HV * DK * DV * 4  # fp32 state read + write dominates

        def ours(args=args):
            return gdn.gdn(*args, max_q_len=1)

        peers = {}
        if fla is not None:
            q, k, v, g, beta, pool = args[:6]
            state = pool[:batch].clone()

            def fla_rec(q=q, k=k, v=v, g=g, beta=beta, state=state):
                return fla[1](
                    q[:, None],
                    k[:, None],
                    v[:, None],
                    g=g[:, None],
                    beta=beta[:, None],
                    scale=DK**-0.5,
                    initial_state=state,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )

            peers["fla_fused_recurrent(no pool gather)"] = fla_rec
        if batch <= 16:
            peers["torch_ref"] = lambda args=args: gdn.gdn_recurrent_ref(*args)
        yield ("gdn_decode", f"B={batch} Hv={HV}", ours, work, "GB/s", peers)
    for lens in ([8192], [1024] * 8):
        args = _gdn_inputs(lens)
        total = sum(lens)
        flops = total * HV * (6 * 64 * (DK + DV) + 4 * DK * DV)  # rough chunked-form flop count
        peers = {"torch_ref": lambda args=args: gdn.gdn_chunked_ref(*args)}
        if fla is not None:
            q, k, v, g, beta = args[:5]
            cu64 = args[7].long()
            state = args[5][: len(lens)].clone()

            def fla_chunk(q=q, k=k, v=v, g=g, beta=beta, cu=cu64, state=state):
                return fla[0](
                    q[None],
                    k[None],
                    v[None],
                    g=g[None],
                    beta=beta[None],
                    scale=DK**-0.5,
                    initial_state=state,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu,
                )

            peers["fla_chunk"] = fla_chunk
        yield (
            "gdn_prefill",
            f"{len(lens)}x{lens[0]} tokens",
            lambda args=args: gdn.gdn(*args),
            flops,
            "TFLOP/s",
            peers,
        )


# ---------------------------------------------- conv ---------------------------------------------


def conv_cases(compile_peers: bool) -> Iterator[tuple]:
    for lens in ([1] * 256, [4] * 64, [8192]):
        total, batch = sum(lens), len(lens)
        x = torch.randn(total, CONV_DIM, device=DEV, dtype=BF16)
        w = torch.randn(CONV_DIM, 4, device=DEV, dtype=BF16)
        states = torch.randn(batch + 1, CONV_DIM, 3, device=DEV, dtype=BF16)
        slots = torch.arange(batch, device=DEV, dtype=torch.int32)
        cu = torch.tensor([0] + lens, device=DEV).cumsum(0).int()
        init = torch.ones(batch, dtype=torch.bool, device=DEV)
        args = (x, w, states, slots, cu, init)
        work = 2 * total * CONV_DIM * 2 + 2 * batch * CONV_DIM * 3 * 2
        peers = {"torch_ref": lambda args=args: conv1d.causal_conv1d_ref(*args)}
        if batch == 1:
            xt = x.t()[None].contiguous()
            peers["F.conv1d dense"] = lambda xt=xt, w=w: F.silu(
                F.conv1d(xt, w[:, None], padding=3, groups=CONV_DIM)
            )
        yield (
            "conv1d",
            f"{batch}x{lens[0]} C={CONV_DIM}",
            lambda args=args, m=max(lens): conv1d.causal_conv1d(*args, max_q_len=m),
            work,
            "GB/s",
            peers,
        )


# -------------------------------------- norms, rotary, silu --------------------------------------


def _peers(ref, compile_peers: bool, *args) -> dict:
    peers = {"eager_ref": lambda: ref(*args)}
    if compile_peers:
        compiled = maybe_compile(ref, True)
        peers["compiled_ref"] = lambda: compiled(*args)
    return peers


def _rms_case(tokens: int, compile_peers: bool) -> tuple:
    x = torch.randn(tokens, HIDDEN, device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=DEV, dtype=BF16)
    peers = _peers(norm.rms_norm_ref, compile_peers, x, w, 1e-6, True, res)
    return (
        "rms_norm+res",
        f"T={tokens} H={HIDDEN}",
        lambda: norm.rms_norm(x, w, 1e-6, True, res),
        4 * x.numel() * 2,
        "GB/s",
        peers,
    )


def _gated_case(tokens: int, compile_peers: bool) -> tuple:
    xg = torch.randn(tokens * HV, DV, device=DEV, dtype=BF16)
    gate = torch.randn_like(xg)
    wg = torch.randn(DV, device=DEV, dtype=BF16)
    return (
        "gated_rms_norm",
        f"rows={tokens * HV} D={DV}",
        lambda: norm.gated_rms_norm(xg, gate, wg, 1e-6),
        3 * xg.numel() * 2,
        "GB/s",
        _peers(norm.gated_rms_norm_ref, compile_peers, xg, gate, wg, 1e-6),
    )


def _rotary_cases(tokens: int, compile_peers: bool) -> list[tuple]:
    q = torch.randn(tokens, HQ, HEAD_DIM, device=DEV, dtype=BF16)
    freqs = rotary.inv_freq(64, 1e7).to(DEV)
    positions = torch.randint(0, 100000, (3, tokens), device=DEV)
    rows = rotary.mrope_channel_rows(32, [11, 11, 10]).to(DEV)
    cos, sin = rotary.rotary_cos_sin_ref(positions, freqs, rows)
    return [
        (
            "rotary",
            f"T={tokens} Hq={HQ} D={HEAD_DIM} rot=64",
            lambda: rotary.apply_rotary(q, cos, sin),
            2 * q.numel() * 2 + 2 * cos.numel() * 4,
            "GB/s",
            _peers(rotary.apply_rotary_ref, compile_peers, q, cos, sin),
        ),
        (
            "mrope_cos_sin",
            f"T={tokens}",
            lambda: rotary.rotary_cos_sin(positions, freqs, rows),
            2 * tokens * 64 * 4,
            "GB/s",
            _peers(rotary.rotary_cos_sin_ref, False, positions, freqs, rows),
        ),
    ]


def _qk_prologue_case(tokens: int) -> tuple:
    """The attention layer's prologue fused (q/k norm, rotary, KV store) against the five
    separate launches it replaced (peer "separate_ops")."""
    wide = torch.randn(tokens, (2 * HQ + 2 * HKV) * HEAD_DIM, device=DEV, dtype=BF16)
    q = wide[:, : 2 * HQ * HEAD_DIM].view(tokens, HQ, 2 * HEAD_DIM)[:, :, :HEAD_DIM]
    k = wide[:, 2 * HQ * HEAD_DIM : (2 * HQ + HKV) * HEAD_DIM].view(tokens, HKV, HEAD_DIM)
    v = wide[:, (2 * HQ + HKV) * HEAD_DIM :].view(tokens, HKV, HEAD_DIM)
    qw, kw = (torch.randn(HEAD_DIM, device=DEV, dtype=BF16) for _ in range(2))
    positions = torch.randint(0, 100000, (tokens,), device=DEV)
    cos, sin = rotary.rotary_cos_sin_ref(positions, rotary.inv_freq(64, 1e7).to(DEV))
    caches = [torch.zeros(tokens + 64, HKV, HEAD_DIM, device=DEV, dtype=BF16) for _ in range(2)]
    slots = torch.randperm(tokens + 64, device=DEV)[:tokens]

    def separate():
        qn = norm.rms_norm(q.reshape(-1, HEAD_DIM), qw, 1e-6, True)[0].view(q.shape)
        kn = norm.rms_norm(k.reshape(-1, HEAD_DIM), kw, 1e-6, True)[0].view(k.shape)
        qr, kr = rotary.apply_rotary(qn, cos, sin), rotary.apply_rotary(kn, cos, sin)
        kv_cache.store_kv(kr, v, *caches, slots)
        return qr

    return (
        "qk_norm_rope_store",
        f"T={tokens} Hq={HQ} Hkv={HKV} D={HEAD_DIM} rot=64",
        lambda: qk_norm_rope.qk_norm_rope_store(
            q, k, v, qw, kw, 1e-6, True, cos, sin, *caches, slots
        ),
        (2 * q.numel() + 4 * k.numel()) * 2,
        "GB/s",
        {"separate_ops": separate},
    )


def _silu_case(tokens: int, compile_peers: bool) -> tuple:
    xs = torch.randn(tokens, 2 * INTER, device=DEV, dtype=BF16)
    return (
        "silu_and_mul",
        f"T={tokens} I={INTER}",
        lambda: silu_and_mul(xs),
        xs.numel() * 2 * 3 // 2,
        "GB/s",
        _peers(silu_and_mul_ref, compile_peers, xs),
    )


def elementwise_cases(compile_peers: bool) -> Iterator[tuple]:
    """torch.compile'd references only at 8192 tokens (each shape recompiles)."""
    for tokens in (1, 256, 8192):
        big = compile_peers and tokens == 8192
        yield _rms_case(tokens, big)
        yield _gated_case(tokens, big)
        yield from _rotary_cases(tokens, big)
        yield _qk_prologue_case(tokens)
        yield _silu_case(tokens, big)


# ---------------------------------------------- fp8 ----------------------------------------------


def _fp8_channel_peers(x, a_q, w_q, a_s, w_s, w_bf16) -> dict:
    """The per-channel fp8 GEMM's peers on the same operands: cuBLASLt (`torch._scaled_mm`), a
    bf16 GEMM (twice the weight bytes) and sglang-kernel when importable."""
    from appliance_kernels import adapters

    peers = {
        "torch._scaled_mm": lambda: adapters.fp8_scaled_mm_external(
            "torch", a_q, w_q, a_s, w_s, BF16
        ),
        "bf16 mm (not fp8)": lambda: x @ w_bf16.t(),
    }
    if has("sgl_kernel"):
        peers["sgl_kernel"] = lambda: adapters.fp8_scaled_mm_external(
            "sgl", a_q, w_q, a_s, w_s, BF16
        )
    return peers


def _fp8_gemm_case(m: int, w_q, w_s, w_bf16) -> tuple[tuple, tuple]:
    """Our Triton kernel, and the auto backend (the dispatcher), against the same peers."""
    n, k = w_q.shape
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    a_q, a_s = fp8.per_token_quant_ref(x)
    peers = _fp8_channel_peers(x, a_q, w_q, a_s, w_s, w_bf16)
    shape = f"M={m} N={n} K={k}"
    triton_case = (
        "fp8_gemm",
        shape,
        lambda: fp8.fp8_scaled_mm_triton(a_q, w_q, a_s, w_s, BF16),
        2 * m * n * k,
        "TFLOP/s",
        peers,
    )
    from appliance_kernels import backends

    auto_case = (
        f"fp8_auto[{backends.selected('fp8_gemm')}]",
        shape,
        # what per-channel fp8 linears run after quantising x (quant_methods.Fp8Channel)
        lambda: fp8.fp8_scaled_mm(a_q, w_q, a_s, w_s, BF16),
        2 * m * n * k,
        "TFLOP/s",
        {name: fn for name, fn in peers.items() if name != "bf16 mm (not fp8)"},
    )
    return triton_case, auto_case


def _fp8_block_case(m: int, w, block=(128, 128)) -> tuple:
    """The block GEMM of Qwen "-FP8" linears (activations quantised per token and 128-group)
    against the per-channel Triton GEMM at the same shape and bf16."""
    from appliance_kernels import fp8_block

    n, k = w.shape
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    a_q, a_s = fp8_block.per_token_group_quant(x, block[1])
    b_q, b_s = fp8_block.quantize_block_ref(w, block)
    c_q, c_s = fp8.per_token_quant_ref(w)
    t_q, t_s = fp8.per_token_quant_ref(x)
    w_bf16 = w.to(BF16)
    return (
        "fp8_block_gemm",
        f"M={m} N={n} K={k}",
        lambda: fp8_block.fp8_block_mm_triton(a_q, a_s, b_q, b_s, block, BF16),
        2 * m * n * k,
        "TFLOP/s",
        {
            "fp8_gemm per-channel (ours)": lambda: fp8.fp8_scaled_mm_triton(
                t_q, c_q, t_s, c_s.reshape(n), BF16
            ),
            "bf16 mm (not fp8)": lambda: x @ w_bf16.t(),
        },
    )


def _fp8_decode_case(m: int, w_q, w_s, b_q, b_s, w_bf16) -> tuple[tuple, tuple]:
    from appliance_kernels import fp8_block, fp8_splitk

    n, k = w_q.shape
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    a_q, a_s = fp8.per_token_quant_ref(x)
    g_q, g_s = fp8_block.per_token_group_quant(x, 128)
    peers = {
        "tiled triton": lambda: fp8.fp8_scaled_mm_triton(a_q, w_q, a_s, w_s, BF16),
        **_fp8_channel_peers(x, a_q, w_q, a_s, w_s, w_bf16),
    }
    shape = f"M={m} N={n} K={k}"
    channel = (
        "fp8_splitk",
        shape,
        lambda: fp8_splitk.fp8_splitk_mm(a_q, w_q, a_s, w_s, BF16),
        n * k,
        "GB/s",
        peers,
    )
    block = (
        "fp8_splitk_blk",
        shape,
        lambda: fp8_splitk.fp8_splitk_block_mm(g_q, g_s, b_q, b_s, (128, 128), BF16),
        n * k,
        "GB/s",
        {
            "tiled block triton": lambda: fp8_block.fp8_block_mm_triton(
                g_q, g_s, b_q, b_s, (128, 128), BF16
            ),
            "bf16 mm (not fp8)": lambda: x @ w_bf16.t(),
        },
    )
    return channel, block


def fp8_decode_cases(compile_peers: bool) -> Iterator[tuple]:
    """Decode-sized fp8 GEMMs as weight reads (GB/s of fp8 weight; the H200's HBM is ~4.8 TB/s):
    the split-K kernel the Triton route runs for M <= 16, per channel and block, against the
    tiled Triton kernels, cuBLASLt, sglang-kernel and a bf16 GEMM (which reads twice the bytes)."""
    from appliance_kernels import fp8_block

    for n, k in ((HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = torch.randn(n, k, device=DEV) * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        b_q, b_s = fp8_block.quantize_block_ref(w, (128, 128))
        for m in (1, 4, 16):
            yield from _fp8_decode_case(m, w_q, w_s.reshape(n), b_q, b_s, w.to(BF16))


def fp8_cases(compile_peers: bool) -> Iterator[tuple]:
    for n, k in ((HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = torch.randn(n, k, device=DEV) * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        for m in (1, 16, 64, 256, 4096):
            yield from _fp8_gemm_case(m, w_q, w_s.reshape(n), w.to(BF16))
            yield _fp8_block_case(m, w)
    for tokens in (16, 8192):
        x = torch.randn(tokens, HIDDEN, device=DEV, dtype=BF16)
        yield (
            "fp8_quant_tok",
            f"T={tokens} H={HIDDEN}",
            lambda x=x: fp8.fp8_quant(x),
            x.numel() * 3,
            "GB/s",
            {"eager_ref": lambda x=x: fp8.per_token_quant_ref(x)},
        )


# ---------------------------------------------- MoE ----------------------------------------------


def moe_cases(compile_peers: bool) -> Iterator[tuple]:
    from appliance_kernels.moe import fused_moe, fused_moe_ref, moe_route_ref

    experts, top_k, hidden, inter = 256, 8, 2048, 512  # Qwen3.5-35B-A3B
    w1 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    w1_q, w1_s = fp8.per_token_quant_ref(w1.flatten(0, 1))
    w2_q, w2_s = fp8.per_token_quant_ref(w2.flatten(0, 1))
    w1_q, w1_s = w1_q.view(w1.shape), w1_s.view(experts, 2 * inter)
    w2_q, w2_s = w2_q.view(w2.shape), w2_s.view(experts, hidden)
    for tokens in (16, 256, 4096):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        weights, ids = moe_route_ref(torch.randn(tokens, experts, device=DEV), top_k, True)
        flops = tokens * top_k * 6 * hidden * inter
        peers = {
            "torch_ref (loop over experts)": lambda x=x, w=weights, i=ids: fused_moe_ref(
                x, w1, w2, w, i
            )
        }
        yield (
            "moe_bf16",
            f"T={tokens} E={experts} k={top_k}",
            lambda x=x, w=weights, i=ids: fused_moe(x, w1, w2, w, i),
            flops,
            "TFLOP/s",
            peers,
        )
        yield (
            "moe_fp8",
            f"T={tokens} E={experts} k={top_k} per-channel",
            lambda x=x, w=weights, i=ids: fused_moe(
                x, w1_q, w2_q, w, i, w_gate_up_scale=w1_s, w_down_scale=w2_s
            ),
            flops,
            "TFLOP/s",
            {"moe_bf16 (ours)": lambda x=x, w=weights, i=ids: fused_moe(x, w1, w2, w, i)},
        )


def moe_decode_cases(compile_peers: bool) -> Iterator[tuple]:
    """Decode-size MoE of Qwen3.5-35B-A3B as a weight read (GB/s of the touched experts' bytes):
    the per-pair kernels (appliance_kernels/moe_gemv.py, what fused_moe runs for <= 16 pairs)
    against the grouped GEMMs over rows sorted by expert."""
    from appliance_kernels.moe import moe_route_ref
    from appliance_kernels.moe_gemv import fused_moe_gemv
    from appliance_kernels.moe_triton import fused_moe_grouped

    experts, top_k, hidden, inter = 256, 8, 2048, 512
    w1 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
    for tokens in (1, 2):
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        weights, ids = moe_route_ref(torch.randn(tokens, experts, device=DEV), top_k, True)
        touched = torch.unique(ids).numel()
        yield (
            "moe_gemv",
            f"T={tokens} E={experts} k={top_k} ({touched} experts)",
            lambda x=x, w=weights, i=ids: fused_moe_gemv(x, w1, w2, w, i),
            touched * 3 * hidden * inter * 2,
            "GB/s",
            {
                "grouped (sorted rows)": lambda x=x, w=weights, i=ids: fused_moe_grouped(
                    x, w1, w2, w, i
                )
            },
        )


def moe_route_cases(compile_peers: bool) -> Iterator[tuple]:
    """Routing of Qwen3.5-35B-A3B (256 experts, top 8, renormalised) at decode and prefill sizes:
    the one-kernel route (appliance_kernels/moe_route.py) against the reference's torch ops
    (softmax, topk, sum, divide). GB/s of the logits read; at decode sizes the time is launch
    overhead."""
    from appliance_kernels.moe import moe_route_ref
    from appliance_kernels.moe_route import moe_route_triton

    experts, top_k = 256, 8
    for tokens in (1, 16, 64, 2048):
        logits = torch.randn(tokens, experts, device=DEV, dtype=BF16)
        peers = {"torch ops (reference)": lambda g=logits: moe_route_ref(g, top_k, True)}
        if compile_peers:
            peers["torch.compile(reference)"] = torch.compile(
                lambda g=logits: moe_route_ref(g, top_k, True)
            )
        yield (
            "moe_route",
            f"T={tokens} E={experts} k={top_k}",
            lambda g=logits: moe_route_triton(g, top_k, True),
            logits.numel() * logits.element_size(),
            "GB/s",
            peers,
        )


# -------------------------------------------- sampling --------------------------------------------


def sampling_cases(compile_peers: bool) -> Iterator[tuple]:
    """Qwen3.5 vocabulary; greedy, temperature only, top-k 20 + top-p 0.95 (Qwen's defaults) and
    top-p alone. Peers: the torch reference (sort-based filtering, the same counter-based noise);
    for top-k rows, our kernel without the per-chunk candidates (the value search)."""
    from appliance_kernels.sampling import sample_ref
    from appliance_kernels.sampling_triton import sample_triton

    vocab = 248320
    for batch in (1, 4, 64, 256):  # 4: an MTP verify (k = 3) at batch 1
        logits = torch.randn(batch, vocab, device=DEV) * 3
        seeds = torch.arange(batch, device=DEV, dtype=torch.int64)
        offsets = torch.zeros(batch, device=DEV, dtype=torch.int64)
        for name, temp, top_k, top_p in (
            ("greedy", 0.0, 0, 1.0),
            ("T=0.7", 0.7, 0, 1.0),
            ("T=0.7 k=20 p=0.95", 0.7, 20, 0.95),
            ("T=0.7 p=0.95", 0.7, 0, 0.95),
        ):
            args = (
                logits,
                torch.full((batch,), temp, device=DEV),
                torch.full((batch,), top_k, device=DEV, dtype=torch.int64),
                torch.full((batch,), top_p, device=DEV),
                torch.zeros(batch, device=DEV),
                seeds,
                offsets,
            )
            yield (
                "sampling",
                f"B={batch} V={vocab} {name}",
                lambda a=args: sample_triton(*a),
                logits.numel() * 4,
                "GB/s",
                {"torch_ref": lambda a=args: sample_ref(*a)}
                | ({"value_search": lambda a=args: sample_triton(*a, topk_cap=0)} if top_k else {}),
            )


OPS = {
    "attention": attention_cases,
    "gdn": gdn_cases,
    "conv1d": conv_cases,
    "elementwise": elementwise_cases,
    "fp8": fp8_cases,
    "fp8_decode": fp8_decode_cases,
    "moe": moe_cases,
    "moe_decode": moe_decode_cases,
    "moe_route": moe_route_cases,
    "sampling": sampling_cases,
}
