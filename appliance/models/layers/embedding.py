"""Vocab-parallel token embedding and LM head: each TP rank holds a contiguous slice of the
vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.layers.linear import copy_into
from appliance.models.layers.parallel import all_gather_last, all_reduce, tp_rank, tp_size


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
        logits = F.linear(hidden, self.weight)
        return all_gather_last(logits)[:, : self.vocab]
