"""Vocab-parallel token embedding and LM head: each TP rank holds a contiguous slice of the
vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.layers.linear import copy_into
from appliance.models.layers.parallel import all_gather_last, all_reduce, tp_rank, tp_size
from appliance_kernels.fp8_gemv import linear


def _padded(vocab: int) -> int:
    size = tp_size()
    return (vocab + size - 1) // size * size


class _VocabShard(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab = vocab
        per = _padded(vocab) // tp_size()
        self.start = tp_rank() * per
        self.end = self.start + per
        self.weight = nn.Parameter(torch.empty(per, hidden), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab:
            raise ValueError(f"vocab mismatch: checkpoint {loaded.shape[0]} vs config {self.vocab}")
        part = loaded[self.start : min(self.end, self.vocab)]
        with torch.no_grad():
            param.zero_()
        copy_into(param[: part.shape[0]], part)


class VocabEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return all_reduce(out)


class LMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, vocab]
        logits = linear(hidden, self.weight)
        return all_gather_last(logits)[:, : self.vocab]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, vocab], cast straight into `out` when given (the persistent
        buffer the fused MTP step's graphs share)."""
        if out is None:
            return self(hidden).float()
        return out.copy_(self(hidden))

    def argmax(self, hidden: torch.Tensor, limit: int = 0) -> torch.Tensor:
        """[N, H] -> [N] int64: the most likely id among the first `limit` ids (0: all), ties to
        the lowest id, without gathering the logits (each rank sends its best value and id)."""
        limit = min(limit or self.vocab, self.vocab)
        rows = max(0, min(limit - self.start, self.weight.shape[0]))
        if tp_size() == 1:
            return linear(hidden, self.weight[:rows]).argmax(-1)
        n = hidden.shape[0]
        if rows:
            best, ids = linear(hidden, self.weight[:rows]).float().max(-1)
        else:  # this rank holds none of the first `limit` ids
            best = torch.full((n,), float("-inf"), device=hidden.device)
            ids = torch.zeros(n, dtype=torch.int64, device=hidden.device)
        pair = torch.stack([best, (ids + self.start).float()], dim=-1)  # ids < 2**24: exact
        gathered = all_gather_last(pair).view(n, tp_size(), 2)  # ranks in id order
        winner = gathered[..., 0].argmax(-1)  # the first best: the lowest id on ties
        return gathered[torch.arange(n, device=hidden.device), winner, 1].long()
