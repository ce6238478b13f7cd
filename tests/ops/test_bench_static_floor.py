"""ops/bench/bench_static.py's HBM floor counts the bytes a decode step reads: the LM head whole,
the input embedding table only as the batch's rows (unless it is tied to the head)."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.layers.embedding import LMHead, VocabEmbedding
from ops.bench.bench_static import active_weight_bytes


def tiny(tied: bool) -> nn.Module:
    parts = {"embed": VocabEmbedding(1000, 64), "proj": nn.Linear(64, 64, bias=False)}
    model = nn.ModuleDict(parts | {"head": LMHead(1000, 64)}).to(torch.bfloat16)
    if tied:
        model["head"].weight = model["embed"].weight
    return model


def test_the_embedding_table_counts_only_its_rows():
    table, proj, row = 1000 * 64 * 2, 64 * 64 * 2, 64 * 2
    assert active_weight_bytes(tiny(tied=False), 1) == table + proj + row
    assert active_weight_bytes(tiny(tied=False), 16) == table + proj + 16 * row


def test_a_table_tied_to_the_head_is_read_whole():
    assert active_weight_bytes(tiny(tied=True), 4) == 1000 * 64 * 2 + 64 * 64 * 2
