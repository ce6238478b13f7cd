"""Per-step forward metadata: read by the attention / GDN layers and the Qwen3-VL deepstack, set by
the engine (`appliance/engine/batch.py`, the MTP drafter) around each forward.

`forward()` of a model takes ids, positions and embeddings only; everything about which requests,
slots and lengths the step covers is here (one object per step, built once on the device). It lives
with the models because the layers define what they read; the engine imports it from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class DeepstackInput:
    """Qwen3-VL deepstack: after decoder layer i, embeds[i] is added to the image-token rows."""

    rows: torch.Tensor  # [N] int64 batch rows that hold image tokens
    embeds: list[torch.Tensor]  # one [N, hidden] per deepstack layer (layer i gets embeds[i])


@dataclass
class ForwardContext:
    req_slots: torch.Tensor  # [B] request slot (row of req_to_token; also the state slot)
    cu_seqlens_q: torch.Tensor  # [B + 1] query rows per request in this step
    seq_lens: torch.Tensor  # [B] tokens in the KV after this step
    has_initial_state: torch.Tensor  # [B] bool: the request has earlier tokens (state to read)
    out_kv_slots: torch.Tensor  # [T] KV slot written by each computed token
    req_to_token: torch.Tensor  # [max_reqs, max_len] kv slot of every position
    q_lens: list[int]  # host copy of the per-request query lengths
    all_decode: bool  # every request computes exactly one token (recurrent GDN path)
    max_q_len: int | None = None  # host bound on rows per request (kernels avoid a device sync)
    num_plain_reqs: int = -1  # requests before the MTP verify requests (-1: all plain)
    num_plain_tokens: int = -1  # rows before the first verify row
    deepstack: DeepstackInput | None = None  # set by the runner for Qwen3-VL image rows

    def __post_init__(self) -> None:
        if self.max_q_len is None and self.q_lens:
            self.max_q_len = max(self.q_lens)
        if self.num_plain_reqs < 0:
            self.num_plain_reqs = len(self.q_lens)
            self.num_plain_tokens = sum(self.q_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @cached_property
    def verify_cu_seqlens(self) -> torch.Tensor:
        """The MTP verify requests' cumulative row counts from 0 at the first verify row: once a
        step for every GDN layer, and cu_seqlens_q itself (no kernel) in a step of verify rows
        only (the fused MTP step)."""
        cu = self.cu_seqlens_q[self.num_plain_reqs :]
        return cu - self.num_plain_tokens if self.num_plain_tokens else cu


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: layers must run inside forward_context()")
    return _current
