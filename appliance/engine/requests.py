"""The worker's request table: what the worker keeps per request, indexed by request slot (known
tokens, MTP drafts, KV slot of each position, prompt length, sampling options). The runner admits
and releases rows from each StepPlan; the batch builder, the sampler call and MTP accept/commit
(appliance/engine/mtp.py) read and write them.

Device tensors are allocated once with one row per request slot, so their addresses stay fixed for
CUDA graphs; host mirrors keep what the host still reads every step (lengths to slice and offset by,
the options the eager sampler needs). A row's values are stale after release until the slot is
admitted again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from appliance.engine.transfer import to_device
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int64(value: int) -> int:
    """Clamped into int64: the eager sampler rejects what does not fit only when it samples, so
    admission must not fail on it (a larger top_k means the same as the largest)."""
    return min(max(value, _INT64_MIN), _INT64_MAX)


class RequestTable:
    """Per-request state of one worker: one row per request slot (`max_num_seqs` rows)."""

    def __init__(
        self, num_slots: int, max_model_len: int, mtp_step: int, device: torch.device
    ) -> None:
        self.num_slots, self.mtp_step, self.device = num_slots, mtp_step, device

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(num_slots, *shape, dtype=dtype, device=device)

        # Written before read (positions < known length only), so left uninitialised: with a long
        # context the untouched tail never costs memory on the host.
        self.token_ids = torch.empty(  # [R, L + 1] every known token, then the next one sampled
            num_slots, max_model_len + 1, dtype=torch.int64, device=device
        )
        self.req_to_token = torch.empty(  # [R, L] KV slot of every computed position
            num_slots, max_model_len, dtype=torch.int32, device=device
        )
        self.draft_tokens = zeros(torch.int64, max(1, mtp_step))  # [R, k] next step's MTP drafts
        self.num_tokens = zeros(torch.int64)  # [R] tokens known to this worker
        self.prompt_len = zeros(torch.int64)  # [R] leading prompt tokens (penalties count outputs)
        self.temperature = zeros(torch.float32)  # [R]
        self.top_k = zeros(torch.int64)  # [R] -1 = off
        self.top_p = zeros(torch.float32)  # [R]
        self.min_p = zeros(torch.float32)  # [R]
        self.seed = zeros(torch.int64)  # [R] 0 where the request has none (greedy)
        # host mirrors
        self.options: list[SamplingOptions | None] = [None] * num_slots  # None: slot is free
        self.num_tokens_host = [0] * num_slots
        self.prompt_len_host = [0] * num_slots
        self.num_draft = [0] * num_slots  # MTP drafts per step (0: the request decodes plainly)
        self.admissions = [
            0
        ] * num_slots  # admissions per slot so far (tells reuses of a slot apart)

    # ------------------------------------------------------------------ admission
    def admit(self, requests: Sequence[NewRequest]) -> None:
        """Rows for the plan's new requests: their known tokens and per-request knobs."""
        if not requests:
            return
        for req in requests:
            if req.num_draft and not self.mtp_step:
                raise ValueError(f"slot {req.req_slot}: MTP requested but the worker has none")
        ints, floats = [], []
        for req in requests:
            slot, n, opts = req.req_slot, len(req.token_ids), req.sampling
            prompt_len = req.num_prompt_tokens if req.num_prompt_tokens >= 0 else n
            self.token_ids[slot, :n] = to_device(req.token_ids, torch.int64, self.device)
            if req.cached_kv_slots:  # a prefix-cache hit: these positions are computed already
                cached = to_device(req.cached_kv_slots, torch.int32, self.device)
                self.req_to_token[slot, : cached.numel()] = cached
            self.options[slot] = opts
            self.num_tokens_host[slot] = n
            self.prompt_len_host[slot] = prompt_len
            self.num_draft[slot] = req.num_draft
            self.admissions[slot] += 1
            ints.append([slot, n, prompt_len, _int64(opts.top_k), _int64(opts.seed or 0)])
            floats.append([opts.temperature, opts.top_p, opts.min_p])
        packed = to_device(ints, torch.int64, self.device)  # [N, 5]
        knobs = to_device(floats, torch.float32, self.device)  # [N, 3]
        slots = packed[:, 0]
        self.num_tokens[slots] = packed[:, 1]
        self.prompt_len[slots] = packed[:, 2]
        self.top_k[slots] = packed[:, 3]
        self.seed[slots] = packed[:, 4]
        self.temperature[slots] = knobs[:, 0]
        self.top_p[slots] = knobs[:, 1]
        self.min_p[slots] = knobs[:, 2]

    def release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.options[slot] = None
            self.num_tokens_host[slot] = 0
            self.prompt_len_host[slot] = 0
            self.num_draft[slot] = 0

    # ------------------------------------------------------------------ per step
    def uses_mtp(self, slot: int) -> bool:
        return self.num_draft[slot] > 0

    @staticmethod
    def known_before_sampling(chunk: ScheduledChunk) -> int:
        """Tokens known when the chunk's first sampled row is sampled (its sampling offset): a plain
        chunk samples the token after its last row; a verify chunk restarts from its first row,
        the last token known when it was planned."""
        return chunk.start + 1 if chunk.num_draft else chunk.start + chunk.num_tokens

    def lengths_on_collect(self, slots: list[int]) -> Callable[[list[int]], None]:
        """For a step whose lengths the host learns only when its result arrives (MTP on the
        device): a function that records them in the host mirror, skipping slots released (or
        given to another request) since the step was launched."""
        admitted = [self.admissions[slot] for slot in slots]

        def record(lengths: list[int]) -> None:
            for slot, epoch, length in zip(slots, admitted, lengths):
                if self.admissions[slot] == epoch and self.options[slot] is not None:
                    self.num_tokens_host[slot] = length

        return record

    def write_sampled(
        self, slots: list[int], positions: list[int], token_ids: torch.Tensor
    ) -> None:
        """token_ids [S] (on the device, not read by the host) become the token at positions[i] of
        request slots[i], which then knows positions[i] + 1 tokens: the next step reads them from
        here without a round trip through the host."""
        if not slots:
            return
        where = to_device([slots, positions], torch.int64, self.device)  # [2, S]
        self.token_ids[where[0], where[1]] = token_ids
        self.num_tokens[where[0]] = where[1] + 1
        for slot, position in zip(slots, positions):
            self.num_tokens_host[slot] = position + 1

    def append(self, slots: list[int], starts: list[int], tokens: list[list[int]]) -> None:
        """Write tokens[i] at positions starts[i].. of request slots[i]; it then knows starts[i] +
        len(tokens[i]) tokens. One scatter for all requests of the step."""
        if not slots:
            return
        rows = [slot for slot, new in zip(slots, tokens) for _ in new]
        cols = [start + j for start, new in zip(starts, tokens) for j in range(len(new))]
        flat = [t for new in tokens for t in new]
        ends = [start + len(new) for start, new in zip(starts, tokens)]
        writes = to_device([rows, cols, flat], torch.int64, self.device)  # [3, N]
        self.token_ids[writes[0], writes[1]] = writes[2]
        lengths = to_device([slots, ends], torch.int64, self.device)  # [2, B]
        self.num_tokens[lengths[0]] = lengths[1]
        for slot, end in zip(slots, ends):
            self.num_tokens_host[slot] = end
