"""fp8 KV cache benchmark: decode attention over an fp8 e4m3 KV cache against the same cache in
bf16, in one run, at Qwen3.5-27B heads (24 q / 4 kv heads, head_dim 256): median µs, the KV bytes
read per second, the fp8 output's error against bf16, and the ratio bf16 µs / fp8 µs (the issue's
goal: >= 1.6x at 8k and 32k context).

GPU (the H200 figures of docs/benchmarks.md; about a minute, most of it Triton compiling):
    PYTHONPATH=. python ops/bench/bench_kv_fp8.py --contexts 8192,32768 --batches 1,16,64
adds flashinfer's decode wrapper (both dtypes) when it imports; `--backends triton` leaves it out.
On the GPU the Triton decode is timed the way a decode step runs it: REPS calls replayed as one
CUDA graph, cycling over copies of the cache that together exceed L2 several times (a batch-1 8k
cache, 17-34 MB, would otherwise be read from L2, and timing single launches from Python measured
the host's launch cost, 40-120 µs, instead of the kernels' few µs). flashinfer's wrapper plans on
the host at each call, so it keeps event timing (`--reps` ms a case) over one copy.
CPU smoke (the torch reference, tiny shapes; checks the script and the fp8 plumbing):
    PYTHONPATH=. python ops/bench/bench_kv_fp8.py --device cpu --contexts 64 --batches 2 \
        --heads 4,2,32
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import appliance_kernels.attention as attn
from appliance_kernels.attention import paged_attention_ref, paged_attention_triton
from appliance_kernels.fp8 import FP8_MAX
from appliance_kernels.kv_cache import quantize_kv_ref


@dataclass(frozen=True)
class Case:
    batch: int
    context: int
    heads: tuple[int, int, int]  # q heads, kv heads, head_dim
    # "scattered": every token at a random slot of the pool (the worst case: one 256-512 byte
    # row per key and head); "contiguous": each request's tokens at consecutive slots, as the
    # router's LIFO allocator hands out a prompt's slots (appliance/router/allocators.py)
    layout: str = "scattered"


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    """One decode row per request over `context` cached tokens at scattered slots; the bf16 cache,
    its e4m3 copy with per-tensor scales calibrated as amax / 448, and the [1] fp32 scales."""
    hq, hkv, dim = case.heads
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = case.batch * case.context
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k = torch.randn(slots, hkv, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(slots, hkv, dim, device=device, dtype=dtype, generator=gen)
    if case.layout == "scattered":
        perm = torch.randperm(slots, device=device, generator=gen)
    else:
        perm = torch.arange(slots, device=device)
    scales = [(t.float().abs().amax() / FP8_MAX).reshape(1) for t in (k, v)]
    return {
        "q": torch.randn(case.batch, hq, dim, device=device, dtype=dtype, generator=gen),
        "cache": (k, v),
        "fp8": tuple(quantize_kv_ref(t, s) for t, s in zip((k, v), scales)),
        "scales": scales,
        "meta": (
            perm.int().view(case.batch, case.context),  # req_to_token
            torch.arange(case.batch, device=device, dtype=torch.int32),  # req_slots
            torch.arange(case.batch + 1, device=device, dtype=torch.int32),  # cu_seqlens_q
            torch.full((case.batch,), case.context, device=device, dtype=torch.int32),
        ),
    }


def runners(inputs: dict, backends: list[str], device: torch.device) -> dict[str, Callable]:
    """name -> zero-argument call, for each backend x (bf16, fp8)."""
    q, meta, (k_scale, v_scale) = inputs["q"], inputs["meta"], inputs["scales"]
    sm_scale = q.shape[-1] ** -0.5
    out: dict[str, Callable] = {}
    for backend in backends:
        for kv in ("bf16", "fp8"):
            caches = inputs["cache"] if kv == "bf16" else inputs["fp8"]
            scales = (k_scale, v_scale) if kv == "fp8" else (None, None)
            if backend == "triton":

                def call(caches=caches, scales=scales):
                    return paged_attention_triton(
                        q,
                        *caches,
                        *meta,
                        sm_scale,
                        max_q_len=1,
                        k_scale=scales[0],
                        v_scale=scales[1],
                    )
            elif backend == "flashinfer":
                from appliance_kernels.adapters import paged_attention_flashinfer

                host = (float(k_scale), float(v_scale)) if kv == "fp8" else None

                def call(caches=caches, host=host):
                    return paged_attention_flashinfer(
                        q, *caches, *meta, sm_scale, max_q_len=1, kv_scales=host
                    )
            else:  # torch reference (CPU smoke)

                def call(caches=caches, scales=scales):
                    return paged_attention_ref(q, *caches, *meta, sm_scale, *scales)

            out[f"{backend}/{kv}"] = call
    return out


def cache_copies(case: Case, device: torch.device) -> int:
    """How many independent caches the graph timing cycles over: enough that their fp8 bytes
    exceed L2_BYTES (1 on CPU, where nothing is graph-timed)."""
    if device.type != "cuda":
        return 1
    from ops.bench.bench_fp8_gemv import L2_BYTES

    hq, hkv, dim = case.heads
    fp8_bytes = case.batch * case.context * hkv * dim * 2
    return max(1, min(16, -(-L2_BYTES // fp8_bytes)))


def time_calls(fns: list[Callable], device: torch.device, reps: int, backend: str) -> float:
    """µs of one call: a CUDA graph cycling over fns (one per cache copy) for the Triton decode on
    the GPU, else time_us of the first."""
    if device.type == "cuda" and backend == "triton":
        from ops.bench.bench_fp8_gemv import graph_time_us

        return graph_time_us(fns)
    return time_us(fns[0], device, reps)


def time_us(fn: Callable, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e3
    times = []
    for _ in range(max(3, reps // 10)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bench_case(case: Case, backends: list[str], device: torch.device, reps: int) -> list[str]:
    copies = [make_inputs(case, device, seed) for seed in range(cache_copies(case, device))]
    calls = [runners(inputs, backends, device) for inputs in copies]
    hq, hkv, dim = case.heads
    tokens = case.batch * case.context * hkv * dim * 2  # k and v elements read
    lines = []
    for backend in backends:
        try:
            ref = calls[0][f"{backend}/bf16"]()
            got = calls[0][f"{backend}/fp8"]()
        except Exception as exc:  # one backend failing leaves the others' figures
            print(f"| {backend} | {case.layout} | {case.batch} | {case.context} | failed: {exc!r}")
            continue
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        us = {
            kv: time_calls([c[f"{backend}/{kv}"] for c in calls], device, reps, backend)
            for kv in ("bf16", "fp8")
        }
        width = copies[0]["cache"][0].element_size()
        gbs = {kv: tokens * (width if kv == "bf16" else 1) / (us[kv] * 1e3) for kv in us}
        ratio = us["bf16"] / us["fp8"]
        line = (
            f"| {backend} | {case.layout} | {case.batch} | {case.context} | {us['bf16']:.1f} "
            f"| {gbs['bf16']:.0f} "
            f"| {us['fp8']:.1f} | {gbs['fp8']:.0f} | **{ratio:.2f}x** | {err:.4f} |"
        )
        print(line, flush=True)
        lines.append(line)
    del copies, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return lines


FP8_TILES = [  # (BLOCK_N, num_stages, num_warps[, maxnreg]) of the Triton decode over an fp8 cache
    (64, 3, 4),  # run AG's default: one K / V buffer (see ATTN_TUNING)
    (64, 5, 4),  # the default (run DK): two buffers, the next tile in flight during the dots
    (64, 5, 8),
    (32, 5, 4),
    (32, 7, 4),  # three buffers of 32 keys
]
SPLIT_KEYS = ("split_factor", "fp8_split_factor")  # the bf16 and the fp8 decode's
# ATTN_TUNING["fp8_split_factor"] values each tile is timed at (--sweep-splits)
FP8_SPLIT_FACTORS = (1, 2, 4)
# ATTN_TUNING["tile"]: the bf16 decode's tiles beside its default, so that bf16 / fp8 compares the
# best of each
BF16_TILES = [(64, 5, 4), (32, 5, 4), (32, 7, 4)]


_SEEN_KERNELS: set = set()


def print_compiled(device: torch.device) -> None:
    """Registers, spills and shared memory of each decode kernel Triton built since the last
    call (what the sweep's variants compiled to on this GPU)."""
    caches = getattr(attn._paged_attention_kernel, "device_caches", {})
    for launchers in (entry[0] for entry in caches.values()):
        for kernel in launchers.values():
            if id(kernel) in _SEEN_KERNELS or not hasattr(kernel, "n_regs"):
                continue
            _SEEN_KERNELS.add(id(kernel))
            consts = getattr(kernel, "src", None)
            consts = getattr(consts, "constants", {}) if consts is not None else {}
            named = {
                n: v
                for (i,), v in consts.items()
                if (n := attn._paged_attention_kernel.arg_names[i]) in _SHOWN
            }
            meta = kernel.metadata
            print(
                f"    compiled {named} warps {meta.num_warps} stages {meta.num_stages}: "
                f"{kernel.n_regs} registers, {kernel.n_spills} spills, {meta.shared} B shared"
            )


_SHOWN = ("BLOCK_M", "BLOCK_N", "NUM_SPLITS", "FP8_KV", "V_PAIRS")


def sweep_fp8_tiles(
    case: Case,
    device: torch.device,
    reps: int,
    split_factors=FP8_SPLIT_FACTORS,
    max_splits=(),
) -> None:
    """The Triton fp8 decode at each FP8_TILES entry
    (appliance_kernels.attention.ATTN_TUNING["fp8_tile"]) and the bf16 decode at its own tiles: one
    line of µs, fp8 GB/s and bf16 / fp8 per tile, then what each variant compiled to."""
    copies = [make_inputs(case, device, seed) for seed in range(cache_copies(case, device))]
    calls = [runners(inputs, ["triton"], device) for inputs in copies]

    def timed_us(kv: str, calls=calls) -> float:  # captures the ATTN_TUNING set at the call
        return time_calls([c[f"triton/{kv}"] for c in calls], device, reps, "triton")

    hq, hkv, dim = case.heads
    fp8_bytes = case.batch * case.context * hkv * dim * 2
    bf16_us = timed_us("bf16")
    timed, default = [], attn.ATTN_TUNING["fp8_tile"]
    factor, pairs = attn.ATTN_TUNING["fp8_split_factor"], attn.ATTN_TUNING["fp8_v_pairs"]
    variants = [(tile, f, pairs) for f in split_factors for tile in FP8_TILES]
    variants += [(default, factor, not pairs)]  # V read as column pairs or byte by byte
    for tile, f, v_pairs in variants:
        attn.ATTN_TUNING["fp8_tile"], attn.ATTN_TUNING["fp8_split_factor"] = tile, f
        attn.ATTN_TUNING["fp8_v_pairs"] = v_pairs
        name = f"{tile}" + (f" split x{f}" if f != factor else "")
        name += f" v_pairs {v_pairs}" if v_pairs != pairs else ""
        try:
            us = timed_us("fp8")
            timed.append(f"{name}: {us:.1f} µs {fp8_bytes / us / 1e3:.0f} GB/s {bf16_us / us:.2f}x")
        except Exception as exc:  # a tile Triton cannot build here: named, skipped
            timed.append(f"{name}: {type(exc).__name__}")
    attn.ATTN_TUNING["fp8_tile"], attn.ATTN_TUNING["fp8_split_factor"] = default, factor
    attn.ATTN_TUNING["fp8_v_pairs"] = pairs
    bf16_factor = attn.ATTN_TUNING["split_factor"]
    for f in (2, 4):  # the bf16 decode split further too: the fair comparison
        attn.ATTN_TUNING["split_factor"] = f
        timed.append(f"bf16 split x{f}: {timed_us('bf16'):.1f} µs")
    attn.ATTN_TUNING["split_factor"] = bf16_factor
    bf16_tile = attn.ATTN_TUNING["tile"]
    for tile in BF16_TILES:
        attn.ATTN_TUNING["tile"] = tile
        try:
            us = timed_us("bf16")
            timed.append(f"bf16 {tile}: {us:.1f} µs {2 * fp8_bytes / us / 1e3:.0f} GB/s")
        except Exception as exc:
            timed.append(f"bf16 {tile}: {type(exc).__name__}")
    attn.ATTN_TUNING["tile"] = bf16_tile
    saved = {key: attn.ATTN_TUNING[key] for key in ("max_splits", *SPLIT_KEYS)}
    # more KV splits where the cap binds (batch 1), both dtypes: the cap alone changes nothing
    # once the split factor's programs (factor x SMs) are reached, so each cap is timed at
    # factors 1, 2 and 4 (batch 1 x 4 kv heads on 132 SMs: 64 splits at factor 1, 128 at 2 ...)
    for m, f in itertools.product(max_splits, (1, 2, 4)):
        attn.ATTN_TUNING.update(dict.fromkeys(SPLIT_KEYS, f), max_splits=m)
        us = {kv: timed_us(kv) for kv in ("bf16", "fp8")}
        timed.append(
            f"max_splits {m} split x{f}: bf16 {us['bf16']:.1f} µs, fp8 {us['fp8']:.1f} µs "
            f"{us['bf16'] / us['fp8']:.2f}x"
        )
    attn.ATTN_TUNING.update(saved)
    print_compiled(device)
    print(
        f"  sweep {case.layout} b{case.batch} ctx{case.context} bf16 {bf16_us:.1f} µs | "
        + " | ".join(timed)
    )
    del copies, calls, timed_us
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="8192,32768", help="KV tokens per request")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--heads", default="24,4,256", help="q heads, kv heads, head_dim")
    parser.add_argument("--backends", default="auto", help="triton,flashinfer | auto")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu (reference smoke)")
    parser.add_argument("--reps", type=int, default=100, help="timing budget per call (ms on GPU)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument(
        "--layouts",
        default="scattered,contiguous",
        help="KV slot layouts (scattered: random slots; contiguous: a request's slots in a run)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time the fp8 decode over FP8_TILES"
    )
    parser.add_argument(
        "--sweep-splits",
        default=",".join(map(str, FP8_SPLIT_FACTORS)),
        help="fp8_split_factor values the sweep times each tile at",
    )
    parser.add_argument(
        "--max-splits",
        default="",
        help="ATTN_TUNING['max_splits'] values the sweep also times both dtypes at, e.g. 64,128",
    )
    args = parser.parse_args(argv)
    split_factors = [int(x) for x in args.sweep_splits.split(",")]
    max_splits = [int(x) for x in args.max_splits.split(",") if x]
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cuda":
        backends = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
        if args.backends != "auto":
            backends = args.backends.split(",")
    else:
        backends = ["torch"]
    heads = tuple(int(x) for x in args.heads.split(","))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, heads (q, kv, dim) {heads}", flush=True)
    if device.type == "cuda":  # clocks up before the first (short, batch-1) case is timed
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    lines = [
        "| backend | layout | batch | context | bf16 µs | bf16 GB/s | fp8 µs | fp8 GB/s | bf16/fp8 "
        "| fp8 rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for layout in args.layouts.split(","):
        for context in (int(x) for x in args.contexts.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                case = Case(batch, context, heads, layout)
                lines += bench_case(case, backends, device, args.reps)
                if args.sweep and device.type == "cuda":
                    sweep_fp8_tiles(case, device, args.reps, split_factors, max_splits)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
