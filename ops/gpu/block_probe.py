"""How the one-row block-fp8 GEMV (fp8_gemv_block) applies its 128 x 128 blocks' scales: minimal
K loops (no epilogues) against the production kernel at its default tile, at the 27B
projections. Run DH (docs/benchmarks.md) found the [BLOCK_N, G, 128] tile the kernel had used
10-20 % slower than per channel at down and out_proj, and the reshape form as fast as per
channel; the kernel has used the reshape form since. All scale the activations, not the weight
(a program's rows share one row of scales):

  3d       the form before run DH: the tile as [BLOCK_N, G, 128], G scales a step, one vector load
  gather   a [BLOCK_N, BLOCK_K] tile as per channel; the scales gathered per column (k // 128)
  reshape  a [BLOCK_N, BLOCK_K] tile; x loaded as [G, 128], scaled, laid out flat (the kernel's)
  step128  BLOCK_K = 128: one scalar scale a K step (more stages keep the bytes in flight)

Timed as ops/gpu/gemv_probe.py times (a CUDA graph of 40 launches over weight copies larger than
L2, PDL off).

  python3 ops/gpu/block_probe.py [--shapes down out_proj ...] [--tiles 8,512,4,4 ...]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from bench_fp8_gemv import SHAPES, copy_bandwidth, graph_time_us  # noqa: E402

from appliance_kernels.fp8_block import quantize_block_ref  # noqa: E402
from appliance_kernels.fp8_gemv import block_gemv_config, fp8_gemv_block  # noqa: E402

L2_BYTES = 256 << 20
FORMS = {"3d": 0, "gather": 1, "reshape": 2, "step128": 3}


@triton.jit
def _block_probe_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    k_size,
    stride_sn,
    FORM: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    SCALE_K: tl.constexpr = 128
    G: tl.constexpr = BLOCK_K // SCALE_K
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    s_row = s_ptr + (pid * BLOCK_N // 128) * stride_sn
    rows = w_ptr + rn.to(tl.int64)[:, None] * k_size
    if FORM == 0:
        rg = tl.arange(0, G)
        kk = rg[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]
        acc3 = tl.zeros([BLOCK_N, G, SCALE_K], dtype=tl.float32)
        for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
            w = tl.load(rows[:, :, None] + (k0 + kk)[None, :, :])
            sv = tl.load(s_row + k0 // SCALE_K + rg)
            xs = tl.load(x_ptr + k0 + kk).to(tl.float32) * sv[:, None]
            acc3 += w.to(tl.float32) * xs[None, :, :]
        out = tl.sum(tl.sum(acc3, axis=2), axis=1)
    else:
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
            w = tl.load(rows + (k0 + rk)[None, :])
            if FORM == 1:
                sv = tl.load(s_row + (k0 + rk) // SCALE_K)
                xs = tl.load(x_ptr + k0 + rk).to(tl.float32) * sv
            elif FORM == 2:
                rg = tl.arange(0, G)
                kk = rg[:, None] * SCALE_K + tl.arange(0, SCALE_K)[None, :]
                sv = tl.load(s_row + k0 // SCALE_K + rg)
                x2 = tl.load(x_ptr + k0 + kk).to(tl.float32) * sv[:, None]
                xs = tl.reshape(x2, [BLOCK_K])
            else:
                xs = tl.load(x_ptr + k0 + rk).to(tl.float32) * tl.load(s_row + k0 // SCALE_K)
            acc += w.to(tl.float32) * xs[None, :]
        out = tl.sum(acc, axis=1)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


def probe(x, w, s, out, form, bn, bk, warps, stages):
    n, k = out.numel(), x.numel()
    return lambda: _block_probe_kernel[(n // bn,)](
        x, w, s, out, k, s.stride(0), FORM=form, STAGES=stages, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--tiles", nargs="+", default=["8,512,4,4", "16,512,4,3", "32,256,4,4"])
    p.add_argument("--step128", nargs="+", default=["32,128,4,6", "16,128,4,8", "64,128,4,4"])
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in [s for s in SHAPES if any(want in s for want in args.shapes)]:
        n, k = SHAPES[name]
        copies = max(2, L2_BYTES // (n * k))
        w = torch.randn(n, k, device="cuda") * 0.05
        w_q, w_s = quantize_block_ref(w, (128, 128))
        del w
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        s = w_s.float().contiguous()
        deq = w_q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        ref = x.float() @ deq.T
        del deq
        floor = n * k / bw * 1e6
        ws = [w_q.clone() for _ in range(copies)]
        cfg = block_gemv_config(n, k)
        t = graph_time_us([partial(fp8_gemv_block, x, w, s, (128, 128), None, cfg) for w in ws])
        print(f"{name} ({n} x {k}), floor {floor:.1f} µs; production {cfg}: {t:.1f} µs")
        runs = [(f, spec) for spec in args.tiles for f in ("3d", "gather", "reshape")]
        runs += [("step128", spec) for spec in args.step128]
        for form, spec in runs:
            bn, bk, warps, stages = (int(v) for v in spec.split(","))
            if n % bn or k % bk or bn > 128:
                continue
            probe(x, ws[0], s, out, FORMS[form], bn, bk, warps, stages)()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{name} {form} {spec}: rel err {err:.3g}"
            t = graph_time_us([probe(x, c, s, out, FORMS[form], bn, bk, warps, stages) for c in ws])
            print(f"  {form:>8} {spec:>12}: {t:6.1f} µs ({n * k / t / 1e6:.2f} TB/s)")
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
