"""Body of one TP rank for tests/models/test_tp.py (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from appliance.config import EngineConfig, ModelConfig, SchedulerConfig
from appliance.engine.runner import ModelRunner
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk, StepPlan


def engine_config(ckpt: str, mtp_step: int = 0) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_dir=ckpt, max_model_len=512),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=2048, mtp_step=mtp_step),
    )


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefill every prompt in one step, then `steps` greedy decodes; returns the first-step logits
    of every prompt's last position and every generated token."""
    new, chunks, next_kv = [], [], 0
    for slot, p in enumerate(prompts):
        new.append(NewRequest(slot, p, SamplingOptions(temperature=0.0)))
        chunks.append(ScheduledChunk(slot, 0, len(p), list(range(next_kv, next_kv + len(p))), True))
        next_kv += len(p)
    logits = []
    original = runner.model.compute_logits

    def capture(hidden):
        out = original(hidden)
        logits.append(out.clone())
        return out

    runner.model.compute_logits = capture
    result = runner.execute(StepPlan(0, new, chunks, []))
    tokens = [[s.token_ids[0]] for s in result.sampled]
    for step in range(1, steps):
        chunks = []
        for slot, p in enumerate(prompts):
            start = len(p) + step - 1
            chunks.append(ScheduledChunk(slot, start, 1, [next_kv], True))
            next_kv += 1
        result = runner.execute(StepPlan(step, [], chunks, []))
        for slot, s in enumerate(result.sampled):
            tokens[slot].append(s.token_ids[0])
    runner.model.compute_logits = original
    return logits[0].cpu(), tokens


def rank_main(rank: int, world: int, init: str, ckpt: str, prompts, steps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    runner = ModelRunner(engine_config(ckpt), rank, world)
    logits, tokens = greedy_run(runner, prompts, steps)
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens}, out)
    dist.barrier()
    dist.destroy_process_group()
