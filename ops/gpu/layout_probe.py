"""Whether the one-row fp8 GEMV reads faster from a weight stored in its tiles' order: at the 27B
projections, a minimal GEMV (the production kernel's K loop, no epilogues) over the [N, K]
row-major weight, where each program's K step reads BLOCK_N runs of BLOCK_K bytes, against the
same weight stored as [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K], where it reads one contiguous
run of BLOCK_N x BLOCK_K bytes and a program's whole share is contiguous. Timed as
appliance_kernels' GEMVs are in ops/gpu/gemv_probe.py (a CUDA graph of 40 launches over weight
copies larger than L2, PDL off); the production kernel at its default tile for reference.

  python3 ops/gpu/layout_probe.py [--shapes out_proj ...] [--tiles 8,512,4,4 ...]
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

from appliance_kernels import fp8  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv, gemv_config  # noqa: E402

L2_BYTES = 256 << 20


@triton.jit
def _probe_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    k_size,
    BLOCKED: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    base = w_ptr + pid.to(tl.int64) * BLOCK_N * k_size
    if BLOCKED:  # [N / BN, K / BK, BN, BK]: K step k0 starts at k0 * BN within the program's share
        rows = base + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + rk[None, :]
        step = BLOCK_N
    else:
        rows = base + tl.arange(0, BLOCK_N)[:, None] * k_size + rk[None, :]
        step = 1
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_size, BLOCK_K, num_stages=STAGES):
        w = tl.load(rows + k0 * step)
        x = tl.load(x_ptr + k0 + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + rn)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


def blocked(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous()


def probe(x, w, s, out, bn, bk, warps, stages, is_blocked):
    n, k = out.numel(), x.numel()
    return lambda: _probe_kernel[(n // bn,)](
        x, w, s, out, k, BLOCKED=is_blocked, STAGES=stages, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument(
        "--tiles", nargs="+", default=["8,512,4,4", "16,512,4,3", "8,256,4,4", "32,256,4,4"]
    )
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name in [s for s in SHAPES if any(want in s for want in args.shapes)]:
        n, k = SHAPES[name]
        copies = max(2, L2_BYTES // (n * k))
        w = torch.randn(n, k, device="cuda") * 0.05
        w_q, w_s = fp8.per_token_quant_ref(w)
        del w
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        s = w_s.float().reshape(-1)
        ref = (x.float() @ w_q.float().T) * s
        floor = n * k / bw * 1e6
        ws = [w_q.clone() for _ in range(copies)]
        cfg = gemv_config(n, k)
        t = graph_time_us([partial(fp8_gemv, x, w, s, None, cfg) for w in ws])
        print(f"{name} ({n} x {k}), floor {floor:.1f} µs; production {cfg}: {t:.1f} µs")
        for spec in args.tiles:
            bn, bk, warps, stages = (int(v) for v in spec.split(","))
            if n % bn or k % bk:
                continue
            row = []
            for is_blocked in (False, True):
                cand = [blocked(w, bn, bk) if is_blocked else w for w in ws]
                probe(x, cand[0], s, out, bn, bk, warps, stages, is_blocked)()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, f"{name} {spec} blocked={is_blocked}: rel err {err:.3g}"
                fns = [probe(x, c, s, out, bn, bk, warps, stages, is_blocked) for c in cand]
                row.append(graph_time_us(fns))
                del cand
            print(
                f"  {spec:>12}: row-major {row[0]:6.1f} µs ({n * k / row[0] / 1e6:.2f} TB/s)"
                f"  blocked {row[1]:6.1f} µs ({n * k / row[1] / 1e6:.2f} TB/s)"
                f"  {row[0] / row[1]:.3f}x"
            )
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
