"""Turns a StepPlan's chunks into the flat device batch of one forward: input ids, positions, KV
slots and the ForwardContext. Plain chunks (prefill, decode) come first, MTP verify chunks last, so
layers can treat the two kinds as two contiguous row ranges. Called by the runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.requests import RequestTable
from appliance.engine.transfer import to_device
from appliance.messages import ScheduledChunk
from appliance.models.context import ForwardContext


@dataclass
class StepBatch:
    chunks: list[ScheduledChunk]  # in batch order (plain first, then verify)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_rows: list[tuple[int, int]]  # per sampling chunk: (first index into logits, row count)

    @property
    def sample_chunks(self) -> list[ScheduledChunk]:
        """The chunks that sample this step, in the order of `sample_rows`."""
        return [c for c in self.chunks if c.sample]


def build_batch(
    chunks: list[ScheduledChunk], requests: RequestTable, device: torch.device
) -> StepBatch:
    """Reads each chunk's tokens (and a verify chunk's drafts) from the request table and records
    its KV slots in `req_to_token`."""
    chunks = [c for c in chunks if not c.num_draft] + [c for c in chunks if c.num_draft]
    ids, positions, kv_slots, logits_indices, sample_rows = [], [], [], [], []
    cu, seq_lens, q_lens, req_slots = [0], [], [], []
    for chunk in chunks:
        end = chunk.start + chunk.num_tokens
        if len(chunk.kv_slots) != chunk.num_tokens:
            raise ValueError(
                f"chunk for slot {chunk.req_slot}: {len(chunk.kv_slots)} kv slots "
                f"for {chunk.num_tokens} tokens"
            )
        if chunk.num_draft:
            if chunk.num_tokens != chunk.num_draft + 1:
                raise ValueError(
                    f"verify chunk for slot {chunk.req_slot}: {chunk.num_tokens} rows "
                    f"for {chunk.num_draft} drafts"
                )
            ids.append(requests.token_ids[chunk.req_slot, chunk.start : chunk.start + 1])
            ids.append(requests.draft_tokens[chunk.req_slot, : chunk.num_draft])
        else:
            ids.append(requests.token_ids[chunk.req_slot, chunk.start : end])
        positions.append(torch.arange(chunk.start, end, device=device))
        kv = to_device(chunk.kv_slots, torch.int64, device)
        requests.req_to_token[chunk.req_slot, chunk.start : end] = kv.to(torch.int32)
        kv_slots.append(kv)
        cu.append(cu[-1] + chunk.num_tokens)
        seq_lens.append(end)
        q_lens.append(chunk.num_tokens)
        req_slots.append(chunk.req_slot)
        if chunk.sample:
            rows = chunk.num_draft + 1
            sample_rows.append((len(logits_indices), rows))
            logits_indices.extend(range(cu[-1] - rows, cu[-1]))

    def t(values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, device)

    num_plain = sum(1 for c in chunks if not c.num_draft)
    ctx = ForwardContext(
        req_slots=t(req_slots),
        cu_seqlens_q=t(cu),
        seq_lens=t(seq_lens),
        has_initial_state=t([c.start for c in chunks]) > 0,
        out_kv_slots=torch.cat(kv_slots),
        req_to_token=requests.req_to_token,
        q_lens=q_lens,
        all_decode=all(n == 1 for n in q_lens),
        num_plain_reqs=num_plain,
        num_plain_tokens=cu[num_plain],
    )
    return StepBatch(
        chunks, torch.cat(ids), torch.cat(positions), ctx, t(logits_indices), sample_rows
    )
