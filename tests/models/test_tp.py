"""Tensor parallelism over gloo on CPU: TP=2 gives TP=1's logits (within fp32 reduction noise) and
the same greedy tokens, for dense and MoE Qwen3.5 (weights sharded by each layer's loader)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from tp_worker import engine_config, greedy_run, rank_main

from appliance.engine.runner import ModelRunner


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 33, 80)]


def run_tp2(ckpt, ps, steps, tmp_path):
    out = tmp_path / "tp2.pt"
    init = f"file://{tmp_path}/dist_init"
    mp.start_processes(
        rank_main,
        args=(2, init, str(ckpt), ps, steps, str(out)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return torch.load(out)


def check(ckpt, tmp_path):
    runner = ModelRunner(engine_config(str(ckpt)))
    ps = prompts(runner.text_config.vocab_size)
    logits1, tokens1 = greedy_run(runner, ps, steps=12)
    tp2 = run_tp2(ckpt, ps, 12, tmp_path)
    torch.testing.assert_close(tp2["logits"], logits1, atol=1e-4, rtol=0)
    assert tp2["tokens"] == tokens1


def test_tp2_dense_matches_tp1(tiny_dense, tmp_path):
    check(tiny_dense, tmp_path)


def test_tp2_moe_matches_tp1(tiny_moe, tmp_path):
    check(tiny_moe, tmp_path)
