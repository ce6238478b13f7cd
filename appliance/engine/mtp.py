"""MTP speculative decoding on the worker, called by the runner once per step: acceptance of verify
rows and their commit (`accept_and_commit`), then the draft pass (`Drafter`: extend the draft KV
over newly committed rows, then chain k draft tokens).

Acceptance (lossless for greedy and for sampling): the main model samples at every verify row with
the request's own seed and the row's sequence offset; draft j+1 is accepted while it equals the main
sample at row j; the main sample after the last accepted draft is added (so 1..k+1 tokens per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.pools import Pools, PoolSizes
from appliance.engine.requests import RequestTable
from appliance.messages import ScheduledChunk
from appliance.models.context import ForwardContext, forward_context


def accept(drafts: list[int], samples: list[int]) -> list[int]:
    """samples: main-model samples at rows 0..k; drafts: d_1..d_k. Returns the accepted tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return samples[: n + 1]


def commit_gdn(pools: Pools, slots: list[int], rows: list[int], device: torch.device) -> None:
    """The state after verify row rows[i] becomes request slots[i]'s committed GDN state."""
    if not slots:
        return
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    row_t = torch.tensor(rows, dtype=torch.int64, device=device)
    pools.commit_verify(slot_t, row_t)


def accept_and_commit(
    chunks: list[ScheduledChunk],
    samples: list[list[int]],
    requests: RequestTable,
    pools: Pools,
) -> list[list[int]]:
    """Verify chunks of one step and the main model's samples at each one's rows 0..num_draft -> the
    accepted tokens per chunk (1..num_draft + 1). They are written into the request table after the
    chunk's first row, and each request's GDN state is committed at its last accepted row; KV rows
    past it are left for the router to free."""
    if not chunks:
        return []
    slots = [c.req_slot for c in chunks]
    index = torch.tensor(slots, dtype=torch.int64, device=requests.device)
    drafts = requests.draft_tokens[index].tolist()  # [B, k]: one device read for the step
    accepted = [
        accept(drafted[: c.num_draft], main) for c, drafted, main in zip(chunks, drafts, samples)
    ]
    requests.append(slots, [c.start + 1 for c in chunks], accepted)
    commit_gdn(pools, slots, [len(tokens) - 1 for tokens in accepted], requests.device)
    return accepted


@dataclass
class ExtendRows:
    """Rows of this step whose next token is now committed, per MTP request."""

    req_slot: int
    first_row: int  # index into the step's hidden states
    start: int  # position of the first row
    count: int
    kv_slots: list[int]
    chain: bool  # the request sampled this step: draft its next k tokens


def extend_rows(
    chunks: list[ScheduledChunk], accepted: dict[int, int], requests: RequestTable
) -> list[ExtendRows]:
    """The draft pass's input rows: every computed row of an MTP request's chunk (in batch order),
    cut to the accepted rows for a verify chunk (`accepted`: req slot -> accepted tokens)."""
    rows, first = [], 0
    for chunk in chunks:
        count = accepted.get(chunk.req_slot, chunk.num_tokens)
        if requests.uses_mtp(chunk.req_slot):
            rows.append(
                ExtendRows(
                    chunk.req_slot,
                    first,
                    chunk.start,
                    count,
                    list(chunk.kv_slots[:count]),
                    chunk.sample,
                )
            )
        first += chunk.num_tokens
    return rows


class Drafter:
    """Runs the draft modules (eagle: one reused; vanilla: one per step) for MTP requests."""

    def __init__(
        self,
        main: torch.nn.Module,
        modules: list[torch.nn.Module],
        mtp_step: int,
        requests: RequestTable,
        sizes: PoolSizes,
        device: torch.device,
        draft_vocab: int = 0,  # drafts from the first N ids (0: all; SchedulerConfig)
    ) -> None:
        self.main, self.modules, self.k = main, modules, mtp_step
        self.requests, self.sizes, self.device = requests, sizes, device
        self.draft_vocab = draft_vocab

    def _ctx(
        self, slots: list[int], q_lens: list[int], seq_lens: list[int], kv_slots: list[int]
    ) -> ForwardContext:
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        return ForwardContext(
            req_slots=t(slots),
            cu_seqlens_q=t(cu),
            seq_lens=t(seq_lens),
            has_initial_state=t(seq_lens) > 0,
            out_kv_slots=t(kv_slots),
            req_to_token=self.requests.req_to_token,
            q_lens=q_lens,
            all_decode=all(n == 1 for n in q_lens),
        )

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, rows: list[ExtendRows]) -> None:
        if not rows:
            return
        tokens = self.requests.token_ids
        index = torch.cat([torch.arange(r.first_row, r.first_row + r.count) for r in rows])
        next_ids = torch.cat(
            [tokens[r.req_slot, r.start + 1 : r.start + 1 + r.count] for r in rows]
        )
        positions = torch.cat([torch.arange(r.start, r.start + r.count) for r in rows])
        ctx = self._ctx(
            [r.req_slot for r in rows],
            [r.count for r in rows],
            [r.start + r.count for r in rows],
            [s for r in rows for s in r.kv_slots],
        )
        h_in = hidden[index.to(hidden.device)]
        ends = torch.tensor([r.count for r in rows]).cumsum(0) - 1
        y_last = None
        with forward_context(ctx):
            for i, module in enumerate(self.modules):
                y = module(next_ids.to(self.device), h_in, positions.to(self.device))
                if i == 0:
                    y_last = y[ends.to(y.device)]
        chained = [i for i, r in enumerate(rows) if r.chain]
        if chained:
            self._chain(
                [rows[i] for i in chained], y_last[torch.tensor(chained, device=y_last.device)]
            )

    def _chain(self, rows: list[ExtendRows], y1: torch.Tensor) -> None:
        """Draft d'_1..d'_k per request. Chain row j (j >= 1) sits at position P + j (P = last
        committed row) with input (y_j, d'_j) and writes its draft KV to a scratch slot."""
        slots = [r.req_slot for r in rows]
        last = [r.start + r.count - 1 for r in rows]  # P per request
        ys = [y1]
        drafts = [self.main.draft_ids(y1, self.draft_vocab)]
        written = [0] * len(self.modules)  # chain rows each module already holds in its KV
        for step in range(2, self.k + 1):
            m = step - 1 if len(self.modules) > 1 else 0
            module = self.modules[m]
            first = written[m] + 1  # chain rows first..step-1 still missing from this module
            chain_rows = list(range(first, step))
            for j in chain_rows:
                for slot, p in zip(slots, last):
                    self.requests.req_to_token[slot, p + j] = self.sizes.scratch_slot(slot, j - 1)
            n = len(chain_rows)
            ids = torch.stack([drafts[j - 1] for j in chain_rows], dim=1).reshape(-1)  # [B*n]
            h = torch.stack([ys[j - 1] for j in chain_rows], dim=1).reshape(len(rows) * n, -1)
            pos = torch.tensor([p + j for p in last for j in chain_rows], device=self.device)
            kv = [self.sizes.scratch_slot(s, j - 1) for s in slots for j in chain_rows]
            ctx = self._ctx(slots, [n] * len(rows), [p + step for p in last], kv)
            with forward_context(ctx):
                y = module(ids, h, pos)
            written[m] = step - 1
            y_step = y.view(len(rows), n, -1)[:, -1]
            ys.append(y_step)
            drafts.append(self.main.draft_ids(y_step, self.draft_vocab))
        proposed = torch.stack(drafts, dim=1)  # [B, k]
        index = torch.tensor(slots, device=self.device)
        self.requests.draft_tokens[index, : proposed.shape[1]] = proposed
