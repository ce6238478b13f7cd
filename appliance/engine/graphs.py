"""CUDA graphs of the plain decode step (forward + logits), captured by the runner at startup for
bucketed batch sizes and replayed for steps whose chunks are all one-token decodes.

A replayed step's only inputs are one `[3, bs]` int64 tensor (request slot, position, KV slot per
row) copied from a pinned staging buffer in one transfer; everything else the forward reads (input
ids from the request table, `req_to_token`, sequence lengths) is derived from it inside the graph.
Rows past the real batch are padding: they run on a request slot and a KV slot that the router
never hands out (`PoolSizes.padding`), so they never touch live KV or state. Steps with prefill
chunks, MTP verify rows or images run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from appliance.config import GraphConfig
from appliance.engine.pools import PoolSizes
from appliance.engine.requests import RequestTable
from appliance.logging import get_logger
from appliance.messages import ScheduledChunk
from appliance.models.context import ForwardContext, forward_context

log = get_logger(__name__)

MAX_GRAPH_BS = 256


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 8 up to max_bs (max_bs itself included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes) | {max_bs})


def graph_max_bs(
    config: GraphConfig, max_num_seqs: int, device: torch.device, attention_backend: str
) -> int:
    """Largest decode batch captured as a CUDA graph; 0 when graphs are off (CPU, the flag, or an
    attention backend that plans on the host every step)."""
    if device.type != "cuda" or config.disable_cuda_graph:
        return 0
    if attention_backend == "flashinfer":
        log.warning("CUDA graphs off: the flashinfer attention backend plans on the host")
        return 0
    return min(config.cuda_graph_max_bs or MAX_GRAPH_BS, MAX_GRAPH_BS, max_num_seqs)


def graph_reserve_bytes(max_bs: int, vocab_size: int) -> int:
    """Device memory held back for the decode graphs in the pool sizing: their pool holds the
    activations of the largest bucket (logits dominate), plus a margin; logged against the pool
    measured after capture."""
    return max_bs * vocab_size * 4 * 3 + 512 * 2**20 if max_bs else 0


def capture_logged(name: str, graphs, reserved: int) -> None:
    """Captures `graphs` (DecodeGraphs, MtpGraphs), logging each bucket, the time and the memory
    against what the memory sizing held back."""
    total = len(graphs.batch_sizes)
    log.info("capturing %s CUDA graphs for %d batch sizes", name, total)
    graphs.capture(lambda done, _, bs: log.info("%s graph %d/%d (batch %d)", name, done, total, bs))
    log.info(
        "%s CUDA graphs: %d batch sizes (%d..%d) in %.1fs, %.2f GiB (%.2f GiB reserved)",
        name,
        total,
        min(graphs.batch_sizes),
        graphs.max_bs,
        graphs.capture_s,
        graphs.pool_bytes / 2**30,
        reserved / 2**30,
    )


@torch.inference_mode()
def capture_buckets(
    batch_sizes: list[int],
    steps: list[Callable[[int], None]],
    device: torch.device,
    progress: Callable[[int, int, int], None] | None = None,
    prepare: Callable[[int], None] | None = None,
) -> tuple[dict[int, list[torch.cuda.CUDAGraph]], float, int]:
    """Captures `steps` (each a function of the bucket size, run in order) as one graph each per
    bucket, largest bucket first so smaller ones reuse its memory; one memory pool for all. Each
    bucket is warmed up eagerly first (Triton compiles and autotunes outside the capture), after
    `prepare(bucket)` (inputs the warm-up can run on). Returns the graphs per bucket, the seconds
    it took and the device memory the pool holds."""
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    free_before, _ = torch.cuda.mem_get_info(device)
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
    for i, bs in enumerate(sorted(batch_sizes, reverse=True)):
        if prepare is not None:
            prepare(bs)
        for step in steps:
            step(bs)
        torch.cuda.synchronize(device)
        graphs[bs] = []
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                step(bs)
            graphs[bs].append(graph)
        if progress is not None:
            progress(i + 1, len(batch_sizes), bs)
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    return graphs, time.perf_counter() - start, max(0, free_before - free_after)


def is_plain_decode(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk computes one token, samples it, and carries no MTP drafts."""
    return bool(chunks) and all(c.num_tokens == 1 and c.sample and not c.num_draft for c in chunks)


