"""CUDA graphs of a short prefill step: one request's chunk of fewer than T rows, for buckets T up
to `--cuda-graph-max-prefill-tokens`. Such a step is launch-bound when run eagerly (on the H200 a
128-token chunk of the 27B model: ~24 ms of kernels, ~80 ms of wall time, docs/benchmarks.md),
and it is what a prefix-cache hit, a chat turn's new message or a long prompt's last chunk runs.

Inputs, as in the decode graphs (engine/graphs.py): per row `[3, T]` (request slot, position, KV
slot) and per request `[4, 2]` (slot, sequence length, has earlier tokens, rows so far), each
copied from pinned memory in one transfer. The rows past the real chunk form a second request on
the padding slot (positions 0.., the padding KV slot), so they never touch live KV or state; the
bucket is the smallest with at least one padding row (no zero-length request). Logits are
computed for the chunk's last row only; steps that need every row's hidden state (MTP drafts,
prompt logprobs) or images run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from appliance.engine.graphs import StagedInputs, capture_buckets
from appliance.engine.pools import PoolSizes
from appliance.engine.requests import RequestTable
from appliance.messages import ScheduledChunk
from appliance.models.context import ForwardContext, forward_context

PREFILL_BUCKETS = (32, 64, 128, 256, 512)


def prefill_buckets(max_tokens: int) -> list[int]:
    """The buckets up to `max_tokens` (0: none)."""
    return [t for t in PREFILL_BUCKETS if t <= max_tokens]


def prefill_graph_reserve_bytes(max_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Device memory held back for the prefill graphs' pool: the activations of the largest
    bucket (~40 hidden-sized buffers a row covers the MLP / MoE and GDN intermediates) and one
    row of logits, plus a margin."""
    if not max_tokens:
        return 0
    return max_tokens * hidden_size * 4 * 40 + vocab_size * 4 * 3 + 256 * 2**20


class PrefillGraphs:
    """One graph per bucket; `run(chunk)` pads the step to its bucket and replays it (before
    `capture()`, or on CPU, it runs the same padded step eagerly)."""

    def __init__(
        self,
        model: torch.nn.Module,
        requests: RequestTable,
        sizes: PoolSizes,
        max_tokens: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if not sizes.padding:
            raise ValueError("PrefillGraphs needs pools with a padding slot (PoolSizes.padding)")
        self.model, self.requests, self.device = model, requests, device
        self.batch_sizes = prefill_buckets(max_tokens)  # (the name capture_logged reads)
        if not self.batch_sizes:
            raise ValueError(f"no prefill graph bucket fits {max_tokens} tokens")
        self.max_bs = self.max_tokens = self.batch_sizes[-1]
        pad_req, pad_kv = sizes.pad_req_slot, sizes.pad_kv_slot
        requests.token_ids[pad_req].zero_()  # padding rows read token 0
        self.rows = StagedInputs([pad_req, 0, pad_kv], self.max_tokens, device)
        # per request: slot, sequence length, has earlier tokens, cumulative rows (cu_seqlens[1:])
        self.reqs = StagedInputs([pad_req, 0, 0, 0], 2, device)
        self.zero = torch.zeros(1, dtype=torch.int64, device=device)
        self.logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    # ------------------------------------------------------------------ the captured step
    def _forward(self, rows: int) -> None:
        meta, req = self.rows.meta, self.reqs.meta
        slots, positions, kv_slots = meta[0, :rows], meta[1, :rows], meta[2, :rows]
        table = self.requests
        input_ids = table.token_ids[slots, positions]
        table.req_to_token[slots, positions] = kv_slots.to(torch.int32)
        cu_seqlens = torch.cat([self.zero, req[3]])
        ctx = ForwardContext(
            req_slots=req[0],
            cu_seqlens_q=cu_seqlens,
            seq_lens=req[1],
            has_initial_state=req[2] > 0,
            out_kv_slots=kv_slots,
            req_to_token=table.req_to_token,
            q_lens=[rows, 0],  # host bounds only: `rows` in all, at most `rows` per request
            all_decode=False,
            max_q_len=rows,
        )
        self.contexts[rows] = ctx
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        last = hidden.index_select(0, req[3, :1] - 1)  # the chunk's last row
        self.logits.copy_(self.model.compute_logits(last))

    def _padding_only(self, rows: int) -> None:
        """Inputs for a warm-up: two requests on the padding slot, of 1 and rows - 1 rows."""
        meta, req = self.rows.meta, self.reqs.meta
        meta[0].fill_(self.rows.pad[0])
        meta[1, 0] = 0
        meta[1, 1:rows] = torch.arange(rows - 1, device=self.device)
        meta[2].fill_(self.rows.pad[2])
        req[0].fill_(self.reqs.pad[0])
        req[1] = torch.tensor([1, rows - 1], device=self.device)
        req[2].zero_()
        req[3] = torch.tensor([1, rows], device=self.device)

    def capture(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Warm up and capture every bucket, largest first (smaller ones reuse its memory)."""
        graphs, self.capture_s, self.pool_bytes = capture_buckets(
            self.batch_sizes, [self._forward], self.device, progress, self._padding_only
        )
        self.graphs = {t: g[0] for t, g in graphs.items()}

    # ------------------------------------------------------------------ replay
    def bucket(self, n: int) -> int:
        """The smallest bucket with room for `n` rows and at least one padding row."""
        return next(t for t in self.batch_sizes if t > n)

    def can_run(self, chunk: ScheduledChunk) -> bool:
        """A plain chunk of more than one row that fits a bucket with a padding row."""
        return not chunk.num_draft and 1 < chunk.num_tokens < self.max_tokens

    def run(self, chunk: ScheduledChunk) -> tuple[int, torch.Tensor]:
        """Replays the step; returns (bucket, logits [1, V] of the chunk's last row)."""
        n, start = chunk.num_tokens, chunk.start
        rows = self.bucket(n)
        pad = rows - n
        self.rows.stage(
            [
                [chunk.req_slot] * n,
                list(range(start, start + n)) + list(range(pad)),
                list(chunk.kv_slots),
            ]
        )
        self.reqs.stage([[chunk.req_slot], [start + n, pad], [int(start > 0), 0], [n, rows]])
        graph = self.graphs.get(rows)
        if graph is not None:
            graph.replay()
        else:  # not captured (CPU tests): the same step, eagerly
            self._forward(rows)
        return rows, self.logits
