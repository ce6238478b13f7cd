"""Device-resident MTP decode: the step of a batch of verify chunks (every request decoding with k
drafts) as three fixed-shape device programs, captured as CUDA graphs per bucket on the GPU and run
eagerly elsewhere (CPU, before capture, `--disable-cuda-graph`):

- verify forward: k + 1 rows per request (the last committed token, then its k drafts), forward,
  logits;
- verify sampling: sampling at every row with the request's own knobs and the row's sequence
  offset, acceptance (draft j + 1 kept while it equals the sample at row j), the accepted tokens
  written into the request table and each request's GDN/conv state committed at its last accepted
  row;
- draft: the MTP module over all k + 1 rows (rows past the accepted ones are computed and ignored:
  causal attention keeps them out of the kept rows), then the chain of k greedy drafts from the last
  accepted row, written into the request table for the next step.

Between the two verify programs the runner may edit the rows of requests whose sampling takes more
than those knobs (penalties, logit bias, allowed ids, min_tokens, logprobs: engine/verify_edits.py),
in place in the logits the first program leaves, so such requests draft too. Guided requests
(structured outputs) join the step: the host fills their rows' grammar masks (after the drafts,
engine/guided.py) into a persistent buffer the sampling program applies, and advances their matchers
when the step's result arrives. Nothing is read back by the host inside the step: its inputs are one
`[2 + k + 1, bs]` int64 tensor (request slot, first position, KV slot of each row) staged in one
transfer, and its result (the k + 1 samples and the accepted count per request) goes back in one
non-blocking copy. The same acceptance as the host path in appliance/engine/mtp.py, so either is
lossless against MTP off; steps that mix in prefill chunks, plain decodes, images or fewer drafts
take that host path. `--disable-mtp-fused-graph` (or `APPLIANCE_DISABLE_MTP_FUSED_GRAPH=1`) turns
this path off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from appliance.engine.draft_graphs import DraftChain
from appliance.engine.graphs import StagedInputs, capture_buckets, graph_batch_sizes
from appliance.engine.pools import Pools, PoolSizes
from appliance.engine.requests import RequestTable
from appliance.messages import ScheduledChunk
from appliance.models.context import ForwardContext, forward_context
from appliance_kernels.sampling import sample
from appliance_kernels.token_bitmask import apply_token_bitmask, bitmask_words


def is_full_verify(chunks: list[ScheduledChunk], k: int) -> bool:
    """Every chunk is a decoding request's verify chunk with all k drafts."""
    return bool(chunks) and all(
        c.num_draft == k and c.num_tokens == k + 1 and c.sample for c in chunks
    )


