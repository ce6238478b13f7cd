"""Scheduler + real Sampler: seeds drawn at admission, position offsets and NewRequest's prompt
length make sampled (and penalised) output identical with and without preemption."""

from __future__ import annotations

import torch
from fake_worker import FakeWorker, make_scheduler, prompt_of, req, run

from appliance.engine.sampler import Sampler
from appliance.messages import SamplingOptions

VOCAB = 64
_sampler = Sampler()


def model_logits(tokens: list[int]) -> torch.Tensor:
    """A fake LM: logits [1, VOCAB] drawn from a generator keyed by the whole history."""
    key = 0
    for t in tokens:
        key = (key * 1_000_003 + t + 1) % (2**61 - 1)
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(key)) * 2


def sample_fn(tokens: list[int], sampling: SamplingOptions, num_prompt: int) -> int:
    # offset = position of the token being sampled, as the worker is told to pass
    history = [torch.tensor(tokens)]
    out = _sampler.sample(model_logits(tokens), [sampling], history, [len(tokens)], [num_prompt])
    return int(out.token_ids.item())


def generate(num_kv_slots: int, budget: int) -> tuple[dict[str, list[int]], int]:
    sched = make_scheduler(num_kv_slots=num_kv_slots, budget=budget, decode_reserve=0)
    options = [
        SamplingOptions(temperature=1.0),  # seed drawn by the scheduler
        SamplingOptions(temperature=0.7, top_p=0.9, seed=5),
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.3, top_k=10, min_p=0.02, presence_penalty=1.0),
        SamplingOptions(temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.2),
        SamplingOptions(temperature=1.0),
    ]
    for i, sampling in enumerate(options):
        prompt = prompt_of(8, 0) if i == 5 else prompt_of(8 + i, i)  # r5 repeats r0's prompt
        sched.add_request(req(f"r{i}", prompt, max_tokens=24, sampling=sampling))
    out = run(sched, FakeWorker(num_kv_slots, sample_fn))
    return dict(out.tokens), sched.stats().num_preemptions


def test_sampled_tokens_survive_preemption() -> None:
    free, free_preemptions = generate(num_kv_slots=1000, budget=64)
    tight, tight_preemptions = generate(num_kv_slots=48, budget=7)
    assert free_preemptions == 0 and tight_preemptions > 0
    assert tight == free
    assert free["r0"] != free["r5"]  # same prompt, distinct drawn seeds
