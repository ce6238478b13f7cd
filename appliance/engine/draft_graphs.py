"""MTP drafting on fixed shapes: the chain of k greedy drafts (`DraftChain`, shared with the fused
verify step of engine/mtp_graphs.py) and the draft pass after a plain decode step of MTP requests
(`DraftGraphs`: a step that verifies no drafts, SchedulerConfig.mtp_disable_batch_size), captured
per decode bucket beside the decode graphs. The runner calls both."""

from __future__ import annotations

from collections.abc import Callable

import torch

from appliance.engine.graphs import DecodeGraphs, capture_buckets
from appliance.engine.pools import PoolSizes
from appliance.engine.requests import RequestTable
from appliance.models.context import ForwardContext, forward_context


class DraftChain:
    """Drafts d'_1..d'_k from each request's last committed position P: chain row j >= 1 sits at
    P + j with input (y_j, d'_j) and writes its draft KV to the request's scratch slot j - 1 (the
    same chain as appliance/engine/mtp.py's Drafter, with no host tensor inside, so it captures)."""

    def __init__(
        self,
        model: torch.nn.Module,  # the main model (its LM head proposes the drafts)
        drafts: list[torch.nn.Module],  # eagle: one module reused; vanilla: one per draft
        requests: RequestTable,
        sizes: PoolSizes,
        k: int,
        max_bs: int,
        draft_vocab: int,  # drafts from the first N ids (0: all)
        device: torch.device,
    ) -> None:
        self.model, self.drafts, self.requests, self.sizes = model, drafts, requests, sizes
        self.k, self.draft_vocab = k, draft_vocab
        self.offsets = torch.arange(k + 1, dtype=torch.int64, device=device)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int64, device=device)

    def __call__(self, bs: int, slots: torch.Tensor, last: torch.Tensor, y1: torch.Tensor) -> None:
        """slots, last: [bs]; y1: [bs, H], the draft module's output at P (proposes d'_1)."""
        table, k = self.requests, self.k
        draft_ids = self.model.draft_ids
        ys, drafts = [y1], [draft_ids(y1, self.draft_vocab)]
        written = [0] * len(self.drafts)  # chain rows each module already holds in its KV
        scratch = self.sizes.scratch_slot(slots, 0)  # [bs] each request's first scratch slot
        for step in range(2, k + 1):
            m = step - 1 if len(self.drafts) > 1 else 0
            chain_rows = list(range(written[m] + 1, step))
            n = len(chain_rows)
            offsets = self.offsets[chain_rows[0] : step]
            pos = last[:, None] + offsets  # [bs, n]
            kv = scratch[:, None] + offsets - 1
            table.req_to_token[slots[:, None].expand(bs, n), pos] = kv.to(torch.int32)
            ctx = ForwardContext(
                req_slots=slots,
                cu_seqlens_q=self.cu[: bs + 1] * n,
                seq_lens=last + step,
                has_initial_state=last >= 0,
                out_kv_slots=kv.reshape(-1),
                req_to_token=table.req_to_token,
                q_lens=[n] * bs,
                all_decode=n == 1,
                max_q_len=n,
            )
            ids = torch.stack([drafts[j - 1] for j in chain_rows], dim=1).reshape(-1)
            h = torch.stack([ys[j - 1] for j in chain_rows], dim=1).reshape(bs * n, -1)
            with forward_context(ctx):
                y = self.drafts[m](ids, h, pos.reshape(-1))
            written[m] = step - 1
            ys.append(y.view(bs, n, -1)[:, -1])
            drafts.append(draft_ids(ys[-1], self.draft_vocab))
        table.draft_tokens[slots, :k] = torch.stack(drafts, dim=1)


class DraftGraphs:
    """The draft pass after a decode-graph step whose requests decode with MTP but verify no
    drafts: each request's decoded row goes through the draft module(s) (their KV written at the
    row's slot, so the draft KV stays whole), then the chain of k drafts from it, written into the
    request table where a later verify step reads them. Reads the decode graphs' inputs and
    hidden states and the sampled tokens already written into the table; one graph per decode
    bucket (eager before `capture()` and on CPU)."""

    def __init__(
        self,
        decode: DecodeGraphs,
        drafts: list[torch.nn.Module],
        sizes: PoolSizes,
        k: int,
        draft_vocab: int,
        device: torch.device,
    ) -> None:
        self.decode, self.drafts, self.device = decode, drafts, device
        self.requests = decode.requests
        self.batch_sizes, self.max_bs = decode.batch_sizes, decode.max_bs
        self.chain = DraftChain(
            decode.model, drafts, decode.requests, sizes, k, decode.max_bs, draft_vocab, device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    def _draft(self, bs: int) -> None:
        meta = self.decode.meta
        slots, positions = meta[0, :bs], meta[1, :bs]
        next_ids = self.requests.token_ids[slots, positions + 1]  # the token each row sampled
        # the decode step's rows, derived afresh: a context made inside the decode graph's capture
        # holds values only once that graph has replayed
        ctx = self.decode.context(bs)
        hidden = self.decode.hidden[:bs]
        with forward_context(ctx):  # vanilla: every module extends its own KV
            ys = [module(next_ids, hidden, positions) for module in self.drafts]
        self.chain(bs, slots, positions, ys[0])  # the first module's output proposes d'_1

    def capture(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        graphs, self.capture_s, self.pool_bytes = capture_buckets(
            self.batch_sizes, [self._draft], self.device, progress
        )
        self.graphs = {bs: g[0] for bs, g in graphs.items()}

    @torch.inference_mode()
    def run(self, n: int) -> None:
        """Drafts for the n requests of the decode step just replayed (after its samples were
        written into the request table, in stream order)."""
        bs = self.decode.bucket(n)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._draft(bs)


def draft_graph_reserve_bytes(max_bs: int, vocab_size: int, draft_vocab: int) -> int:
    """Device memory held back for the draft graphs: a chain step's draft logits (16-bit and their
    fp32 argmax input) over the first `draft_vocab` ids (0: all) for the largest bucket, plus a
    margin for the draft module's activations; logged against the pool measured after capture."""
    ids = min(draft_vocab or vocab_size, vocab_size)
    return max_bs * ids * 6 + 128 * 2**20 if max_bs else 0