class StagedInputs:
    """A graph's integer inputs: one `[rows, max_bs]` int64 device tensor (`meta`) whose columns
    past the real batch hold each row's padding value, filled from a pinned host buffer in one
    non-blocking transfer per step. Two host buffers alternate: with a step in flight, the copy of
    its inputs may not have run yet."""

    def __init__(self, pad: list[int], max_bs: int, device: torch.device) -> None:
        self.pad = list(pad)
        self.meta = torch.tensor([[p] * max_bs for p in pad], dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.staging = [self.meta.cpu().pin_memory() if cuda else self.meta.cpu() for _ in range(2)]
        self.staged = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def stage(self, rows: list[list[int]]) -> None:
        """rows[r] = the values of input row r for the step's n columns; the rest is padding."""
        self.turn ^= 1
        host, copied = self.staging[self.turn], self.staged[self.turn]
        if copied is not None:
            copied.synchronize()  # its last copy (two steps ago) has run: safe to overwrite
        staged = host.numpy()
        for r, (values, pad) in enumerate(zip(rows, self.pad, strict=True)):
            staged[r, : len(values)] = values
            staged[r, len(values) :] = pad
        self.meta.copy_(host, non_blocking=True)  # one transfer of the whole (tiny) buffer
        if copied is not None:
            copied.record()


class DecodeGraphs:
    """One graph per bucket; `run(chunks)` pads the step to the smallest bucket and replays it
    (before `capture()`, or on CPU, it runs the same padded step eagerly)."""

    def __init__(
        self,
        model: torch.nn.Module,
        requests: RequestTable,
        sizes: PoolSizes,
        max_bs: int,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not sizes.padding:
            raise ValueError("DecodeGraphs needs pools with a padding slot (PoolSizes.padding)")
        self.model, self.requests, self.device = model, requests, device
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        requests.token_ids[sizes.pad_req_slot].zero_()  # padding rows read token 0
        # inputs: [3, max_bs] (req slot, position, KV slot) on the device
        self.inputs = StagedInputs([sizes.pad_req_slot, 0, sizes.pad_kv_slot], max_bs, device)
        self.meta = self.inputs.meta
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int64, device=device)
        # outputs, shared by every bucket (a replay writes the first bs rows)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.logits = torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    # ------------------------------------------------------------------ the captured step
    def context(self, bs: int) -> ForwardContext:
        """The step's rows as a forward context, derived on the device from the staged inputs
        (also the draft graphs', engine/draft_graphs.py)."""
        slots, positions, kv_slots = self.meta[0, :bs], self.meta[1, :bs], self.meta[2, :bs]
        return ForwardContext(
            req_slots=slots,
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            seq_lens=positions + 1,
            has_initial_state=positions > 0,
            out_kv_slots=kv_slots,
            req_to_token=self.requests.req_to_token,
            q_lens=[1] * bs,
            all_decode=True,
            max_q_len=1,
        )

    def _forward(self, bs: int) -> None:
        slots, positions, kv_slots = self.meta[0, :bs], self.meta[1, :bs], self.meta[2, :bs]
        table = self.requests
        input_ids = table.token_ids[slots, positions]
        table.req_to_token[slots, positions] = kv_slots.to(torch.int32)
        ctx = self.context(bs)
        self.contexts[bs] = ctx
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        self.hidden[:bs].copy_(hidden)
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    def capture(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Warm up and capture every bucket, largest first (smaller ones reuse its memory)."""
        graphs, self.capture_s, self.pool_bytes = capture_buckets(
            self.batch_sizes, [self._forward], self.device, progress
        )
        self.graphs = {bs: g[0] for bs, g in graphs.items()}

    # ------------------------------------------------------------------ replay
    def bucket(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.max_bs and is_plain_decode(chunks)

    def run(self, chunks: list[ScheduledChunk]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Replays the step; returns (bucket, hidden [n, H], logits [n, V]) for the n chunks."""
        n = len(chunks)
        bs = self.bucket(n)
        self.inputs.stage(
            [
                [c.req_slot for c in chunks],
                [c.start for c in chunks],
                [c.kv_slots[0] for c in chunks],
            ]
        )
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:  # not captured (CPU tests): the same step, eagerly
            self._forward(bs)
        return bs, self.hidden[:n], self.logits[:n]
