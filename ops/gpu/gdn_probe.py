"""GPU probe of the GDN chunked prefill: per-kernel times (prep / scan / out) of the launch variants
in appliance_kernels.gdn_chunk.TUNING at Qwen3.5-27B shapes, each variant's error against the fp32
reference, and fla-core / flash-qla totals when importable. Prints one line per (shape, variant).

  python ops/gpu/gdn_probe.py [--variants base,prep8,...] [--skip norm,attention,gdn,decode]

Also the decode recurrence's tiles (gdn.RECURRENT_TILE) at batch 1 and 16, with and without the
split gated norm (`decode_sweep`).
"""

from __future__ import annotations

import argparse
import importlib.util
from functools import partial

import torch
import triton.testing

from appliance_kernels import gdn_chunk, norm
from appliance_kernels.gdn import gdn_chunked_ref
from ops.bench.bench_cases import _gdn_inputs

VARIANTS = {
    "base": {},
    "scan_bv32": {"scan_bv": 32},
    "out_bv64": {"out_bv": 64},
    "out8": {"out_warps": 8},
    "prep8": {"prep_warps": 8},
}


def kernel_times(fn, iters: int = 10) -> dict[str, float]:
    """Mean device µs per call of each Triton kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if "_gdn_" in ev.key or "chunk" in ev.key or "l2norm" in ev.key:
            total = getattr(ev, "device_time_total", None) or ev.cuda_time_total
            out[ev.key.replace("_gdn_chunk_", "").replace("_kernel", "")] = total / iters
    return out


def gated_norm_sweep() -> None:
    """The GDN output norm at 27B prefill size: launch variants against the compiled reference."""
    rows, dim = 8192 * 48, 128
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x)
    weight = torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5
    compiled = torch.compile(norm.gated_rms_norm_ref, dynamic=False)
    ref_us = triton.testing.do_bench(lambda: compiled(x, gate, weight, 1e-6)) * 1e3
    print(f"gated_norm compiled ref: {ref_us:.1f} us", flush=True)
    default = dict(norm.GATED_TUNING)
    for rows_per, warps in ((16, 4), (8, 2), (16, 2), (32, 4), (32, 8), (8, 1), (4, 1)):
        norm.GATED_TUNING.update(rows=rows_per, warps=warps)
        us = triton.testing.do_bench(lambda: norm.gated_rms_norm_triton(x, gate, weight, 1e-6))
        print(
            f"gated_norm rows={rows_per} warps={warps}: {us * 1e3:.1f} us "
            f"ratio {ref_us / (us * 1e3):.2f}",
            flush=True,
        )
    norm.GATED_TUNING.update(default)


def attention_sweep() -> None:
    """Decode / verify launch knobs of the Triton paged attention against flashinfer, 27B heads."""
    from appliance_kernels import attention
    from ops.bench.bench_cases import HEAD_DIM, _flashinfer_peer, _kv_batch

    scale = HEAD_DIM**-0.5
    default = dict(attention.ATTN_TUNING)
    for batch, q_len, kv_len in ((16, 1, 4096), (64, 4, 4096), (64, 2, 4096), (16, 4, 4096)):
        args = _kv_batch([q_len] * batch, kv_len)
        peer = _flashinfer_peer(args, scale, q_len).get("flashinfer")
        fi_us = triton.testing.do_bench(peer) * 1e3 if peer else float("nan")
        for knobs in (
            {},
            {"split_factor": 1},
            {"split_factor": 4},
            {"split_factor": 8},
            {"max_block_m": 32},
            {"max_block_m": 16},
        ):
            attention.ATTN_TUNING.clear()
            attention.ATTN_TUNING.update(default | knobs)
            try:
                fn = partial(attention.paged_attention_triton, *args, scale, max_q_len=q_len)
                us = triton.testing.do_bench(fn) * 1e3
                print(
                    f"attn B={batch} q={q_len} kv={kv_len} {knobs or 'default'}: {us:.1f} us, "
                    f"flashinfer {fi_us:.1f} us, ratio {fi_us / us:.2f}",
                    flush=True,
                )
            except Exception as exc:
                print(f"attn B={batch} q={q_len} {knobs}: FAILED {exc}"[:300], flush=True)
        del args
    attention.ATTN_TUNING.clear()
    attention.ATTN_TUNING.update(default)


DECODE_TILES = (None, (16, 4), (16, 2), (8, 2), (8, 1), (32, 8))  # gdn.RECURRENT_TILE (BV, warps)


def decode_sweep(batches=(1, 16)) -> None:
    """The decode recurrence at 27B shapes (16 key / 48 value heads of 128), one row a request,
    gates computed inside, with and without the split gated norm: µs a launch (CUDA graph replay)
    per gdn.RECURRENT_TILE, against the state's read + write at the copy bandwidth."""
    from appliance_kernels import gdn as gdn_kernels
    from appliance_kernels.gdn_gate import RawGates
    from appliance_kernels.head_norm import GateNorm

    dev, bf16 = "cuda", torch.bfloat16
    buf = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    copy_us = triton.testing.do_bench_cudagraph(lambda: buf[: 1 << 27].copy_(buf[1 << 27 :]))
    bandwidth = 2 * (1 << 27) / (copy_us * 1e-3)  # bytes / s, read + write
    for batch in batches:
        q, k = (torch.randn(batch, 16, 128, device=dev, dtype=bf16) for _ in range(2))
        v = torch.randn(batch, 48, 128, device=dev, dtype=bf16)
        a, b = (torch.randn(batch, 48, device=dev, dtype=bf16) for _ in range(2))
        gates = RawGates(
            a, b, torch.rand(48, device=dev).log().to(bf16), torch.zeros(48, device=dev)
        )
        pool = torch.randn(batch + 1, 48, 128, 128, device=dev) * 0.1
        slots = torch.arange(1, batch + 1, device=dev)
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        init = torch.ones(batch, dtype=torch.bool, device=dev)
        gate = GateNorm(
            torch.randn(batch, 48, 128, device=dev, dtype=bf16),
            torch.ones(128, device=dev, dtype=bf16),
            1e-6,
        )
        floor_us = 2 * batch * 48 * 128 * 128 * 4 / bandwidth * 1e6
        default = gdn_kernels.RECURRENT_TILE
        for tile in DECODE_TILES:
            gdn_kernels.RECURRENT_TILE = None if tile is None else {"bv": tile[0], "warps": tile[1]}
            for norm_in in (None, gate):
                run = partial(
                    gdn_kernels.gdn_recurrent_triton,
                    q,
                    k,
                    v,
                    None,
                    None,
                    pool,
                    slots,
                    cu,
                    init,
                    gates=gates,
                    gate_norm=norm_in,
                )
                try:
                    us = triton.testing.do_bench_cudagraph(run) * 1e3
                    print(
                        f"gdn decode B={batch} tile {tile or 'default'} "
                        f"{'split norm' if norm_in else 'plain'}: {us:.2f} us "
                        f"(state floor {floor_us:.2f} us, {us / floor_us:.2f}x)",
                        flush=True,
                    )
                except Exception as exc:
                    print(f"gdn decode B={batch} tile {tile}: FAILED {exc}"[:300], flush=True)
        gdn_kernels.RECURRENT_TILE = default


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--skip", default="", help="comma-separated: norm,attention,gdn,decode")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    if "decode" not in skip:
        decode_sweep()
    if "norm" not in skip:
        gated_norm_sweep()
    if "attention" not in skip:
        attention_sweep()
    if "gdn" in skip:
        return 0
    default = dict(gdn_chunk.TUNING)
    for lens in ([8192], [1024] * 8):
        q, k, v, g, beta, pool, slots, cu, init = _gdn_inputs(lens)
        ref_pool = pool.clone()
        ref = gdn_chunked_ref(q, k, v, g, beta, ref_pool, slots, cu, init)
        scale = ref.float().abs().max().item()
        name = f"{len(lens)}x{lens[0]}"
        for variant in args.variants.split(","):
            gdn_chunk.TUNING.clear()
            gdn_chunk.TUNING.update(default | VARIANTS[variant])
            work = pool.clone()
            run = partial(gdn_chunk.gdn_chunked_triton, q, k, v, g, beta, work, slots, cu, init)

            try:
                out = run()
                err = (out.float() - ref.float()).abs().max().item() / scale
                work.copy_(pool)
                total = triton.testing.do_bench(run, warmup=5, rep=50)
                parts = kernel_times(run)
                parts_s = " ".join(f"{key}={val:.1f}" for key, val in sorted(parts.items()))
                print(
                    f"gdn {name} {variant}: total {total * 1e3:.1f} us | {parts_s} | "
                    f"rel err {err:.2e}",
                    flush=True,
                )
            except Exception as exc:  # a variant that fails is reported, not fatal
                print(f"gdn {name} {variant}: FAILED {type(exc).__name__}: {exc}", flush=True)
        gdn_chunk.TUNING.clear()
        gdn_chunk.TUNING.update(default)
        peers = {}
        if importlib.util.find_spec("fla") is not None:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            peers["fla"] = chunk_gated_delta_rule
        if importlib.util.find_spec("flash_qla") is not None:
            import flash_qla

            peers["flashqla"] = flash_qla.chunk_gated_delta_rule
        qn = torch.nn.functional.normalize(q.float(), dim=-1, eps=1e-6).to(q.dtype)
        kn = torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-6).to(k.dtype)
        cu64 = cu.long()
        for peer, fn in peers.items():
            run_peer = partial(
                fn,
                qn[None],
                kn[None],
                v[None],
                g=g[None],
                beta=beta[None],
                initial_state=pool[: len(lens)],
                output_final_state=True,
                cu_seqlens=cu64,
            )

            try:
                o, _ = run_peer()
                err = (o[0].float() - ref.float()).abs().max().item() / scale
                total = triton.testing.do_bench(run_peer, warmup=5, rep=50)
                print(f"gdn {name} peer {peer}: total {total * 1e3:.1f} us | rel err {err:.2e}")
            except Exception as exc:
                print(f"gdn {name} peer {peer}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
