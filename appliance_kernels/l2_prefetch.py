"""L2 prefetch of a weight on a side stream, while the small kernels before its GEMV run.

At small-batch decode every linear is a weight read, and before some of them sits a run of small,
latency-bound kernels that leave HBM almost idle for 5-12 µs: between the GDN in_proj and out_proj
the recurrence and its gated norm, between the attention qkv and o_proj the q / k norm, the
decode attention and its merge. `side_prefetch` forks a side stream from the current one (inside a
CUDA graph: a parallel branch that starts when the kernel before it ends) and there launches one
small kernel whose lanes ask L2 for the weight's first bytes with Hopper's
`cp.async.bulk.prefetch.L2` (no data to the SM, no wait: the kernel ends as soon as it has asked),
so that the GEMV later finds them in L2. The caller joins the side stream (`join`) after it has
launched the GEMV that reads the weight. Prefetching has no effect on any value: the torch
reference of this op is doing nothing, which is what happens off CUDA, before SM90, in Triton's
interpreter and when `SIDE_PREFETCH_MIB` is 0 (timed in docs/benchmarks.md before it is turned
on; an earlier form, the GEMV's own programs prefetching before their PDL wait, was slower: run BY).
"""

from __future__ import annotations

import torch

from appliance_kernels.triton_utils import HAS_TRITON, jit, tl

# MiB of each output projection (GDN out_proj, attention o_proj) to prefetch; 0: off
SIDE_PREFETCH_MIB = 0.0
# MiB of the MLP's down projection to prefetch while the SiLU-and-mul runs; 0: off
SIDE_PREFETCH_DOWN_MIB = 0.0
# Decode batches up to this many rows prefetch (larger batches are not weight-read bound)
SIDE_PREFETCH_MAX_ROWS = 64
CHUNK = 64 << 10  # bytes one lane asks for (a multiple of 16)
LANES = 32  # lanes of one program (one warp)

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_SM90: dict[int, bool] = {}


@jit
def _bulk_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks L2 for one CHUNK-byte run of [base, base + nbytes) (nbytes a multiple of
    16); lanes past the end ask for the first 16 bytes again (harmless)."""
    pid = tl.program_id(0)
    start = (pid * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK)
    inside = size > 0
    start = tl.where(inside, start, 0)
    size = tl.where(inside, size, 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; // $0",
        "=r,l,r",
        [base_ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_bytes(w: torch.Tensor, mib: float) -> int:
    """Bytes of w's storage to prefetch: its first `mib` MiB, whole 16-byte runs, at most all."""
    return min(int(mib * 2**20), w.numel() * w.element_size()) // 16 * 16


def _can_prefetch(w: torch.Tensor) -> bool:
    if not (HAS_TRITON and w.is_cuda and w.is_contiguous()):
        return False
    index = w.device.index if w.device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SM90[index] and w.data_ptr() % 16 == 0


def l2_prefetch(w: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for w's first nbytes (a multiple of 16) on the current stream; nothing where
    `_can_prefetch` says no."""
    if nbytes <= 0 or not _can_prefetch(w):
        return
    if nbytes % 16:
        raise ValueError(f"l2_prefetch: {nbytes} bytes is not a multiple of 16")
    grid = (-(-nbytes // (CHUNK * LANES)),)
    _bulk_prefetch_kernel[grid](w.view(-1).view(torch.uint8), nbytes, CHUNK, LANES, num_warps=1)


def side_prefetch(w: torch.Tensor, mib: float, rows: int) -> torch.cuda.Stream | None:
    """Fork a side stream from the current one and prefetch w's first `mib` MiB there, for a
    GEMV over `rows` rows that the caller launches later on the current stream. Returns the side
    stream for `join`, or None when nothing was launched (off, too many rows, not SM90 CUDA)."""
    if mib <= 0 or rows > SIDE_PREFETCH_MAX_ROWS or not _can_prefetch(w):
        return None
    index = w.device.index if w.device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(device=w.device)
    side.wait_stream(torch.cuda.current_stream(w.device))
    with torch.cuda.stream(side):
        l2_prefetch(w, prefetch_bytes(w, mib))
    return side


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for a side_prefetch's stream (a CUDA graph's capture must end
    with every forked stream joined); nothing for None."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
