"""What each sampled row of a step needs besides its logits, and the edits of the fused MTP step.

`sampling_rows` lists, per sampled row (a plain chunk's last row, or each of a verify chunk's
k + 1 rows), the request's options, its token history, the offset of the token it samples and the
prompt length. A verify row j samples the token after drafts 1..j, so its history ends with them:
penalties count them and bad words match them as if accepted (if one is not, the rows after it
are discarded anyway), which keeps MTP lossless for such requests.

`VerifyEdits` is the part of that the fused MTP step (engine/mtp_graphs.py) cannot do inside its
graphs: for requests with penalties, a logit bias, allowed ids, bad words, a min_tokens ban or
logprobs, `apply` edits their verify rows in place between the step's forward and its sampling
(the same edits as the eager sampler, engine/sampler.py), and `pack` gathers the logprobs of the
samples, copied to the host with them. All of it is queued on the device; nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from appliance.engine.logprobs_mode import reported
from appliance.engine.requests import RequestTable
from appliance.engine.sampler import (
    edit_logits,
    needs_edits,
    needs_history,
    pack_logprobs,
)
from appliance.engine.transfer import to_device
from appliance.messages import SamplingOptions, ScheduledChunk


@dataclass
class SamplingRows:
    """Per sampled row of a step, in order."""

    options: list[SamplingOptions] = field(default_factory=list)
    histories: list[torch.Tensor] = field(default_factory=list)  # [L_i] on the table's device
    offsets: list[int] = field(default_factory=list)  # index of the token being sampled
    prompt_lens: list[int] = field(default_factory=list)


def sampling_rows(chunks: list[ScheduledChunk], table: RequestTable) -> SamplingRows:
    """The sampled rows of `chunks` (each chunk samples 1 + num_draft rows)."""
    out = SamplingRows()
    for chunk in chunks:
        slot = chunk.req_slot
        options = table.options[slot]
        known = table.known_before_sampling(chunk)
        history = table.token_ids[slot, :known]
        drafted = chunk.num_draft and needs_history(options)
        for j in range(chunk.num_draft + 1):
            out.options.append(options)
            if drafted and j:  # verify row j follows drafts 1..j
                out.histories.append(torch.cat((history, table.draft_tokens[slot, :j])))
            else:
                out.histories.append(history)
            out.offsets.append(known + j)
            out.prompt_lens.append(table.prompt_len_host[slot])
    return out


@dataclass
class VerifyEdits:
    """The edited verify rows of a fused MTP step (k + 1 rows a request, in chunk order)."""

    rows: int  # k + 1
    chunks: list[int]  # indices of the step's chunks whose rows are edited
    inputs: SamplingRows  # of those chunks' rows, in order
    scored: list[int]  # indices into `chunks` of the requests reporting logprobs
    mode: str = "raw_logprobs"  # what they report (ModelConfig.logprobs_mode)
    lp: torch.Tensor | None = None  # [len(scored) * rows, V]: set by apply

    @classmethod
    def of(
        cls, chunks: list[ScheduledChunk], table: RequestTable, mode: str = "raw_logprobs"
    ) -> VerifyEdits | None:
        """The step's edits; None when every request samples with its knobs alone."""
        picked = [
            i
            for i, c in enumerate(chunks)
            if needs_edits(
                table.options[c.req_slot],
                table.known_before_sampling(c) - table.prompt_len_host[c.req_slot],
            )
        ]
        if not picked:
            return None
        options = [table.options[chunks[i].req_slot] for i in picked]
        scored = [p for p, o in enumerate(options) if o.logprobs is not None]
        rows = chunks[picked[0]].num_draft + 1
        inputs = sampling_rows([chunks[i] for i in picked], table)
        return cls(rows, picked, inputs, scored, mode)

    def row_index(self, picked: list[int]) -> list[int]:
        """The step's logits rows of the chunks at `picked` (indices into the step's chunks)."""
        return [i * self.rows + j for i in picked for j in range(self.rows)]

    def apply(self, logits: torch.Tensor, masks: torch.Tensor | None) -> None:
        """Edits the step's verify logits [n * rows, V] in place (their grammar masks [n * rows,
        words] on the device, or None); keeps what the scored rows report (their logprobs, by
        the mode: engine/logprobs_mode.py) for `pack`."""
        index = to_device(self.row_index(self.chunks), torch.long, logits.device)
        rows = self.inputs
        sub = logits[index]
        raw = sub
        if masks is not None and self.scored and self.mode.startswith("raw"):
            raw = sub.clone()  # the grammar's mask is applied to `sub` in place on CUDA
        edited = edit_logits(
            sub,
            rows.options,
            rows.histories,
            rows.offsets,
            rows.prompt_lens,
            None if masks is None else masks[index],
        )
        if edited is not sub:  # only logprobs (or a mask, which the sampling graph applies)
            logits[index] = edited
        if self.scored:
            picked = self.row_index(self.scored)
            mine = to_device(picked, torch.long, logits.device)
            options = [rows.options[k] for k in picked]
            self.lp = reported(raw[mine], edited[mine], options, self.mode)

    def pack(self, samples: torch.Tensor) -> torch.Tensor | None:
        """The scored requests' logprobs of their samples [n, rows] (rows beyond the accepted run
        included): [len(scored) * rows, 1 + 2 * the most asked] (sampler.pack_logprobs), or None."""
        if self.lp is None:
            return None
        requests = self.scored_requests()
        index = to_device(self.row_index([i for i, _ in requests]), torch.long, samples.device)
        tops = [top for _, top in requests for _ in range(self.rows)]
        return pack_logprobs(self.lp, samples[:, : self.rows].reshape(-1)[index], tops)

    def scored_requests(self) -> list[tuple[int, int]]:
        """(index into the step's chunks, top logprobs asked) of each scored request, in order."""
        return [(self.chunks[p], self.inputs.options[p * self.rows].logprobs) for p in self.scored]
