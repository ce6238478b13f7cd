"""L2 prefetch of a one-row GEMV's weight while the previous kernel still runs.

At batch-1 decode every linear is a weight read, and between two of them sits a small kernel (an
RMSNorm, the SiLU-and-mul, the GDN recurrence and its gated norm, the attention) that keeps HBM
almost idle for 2-10 µs. Under programmatic dependent launch (triton_utils.USE_PDL) the next GEMV's
first programs are already resident during that kernel, waiting in `griddepcontrol.wait`; before
they wait they can ask L2 for their own weight rows (a constant input: nothing an earlier kernel
writes), so part of the weight stream happens in the gap instead of after it. The prefetch moves no
data to the SM and holds nothing up: the program goes on to its wait at once.

`GEMV_PREFETCH` picks the instruction and how much: "line:MiB" issues one `prefetch.global.L2`
per 128-byte line, "bulk:MiB" one Hopper `cp.async.bulk.prefetch.L2` per sixteenth of a row; MiB
bounds the prefetch to the weight's first bytes (the programs that come first, which are the ones
resident in the gap), so the prefetched lines are read before L2 evicts them. "off": none. Only
under PDL on SM90+ (without PDL the programs start after the previous kernel: nothing to hide);
never in the interpreter. Timed in docs/benchmarks.md (run BY).
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import jit, tl

GEMV_PREFETCH = "off"
LINE = 128  # bytes of an L2 line
BULK_CHUNKS = 16  # bulk prefetches per row (each a multiple of 16 bytes)


def parse(text: str) -> tuple[str, float]:
    """("line" | "bulk" | "off", MiB) from a GEMV_PREFETCH string; a clear error otherwise."""
    mode, _, mib = text.partition(":")
    if mode == "off":
        return "off", 0.0
    if mode not in ("line", "bulk") or not mib:
        raise ValueError(f"GEMV prefetch {text!r}: expected off, line:MiB or bulk:MiB")
    return mode, float(mib)


def prefetch_args(
    w: torch.Tensor, block_n: int, programs: int, launch: dict, spec: str | None = None
) -> tuple[tuple[int, int, int], dict[str, int]]:
    """The GEMV kernels' (pf_programs, pf_row_bytes, pf_stride_bytes) arguments and their PF /
    PF_LINES constants for weight w [N, K] read in BLOCK_N-row programs: PF 0 (none) unless PDL is
    in the launch options and GEMV_PREFETCH (or spec) asks; then the first pf_programs programs
    prefetch their whole rows (1: lines, 2: bulk)."""
    mode, mib = parse(GEMV_PREFETCH if spec is None else spec)
    row_bytes = w.shape[1] * w.element_size()
    stride_bytes = w.stride(0) * w.element_size()
    if mode == "bulk" and row_bytes % (16 * BULK_CHUNKS):
        mode = "line"  # a chunk must be a multiple of 16 bytes
    if mode == "off" or not launch.get("PDL"):
        return (0, 0, 0), {"PF": 0, "PF_LINES": 1}
    per_program = block_n * row_bytes
    count = min(programs, -(-int(mib * 2**20) // per_program))
    lines = 1 << max(-(-row_bytes // LINE) - 1, 0).bit_length()
    return (count, row_bytes, stride_bytes), {"PF": 1 if mode == "line" else 2, "PF_LINES": lines}


@jit
def prefetch_rows(
    w_ptr,
    rn,  # [BLOCK_N] the program's rows
    n_ok,
    pid,
    pf_programs,
    pf_row_bytes,
    pf_stride_bytes,
    PF: tl.constexpr,  # 0: none, 1: a prefetch per 128-byte line, 2: BULK_CHUNKS bulk prefetches
    PF_LINES: tl.constexpr,  # lines per row, a power of two (PF 1)
):
    """Programs pid < pf_programs ask L2 for their whole weight rows (no data to the SM, no
    wait). Only addresses inside the rows are named (masked lanes repeat the row's start)."""
    if PF > 0:
        if pid < pf_programs:
            base = w_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
            rows = base + tl.where(n_ok, rn, 0).to(tl.int64) * pf_stride_bytes
            if PF == 1:
                cols = tl.arange(0, PF_LINES) * 128
                ptrs = rows[:, None] + tl.where(cols < pf_row_bytes, cols, 0)[None, :]
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; // $0",
                    "=r,l",
                    [ptrs],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            else:
                chunk = pf_row_bytes // 16
                cols = tl.arange(0, 16)
                ptrs = rows[:, None] + (cols * chunk)[None, :]
                sizes = tl.zeros([1, 16], dtype=tl.int32) + chunk.to(tl.int32)
                sizes = tl.broadcast_to(sizes, ptrs.shape)
                tl.inline_asm_elementwise(
                    "cp.async.bulk.prefetch.L2.global [$1], $2; // $0",
                    "=r,l,r",
                    [ptrs, sizes],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
