"""Can a chain of one-row fp8 GEMVs keep HBM busy across its launches? Times the served Triton
GEMV (`appliance_kernels.fp8_gemv`, with `triton_utils.GEMV_PDL` wait / full / off) against
`prefetch_gemv.cu` beside this file: one program per SM streaming its rows through a ring of
shared-memory stages with the bulk copy engine, its first copies issued before the PDL wait and
the next kernel let launch as it starts, so that a GEMV's weight is in flight while the kernel
before it finishes. Mode 4 keeps the copies and drops the arithmetic: what the ring could give
with a free consumer (an upper bound, wrong outputs). Needs nvcc (sm_90). Runs DT-EJ in
docs/benchmarks.md ("Session 2026-12-05 (sixth)"): the ring without arithmetic takes the 27B
chain 0.45-0.65 ms under the served GEMVs on an H100, 0.11-0.39 ms on an H200 (the larger figures
with 7 µs of idle before each out_proj / o_proj); with its arithmetic on the tensor cores
(WARPS 0 or -16 in --tiles) it ties them, with the scalar one (e4m3 -> f16 -> f32, FFMA) it loses;
the 256 GEMVs in one persistent launch (--one-launch, run EJ) tie them too. Fed by cp.async from
the threads instead of a copying warp (--one-launch-ldg, --one-launch-cta; runs EK-EN, "Session
2026-12-05 (seventh)") it is slower: its 256 grid-wide waits cost what 256 launches do (--dealt:
chunks dealt round the grid; --no-wait: those waits skipped, computing or copies only, a bound).

  python3 ops/gpu/prefetch_gemv_probe.py [--tiles 16,1024,8 32,1024,8] [--ring 147456]
      [--modes 0 3 7] [--triton-pdl wait full off] [--gaps-ns 0 7000] [--layers 64]
      [--skip-shapes]

Checks every computing variant against a float reference first (27B shapes and ragged ones),
then times each 27B projection alone (40 launches in one CUDA graph over weight copies larger
than L2), one 1.3 GB read (the read rate itself), and the 27B step's chain of GEMVs (48 GDN
in_proj / out_proj, 16 attention qkv / o_proj, 64 MLPs with their SiLU-and-mul) as one CUDA
graph, against its bytes at copy bandwidth; with --gaps-ns, a kernel spinning that long stands
for the small kernels before each out_proj / o_proj.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from bench_fp8_gemv import SHAPES, copy_bandwidth, graph_time_us  # noqa: E402

from appliance_kernels import triton_utils as tu  # noqa: E402
from appliance_kernels.activation import silu_and_mul  # noqa: E402
from appliance_kernels.fp8_gemv import fp8_gemv  # noqa: E402

SOURCE = Path(__file__).with_name("prefetch_gemv.cu")
L2_BYTES = 256 << 20
MODES = {0: "no early launch", 1: "next launches at start", 2: "copies before wait", 3: "both"}
# mode | 4: the copies alone, no arithmetic (wrong outputs): the ring's own rate


def build() -> ctypes.CDLL:
    from torch.utils.cpp_extension import CUDA_HOME  # torch's own search for the toolkit

    nvcc = shutil.which("nvcc") or str(Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc")
    lib = Path(tempfile.mkdtemp()) / "prefetch_gemv.so"
    flags = ["-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC"]
    subprocess.run([nvcc, *flags, "-o", str(lib), str(SOURCE)], check=True)
    so = ctypes.CDLL(str(lib))
    so.prefetch_gemv_launch.restype = ctypes.c_int
    ints, ptrs = [ctypes.c_int] * 8, [ctypes.c_void_p] * 4
    so.prefetch_gemv_launch.argtypes = [*ptrs, *ints, ctypes.c_void_p]
    so.prefetch_gemv_mma_launch.restype = ctypes.c_int
    so.prefetch_gemv_mma_launch.argtypes = [*ptrs, *[ctypes.c_int] * 7, ctypes.c_void_p]
    so.chain_gemv_launch.restype = ctypes.c_int
    so.chain_gemv_launch.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 5, ctypes.c_void_p
    ]  # fmt: skip
    so.chain_ldg_launch.restype = ctypes.c_int
    so.chain_ldg_launch.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p
    ]  # fmt: skip
    so.chain_cta_launch.restype = ctypes.c_int
    so.chain_cta_launch.argtypes = so.chain_ldg_launch.argtypes
    so.spin_launch.restype = ctypes.c_int
    so.spin_launch.argtypes = [ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    return so


class PrefetchGemv:
    def __init__(self, so: ctypes.CDLL, ring: int, mode: int, grid: int, tile: tuple[int, ...]):
        self.so, self.ring, self.mode, self.grid, self.tile = so, ring, mode, grid, tile

    def __call__(self, x, w, s, out):
        n, k = w.shape
        ptrs = (w.data_ptr(), s.data_ptr(), x.data_ptr(), out.data_ptr())
        rows, kc, warps = self.tile
        while k % kc and kc > 1024:  # K = 5120: 2048-byte chunks become 1024
            kc //= 2
        stream = torch.cuda.current_stream().cuda_stream
        common = (*ptrs, n, k, self.ring, self.grid, self.mode)
        if warps <= 0:  # the tensor-core form (-warps computing warps; 0: 8), 1024-byte chunks
            rc = self.so.prefetch_gemv_mma_launch(*common, rows // 16, -warps or 8, stream)
        else:
            rc = self.so.prefetch_gemv_launch(*common, rows, kc, warps, stream)
        if rc != 0:
            raise RuntimeError(f"prefetch_gemv_launch N={n} K={k}: error {rc}")
        return out

    def __str__(self) -> str:
        mode = MODES[self.mode & 3] + (", copies only" if self.mode & 4 else "")
        rows, kc, warps = self.tile
        form = f"{warps} warps" if warps > 0 else f"{-warps or 8} warps on the tensor cores"
        return f"cuda {rows} x {kc} B x {form}, ring {self.ring >> 10} KiB, {mode}"


def quantized(n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.05
    s = w.abs().amax(dim=1).clamp(min=1e-6) / 448.0
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.float()


def random_fp8(n: int, k: int) -> torch.Tensor:
    """Finite e4m3 bit patterns (no 0x7f / 0xff), fast at 27B sizes: timing only."""
    bits = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, device="cuda")
    sign = torch.randint(0, 2, (n, k), dtype=torch.uint8, device="cuda") << 7
    return (bits | sign).view(torch.float8_e4m3fn)


def check(variants) -> bool:
    ok = True
    shapes = list(SHAPES.values()) + [(1000, 4096), (77, 1024), (4099, 2048), (300, 3072)]
    for n, k in shapes:
        w, s = quantized(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = (x.double() @ (w.double() * s.double()[:, None]).T).float()
        for v in variants:
            out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            v(x, w, s, out)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            good = err < 1e-2 and not out.isnan().any().item()
            ok &= good
            if not good:
                print(f"  MISMATCH N={n} K={k} {v}: rel err {err:.2e}")
    print("check:", "every variant matches the reference" if ok else "FAILED")
    return ok


class TritonGemv:
    """The served GEMV with triton_utils.GEMV_PDL set for its launches ("wait": as served)."""

    def __init__(self, pdl: str):
        self.pdl = pdl

    def __call__(self, x, w, s, out):
        tu.GEMV_PDL, served = self.pdl, tu.GEMV_PDL
        try:
            return fp8_gemv(x, w, s)
        finally:
            tu.GEMV_PDL = served

    def __str__(self) -> str:
        return "triton (served)" if self.pdl == "wait" else f"triton, GEMV_PDL {self.pdl}"


HUGE = {"one 1.3 GB read": (262144, 5120)}  # ramp and tail amortised: the read rate itself


def per_shape(variants, bw: float) -> None:
    for name, (n, k) in (SHAPES | HUGE).items():
        copies = [random_fp8(n, k) for _ in range(max(2, L2_BYTES // (n * k)))]
        s = torch.rand(n, device="cuda") * 1e-3
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        floor = n * k / bw * 1e6
        print(f"{name:20s} N={n} K={k} floor {floor:6.1f} us")
        for v in variants:
            us = graph_time_us([partial(v, x, w, s, out) for w in copies])
            print(f"   {us:6.1f} us {us / floor:5.2f}x  {v}")
        del copies
        torch.cuda.empty_cache()


def chain(variants, bw: float, layers: int, so: ctypes.CDLL, gap_ns: int) -> None:
    """The 27B step's GEMVs in order (attention every fourth layer), one CUDA graph each way;
    with gap_ns, a kernel that spins that long (no memory traffic) between the GDN in_proj and
    out_proj and between the attention qkv and o_proj, where the step runs its small kernels."""
    sh = SHAPES
    plan = []  # (weight, scale, x buffer, out buffer) per GEMV; "silu" between gate_up and down
    nbytes = 0
    bufs = {}

    def buf(name, n):
        if name not in bufs:
            bufs[name] = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) * 0.1
        return bufs[name]

    def gemv(shape, x_name):
        nonlocal nbytes
        n, k = sh[shape]
        nbytes += n * k
        scale = torch.rand(n, device="cuda") * 1e-3
        plan.append((random_fp8(n, k), scale, buf(x_name, k), buf(shape, n)))

    for i in range(layers):
        gemv("attn qkv (gated q)" if i % 4 == 3 else "gdn in_proj qkvz", "h")
        if gap_ns:
            plan.append("gap")
        gemv("gdn out_proj", "attn")  # o_proj: 5120 x 6144 as the GDN out_proj
        gemv("mlp gate_up", "h")
        plan.append("silu")
        gemv("mlp down", "act")  # its x: the SiLU-and-mul's output, made in the graph
    floor = nbytes / bw * 1e3
    gate_up_out = bufs["mlp gate_up"]

    def run(v):
        act = None
        for step in plan:
            if step == "silu":
                act = silu_and_mul(gate_up_out)
                continue
            if step == "gap":
                stream = torch.cuda.current_stream().cuda_stream
                if so.spin_launch(gap_ns, 48, stream) != 0:
                    raise RuntimeError("spin_launch failed")
                continue
            w, s, x, out = step
            v(act if x is bufs["act"] else x, w, s, out)

    gaps = f", {gap_ns} ns idle before each out_proj / o_proj" if gap_ns else ""
    print(f"chain of {layers} layers{gaps}: {nbytes / 1e9:.2f} GB of fp8, floor {floor:.3f} ms")
    idle = gap_ns * layers / 1e6  # ms of spinning in the chain
    for v in variants:
        ms = graph_time_us([partial(run, v)], reps=1) / 1e3
        print(f"   {ms:7.3f} ms {ms / floor:5.2f}x, less the idle {(ms - idle) / floor:5.2f}x  {v}")


class OneLaunchChain:
    """A chain of GEMVs (x of each = the first K outputs of the one before) as one persistent
    launch of chain_gemv_kernel; mode 4: its copies alone."""

    def __init__(
        self,
        so: ctypes.CDLL,
        ring: int,
        grid: int,
        mtiles: int,
        mode: int = 0,
        depth: int = 0,
        form: str = "ldg",
    ):
        """depth > 0: chain_ldg_kernel (form "ldg": each warp's own cp.async ring, depth chunks)
        or chain_cta_kernel (form "cta": depth stages filled by the whole program) instead."""
        self.so, self.ring, self.grid, self.mtiles, self.mode = so, ring, grid, mtiles, mode
        self.depth, self.form = depth, form

    def prepare(self, steps, x0):
        """steps: [(w, scale, out)] in order; x0 the first x (each out is written in place)."""
        import numpy as np

        fields = [("w", "u8"), ("s", "u8"), ("x", "u8"), ("o", "u8"), ("n", "i4"), ("k", "i4")]
        table = np.zeros(len(steps), dtype=fields)
        x = x0
        for i, (w, scale, out) in enumerate(steps):
            n, k = w.shape
            table[i] = (w.data_ptr(), scale.data_ptr(), x.data_ptr(), out.data_ptr(), n, k)
            x = out
        self.table = torch.from_numpy(table.view(np.uint8).copy()).cuda()
        self.done = torch.zeros(len(steps), dtype=torch.int32, device="cuda")
        self.count, self.kmax = len(steps), max(w.shape[1] for w, _, _ in steps)
        self.keep = (steps, x0)

    def __call__(self):
        self.done.zero_()
        stream = torch.cuda.current_stream().cuda_stream
        ptrs = (self.table.data_ptr(), self.count, self.done.data_ptr(), self.kmax)
        if self.depth:
            launch = self.so.chain_ldg_launch if self.form == "ldg" else self.so.chain_cta_launch
            rc = launch(*ptrs, self.depth, self.grid, self.mode, stream)
        else:
            rc = self.so.chain_gemv_launch(
                *ptrs, self.ring, self.grid, self.mode, self.mtiles, stream
            )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"{self}: launch error {rc}")

    def __str__(self) -> str:
        what = ", chunks dealt" if self.mode & 8 else ""
        what += ", no waits" if self.mode & 16 else ""
        what += ", copies only" if self.mode & 4 else ""
        if self.depth and self.form == "cta":
            return f"one launch, cp.async by the program, {self.depth} stages{what}"
        if self.depth:
            return f"one launch, cp.async by every warp, {self.depth} chunks deep{what}"
        return f"one launch, {16 * self.mtiles} rows, ring {self.ring >> 10} KiB{what}"


def check_chain(chain: OneLaunchChain) -> bool:
    """A four-GEMV chain against float64 GEMVs with the bf16 rounding between them."""
    shapes = [(4096, 1024), (2048, 4096), (3072, 2048), (1000, 3072)]
    steps = []
    for n, k in shapes:
        w, s = quantized(n, k)
        steps.append((w, s, torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)))
    x0 = torch.randn(1, shapes[0][1], device="cuda", dtype=torch.bfloat16)
    chain.prepare(steps, x0)
    chain()
    torch.cuda.synchronize()
    ok, x = True, x0
    for (w, s, out), (n, k) in zip(steps, shapes):
        ref = (x[:, :k].double() @ (w.double() * s.double()[:, None]).T).float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2 or out.isnan().any().item():
            print(f"  MISMATCH {chain} N={n} K={k}: rel err {err:.2e}")
            ok = False
        x = out
    print(f"check: {chain}:", "matches the reference" if ok else "FAILED")
    return ok


def one_launch_chain(chains, so, bw: float, layers: int, gemv: PrefetchGemv) -> None:
    """The 27B step's 256 GEMVs back to back (x of each = the first K outputs of the one before),
    as 256 served launches, 256 ring launches and one persistent launch."""
    order = []
    for i in range(layers):
        order += ["attn qkv (gated q)" if i % 4 == 3 else "gdn in_proj qkvz", "gdn out_proj"]
        order += ["mlp gate_up", "mlp down"]
    steps, nbytes = [], 0
    for name in order:
        n, k = SHAPES[name]
        nbytes += n * k
        scale = torch.full((n,), 1e-5, device="cuda")
        steps.append(
            (random_fp8(n, k), scale, torch.zeros(1, n, device="cuda", dtype=torch.bfloat16))
        )
    x0 = torch.randn(1, SHAPES[order[0]][1], device="cuda", dtype=torch.bfloat16)
    floor = nbytes / bw * 1e3
    print(f"{len(steps)} GEMVs back to back: {nbytes / 1e9:.2f} GB of fp8, floor {floor:.3f} ms")

    def launches(v):
        x = x0
        for w, s, out in steps:
            y = v(x[:, : w.shape[1]], w, s, out)
            x = y if y is not None else out

    for label, fn in [("triton (served)", partial(launches, TritonGemv("wait"))),
                      (str(gemv), partial(launches, gemv))]:  # fmt: skip
        ms = graph_time_us([fn], reps=1) / 1e3
        print(f"   {ms:7.3f} ms {ms / floor:5.2f}x  {label}")
    for chain in chains:
        chain.prepare(steps, x0)
        ms = graph_time_us([chain], reps=1) / 1e3
        print(f"   {ms:7.3f} ms {ms / floor:5.2f}x  {chain}")
    steps.clear()
    torch.cuda.empty_cache()
    ((name, (n, k)),) = HUGE.items()
    w, s = random_fp8(n, k), torch.full((n,), 1e-5, device="cuda")
    x, out = x0.new_zeros(1, k), torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)
    floor = n * k / bw * 1e6
    print(f"{name} as a one-GEMV chain: floor {floor:6.1f} us")  # each form's steady read rate
    us = graph_time_us([partial(TritonGemv("wait"), x, w, s, out)], reps=4)
    print(f"   {us:7.1f} us {us / floor:5.2f}x  triton (served)")
    for chain in chains:
        chain.prepare([(w, s, out)], x)
        us = graph_time_us([chain], reps=4)
        print(f"   {us:7.1f} us {us / floor:5.2f}x  {chain}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--ring", type=int, nargs="+", default=[65536])
    p.add_argument("--modes", type=int, nargs="+", default=[0, 3, 7])
    p.add_argument(
        "--tiles",
        nargs="+",
        default=["16,1024,8", "16,1024,16", "32,1024,16"],
        help="ROWS,KC,WARPS chunks of the ring (prefetch_gemv.cu INSTANCES); WARPS 0 / -16: the "
        "tensor-core form with 8 / 16 warps (ROWS 16 or 32, KC 1024)",
    )
    p.add_argument("--triton-pdl", nargs="+", default=["wait", "full", "off"])
    p.add_argument("--grid", type=int, default=0, help="programs (0: one per SM)")
    p.add_argument("--skip-shapes", action="store_true")
    p.add_argument("--ncu", default="", help="a shape: 3 launches a variant, untimed")
    p.add_argument("--gaps-ns", type=int, nargs="+", default=[0], help="idle before out_proj")
    p.add_argument(
        "--one-launch",
        type=int,
        nargs="*",
        default=None,
        help="rings (bytes) of the one-launch chain of the 27B GEMVs, against 256 launches",
    )
    p.add_argument(
        "--one-launch-ldg",
        type=int,
        nargs="*",
        default=None,
        help="depths (2, 3) of the one-launch chain whose warps copy with cp.async",
    )
    p.add_argument(
        "--dealt",
        action="store_true",
        help="also the one-launch chains with 32-row chunks dealt round the grid (mode 8)",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="also each one-launch chain with no wait at GEMV boundaries: computing (mode 16, "
        "wrong outputs) and copies only (mode 20)",
    )
    p.add_argument(
        "--one-launch-cta",
        type=int,
        nargs="*",
        default=None,
        help="stages (3-5) of the one-launch chain whose program fills them with cp.async",
    )
    args = p.parse_args()
    so = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = args.grid or sms
    variants = [
        PrefetchGemv(so, r, m, grid, tuple(map(int, t.split(","))))
        for t in args.tiles
        for r in args.ring
        for m in args.modes
    ]
    tu.USE_PDL = True
    print(torch.cuda.get_device_name(0), f"{sms} SMs, grid {grid}")
    if args.ncu:  # for `ncu --kernel-name regex:prefetch`: a few eager launches, nothing timed
        n, k = next(v for name, v in SHAPES.items() if args.ncu in name)
        w, s = random_fp8(n, k), torch.rand(n, device="cuda") * 1e-3
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        for v in variants:
            for _ in range(3):
                v(x, w, s, out)
        torch.cuda.synchronize()
        return
    if not check([v for v in variants if not v.mode & 4]):
        sys.exit(1)
    chains = []
    modes = [0, 4, 8, 12] if args.dealt else [0, 4]  # 8: chunks dealt round the grid
    modes += [16, 20] if args.no_wait else []  # no wait at GEMV boundaries (outputs wrong)
    for ring in args.one_launch or []:
        chains += [OneLaunchChain(so, ring, grid, 2, mode=m) for m in modes]
    for depth in args.one_launch_ldg or []:  # no dealt form
        chains += [OneLaunchChain(so, 0, grid, 2, mode=m, depth=depth) for m in modes if not m & 8]
    for depth in args.one_launch_cta or []:
        chains += [OneLaunchChain(so, 0, grid, 2, mode=m, depth=depth, form="cta") for m in modes]
    if not all(check_chain(c) for c in chains if not c.mode & 20):
        sys.exit(1)
    variants = [TritonGemv(pdl) for pdl in args.triton_pdl] + variants
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    if not args.skip_shapes:
        per_shape(variants, bw)
    for gap in args.gaps_ns:
        chain(variants, bw, args.layers, so, gap)
    if chains:
        ring = PrefetchGemv(so, 147456, 3, grid, (32, 1024, 0))
        one_launch_chain(chains, so, bw, args.layers, ring)


if __name__ == "__main__":
    main()