def mtp_graph_max_bs(graph_max_bs: int, k: int) -> int:
    """Largest verify batch captured: its rows (k + 1 per request) stay within the decode graphs'
    largest bucket, so the logits of a step stay as large as a plain step's."""
    return min(graph_max_bs, max(1, graph_max_bs // (k + 1))) if graph_max_bs else 0


def mtp_graph_reserve_bytes(max_bs: int, k: int, vocab_size: int) -> int:
    """Device memory held back for the MTP graphs: logits of every verify row (the persistent fp32
    buffer the two verify graphs share, the 16-bit LM-head output and the sampler's working copy),
    plus a margin; logged against the pool measured after capture."""
    return max_bs * (k + 1) * vocab_size * 4 * 3 + 256 * 2**20 if max_bs else 0


class MtpGraphs:
    """The fused MTP step for batches of up to `max_bs` verify requests. `run(chunks)` stages the
    inputs, launches verify + draft (replayed graphs once `capture()` ran, else eagerly and
    unpadded) and returns the device tensor [n, k + 2]: the k + 1 samples, then the accepted count
    (1..k + 1)."""

    def __init__(
        self,
        model: torch.nn.Module,
        drafts: list[torch.nn.Module],
        pools: Pools,  # its GDN states are committed after acceptance
        requests: RequestTable,
        sizes: PoolSizes,
        max_bs: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        k: int = 0,  # drafts per step; 0: the pools' mtp_step (benchmarks try smaller ones)
        batch_sizes: list[int] | None = None,  # buckets; None: graph_batch_sizes(max_bs)
        draft_vocab: int = 0,  # drafts from the first N ids (0: all; SchedulerConfig)
        vocab_size: int = 0,  # > 0: verify rows take grammar masks (structured outputs)
    ) -> None:
        self.model, self.pools = model, pools
        self.requests, self.sizes, self.device = requests, sizes, device
        self.k = k = k or sizes.mtp_step
        if not 1 <= k <= sizes.mtp_step:
            raise ValueError(f"k={k}: the pools hold 1..{sizes.mtp_step} drafts per step")
        self.drafts = drafts if len(drafts) == 1 else drafts[:k]  # vanilla: one module per step
        self.rows = rows = k + 1
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else graph_batch_sizes(max_bs)
        self.max_bs = max_bs = self.batch_sizes[-1]
        pad_slot = sizes.pad_req_slot if sizes.padding else 0
        pad_kv = sizes.pad_kv_slot if sizes.padding else 0
        if sizes.padding:
            requests.token_ids[pad_slot].zero_()  # padding rows read token 0 (the table is empty)
        # inputs: request slot, first position (the last committed token), KV slot of each row
        self.inputs = StagedInputs([pad_slot, 0] + [pad_kv] * rows, max_bs, device)
        self.row_offsets = torch.arange(rows, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int64, device=device) * rows
        self.chain = DraftChain(model, self.drafts, requests, sizes, k, max_bs, draft_vocab, device)
        # persistent outputs: verify's hidden states (the draft graph's input) and the result
        self.hidden = torch.zeros(max_bs * rows, hidden_size, dtype=dtype, device=device)
        self.out = torch.zeros(max_bs, rows + 1, dtype=torch.int64, device=device)
        # the grammar masks of the verify rows (engine/guided.py; all ones: no constraint), read
        # by every step: a mask costs one pass over the logits, which a step without guided
        # requests pays too rather than capturing every bucket twice
        words = bitmask_words(vocab_size) if vocab_size else 0
        self.bitmask = torch.full((max_bs * rows, words), -1, dtype=torch.int32, device=device)
        self._masked_rows = 0  # rows of `bitmask` the last step set (reset before the next)
        # the verify rows' logits the sampling program reads: the last forward's on eager runs,
        # else views of one persistent buffer for every bucket (`capture`: the host edits rows of
        # it between the two verify graphs, so it must outlive the forward graph)
        self.logits = torch.empty(0)
        self._logits_buf: torch.Tensor | None = None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        self.padded = False  # steps rounded up to a bucket (set by capture(); tests set it on CPU)
        self.timing = False  # record events around the verify and draft programs (benchmarks)
        self._marks: tuple = ()  # timing: start, between the programs, end

    # ------------------------------------------------------------------ the programs
    def _verify_ctx(self, bs: int) -> ForwardContext:
        meta, rows = self.inputs.meta, self.rows
        slots, start = meta[0, :bs], meta[1, :bs]
        return ForwardContext(
            req_slots=slots,
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            seq_lens=start + rows,
            has_initial_state=start > 0,
            out_kv_slots=meta[2 : 2 + rows, :bs].t().reshape(-1),
            req_to_token=self.requests.req_to_token,
            q_lens=[rows] * bs,
            all_decode=False,
            max_q_len=rows,
            num_plain_reqs=0,
            num_plain_tokens=0,
        )

    def _positions(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per verify row: its request slot and its position [bs * (k + 1)]."""
        slots, start = self.inputs.meta[0, :bs], self.inputs.meta[1, :bs]
        row_slots = slots[:, None].expand(bs, self.rows).reshape(-1)
        positions = (start[:, None] + self.row_offsets).reshape(-1)
        return row_slots, positions

    def _verify_forward(self, bs: int) -> None:
        """The verify rows' forward and logits (`self.logits`, read by _verify_sample: the host may
        edit rows of it in place between the two programs)."""
        table, k = self.requests, self.k
        slots, start = self.inputs.meta[0, :bs], self.inputs.meta[1, :bs]
        row_slots, positions = self._positions(bs)
        ctx = self._verify_ctx(bs)
        table.req_to_token[row_slots, positions] = ctx.out_kv_slots.to(torch.int32)
        drafts = table.draft_tokens[slots, :k]  # [bs, k]
        ids = torch.cat([table.token_ids[slots, start][:, None], drafts], dim=1).reshape(-1)
        with forward_context(ctx):
            hidden = self.model(ids, positions)
        self.hidden[: bs * self.rows].copy_(hidden)
        buf = self._logits_buf
        self.logits = self.model.compute_logits(hidden, None if buf is None else buf[: len(ids)])

    def _verify_sample(self, bs: int) -> None:
        """Sampling at every verify row, acceptance, and the accepted tokens' commit."""
        table, k, rows = self.requests, self.k, self.rows
        slots, start = self.inputs.meta[0, :bs], self.inputs.meta[1, :bs]
        row_slots, positions = self._positions(bs)
        drafts = table.draft_tokens[slots, :k]  # [bs, k]
        logits = self.logits
        if self.bitmask.shape[1]:
            logits = apply_token_bitmask(logits, self.bitmask[: bs * rows])
        samples = sample(  # the offset of row j's token is start + 1 + j, as in plain decoding
            logits,
            table.temperature[row_slots],
            table.top_k[row_slots],
            table.top_p[row_slots],
            table.min_p[row_slots],
            table.seed[row_slots],
            positions + 1,
        ).view(bs, rows)
        kept = (drafts == samples[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [bs]
        accepted = kept + 1
        # samples past the accepted run land past the request's length: never read as known
        table.token_ids[row_slots, positions + 1] = samples.reshape(-1)
        table.num_tokens[slots] = start + 1 + accepted
        self.pools.commit_verify(slots, kept)
        self.out[:bs, :rows].copy_(samples)
        self.out[:bs, rows].copy_(accepted)

    def _draft(self, bs: int) -> None:
        rows = self.rows
        slots, start = self.inputs.meta[0, :bs], self.inputs.meta[1, :bs]
        _, positions = self._positions(bs)
        accepted = self.out[:bs, rows]
        next_ids = self.out[:bs, :rows].reshape(-1)  # the token after each row (its sample)
        hidden = self.hidden[: bs * rows]
        last = self.chain.cu[:bs] * rows + accepted - 1  # each request's last accepted row
        y_last = None
        with forward_context(self._verify_ctx(bs)):
            for i, module in enumerate(self.drafts):
                y = module(next_ids, hidden, positions)
                if i == 0:
                    y_last = y[last]
        self._chain(bs, slots, start + accepted - 1, y_last)

    def _chain(self, bs: int, slots: torch.Tensor, last: torch.Tensor, y1: torch.Tensor) -> None:
        """Drafts d'_1..d'_k from the last committed position P (`last`; engine/draft_graphs.py)."""
        self.chain(bs, slots, last, y1)

    # ------------------------------------------------------------------ capture and run
    def capture(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        if not self.sizes.padding:
            raise ValueError(
                "MtpGraphs.capture needs pools with a padding slot (PoolSizes.padding)"
            )
        width = self.model.lm_head.vocab
        rows = self.max_bs * self.rows
        self._logits_buf = torch.empty(rows, width, dtype=torch.float32, device=self.device)
        self.graphs, self.capture_s, self.pool_bytes = capture_buckets(
            self.batch_sizes,
            [self._verify_forward, self._verify_sample, self._draft],
            self.device,
            progress,
        )
        self.pool_bytes += self._logits_buf.numel() * self._logits_buf.element_size()
        self.padded = True

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.max_bs and is_full_verify(chunks, self.k)

    @torch.inference_mode()
    def run(
        self,
        chunks: list[ScheduledChunk],
        bitmask: torch.Tensor | None = None,
        edit: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
    ) -> torch.Tensor:
        """`bitmask`: the grammar masks of the chunks' k + 1 rows each [n * (k + 1), words]
        (host; engine/guided.py), or None when no request of the step is guided. `edit(logits,
        masks)`: called between the forward and the sampling with the step's verify logits
        [n * (k + 1), V] (edited in place: penalties, bias, logprobs ...; engine/verify_edits.py)
        and their grammar masks on the device (None when unguided)."""
        n = len(chunks)
        bs = next(b for b in self.batch_sizes if b >= n) if self.padded else n
        self._stage_bitmask(bitmask)
        self.inputs.stage(
            [
                [c.req_slot for c in chunks],
                [c.start for c in chunks],
                *([c.kv_slots[j] for c in chunks] for j in range(self.rows)),
            ]
        )
        graphs = self.graphs.get(bs)
        if graphs:
            steps = [g.replay for g in graphs]
        else:  # not captured: the same programs, eagerly
            steps = [lambda: self._verify_forward(bs), lambda: self._verify_sample(bs)]
            steps.append(lambda: self._draft(bs))
        marks = []
        for i, launch in enumerate(steps):
            if self.timing and i != 1:  # marks: before verify, before draft (end: below)
                marks.append(self._mark())
            launch()
            if i == 0 and edit is not None:
                logits = self._logits_buf if graphs else self.logits  # the forward's
                masks = self.bitmask[: n * self.rows] if bitmask is not None else None
                edit(logits[: n * self.rows], masks)
        if self.timing:
            self._marks = (*marks, self._mark())
        return self.out[:n]

    def _stage_bitmask(self, bitmask: torch.Tensor | None) -> None:
        """Copies the step's masks in (stream-ordered after the previous step's reads) and resets
        the rows the previous step masked beyond them."""
        rows = 0 if bitmask is None else bitmask.shape[0]
        if rows and not self.bitmask.shape[1]:
            raise ValueError("MtpGraphs: grammar masks need vocab_size (built without)")
        if rows:
            if self.bitmask.is_cuda:  # pinned staging: a pageable copy would wait for the stream
                bitmask = bitmask.pin_memory()
            self.bitmask[:rows].copy_(bitmask, non_blocking=True)
        if self._masked_rows > rows:
            self.bitmask[rows : self._masked_rows].fill_(-1)
        self._masked_rows = rows

    def _mark(self) -> torch.cuda.Event | float:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def last_times_ms(self) -> tuple[float, float]:
        """(verify, draft) device milliseconds of the last run with `timing` on (synchronises)."""
        start, mid, end = self._marks
        if isinstance(end, float):
            return (mid - start) * 1e3, (end - mid) * 1e3
        end.synchronize()
        return start.elapsed_time(mid), mid.elapsed_time(end)
