"""Prompt logprobs (SamplingParams.prompt_logprobs, the engine side of completions echo +
logprobs) equal the log-softmax of transformers' forward on the tiny checkpoint: prompts prefilled
in one chunk and in many, under KV pressure that preempts and recomputes them, and alone."""

from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.testing.oracle import hf_logits


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers' teacher-forced logits."""
    logprobs = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)  # [L, V]
    return [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def hf_rank_bounds(model_dir, prompt: list[int], tol: float) -> list[tuple[int, int]]:
    """For i >= 1, the vocabulary ranks prompt[i] may have (1 + the ids scored strictly higher)
    when every logprob may be off by `tol`: (ids surely higher, ids possibly higher) + 1."""
    logprobs = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)  # [L, V]
    bounds = []
    for i in range(1, len(prompt)):
        row, own = logprobs[i - 1], logprobs[i - 1, prompt[i]]
        bounds.append((1 + int((row > own + tol).sum()), 1 + int((row > own - tol).sum())))
    return bounds


def check_ranks(model_dir, prompt: list[int], dicts, k: int, tol: float) -> None:
    """Each prompt token's rank is its place in the whole vocabulary (vLLM's Logprob.rank: past
    k where it is not among the top k), its alternatives' 1..k."""
    bounds = hf_rank_bounds(model_dir, prompt, tol)
    ranks = [d[t].rank for t, d in zip(prompt[1:], dicts[1:], strict=True)]
    assert all(low <= rank <= high for rank, (low, high) in zip(ranks, bounds)), (ranks, bounds)
    assert len(prompt) < 3 or any(rank > k + 1 for rank in ranks)  # random: some far down
    for token, d, rank in zip(prompt[1:], dicts[1:], ranks):
        others = sorted(lp.rank for t, lp in d.items() if t != token)
        assert others == [r for r in range(1, k + 1) if r != rank or rank > k]


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=2048, num_kv_slots=2048),  # one chunk each
        dict(max_num_batched_tokens=7, num_kv_slots=2048),  # many chunks, a row in two steps
        dict(max_num_batched_tokens=16, num_kv_slots=96),  # chunks + preemption (recompute)
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(tiny_dense, options):
    check_prompt_logprobs(tiny_dense, dict(device="cpu", **options), abs_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_match_transformers_on_cuda(tiny_dense):
    """The CUDA path (Triton attention over chunks, the device top-k), in fp32 (ieee dots)."""
    options = dict(device="cuda", dtype="float32", max_num_batched_tokens=16, num_kv_slots=96)
    check_prompt_logprobs(tiny_dense, options, abs_tol=1e-3)


def prompt_token_logprobs(out) -> list[float | None]:
    """Each prompt token's own logprob from vLLM's per-position {id: Logprob} dicts."""
    ids, dicts = out.prompt_token_ids, out.prompt_logprobs
    return [None if d is None else d[t].logprob for t, d in zip(ids, dicts, strict=True)]


def check_prompt_logprobs(tiny_dense, options: dict, abs_tol: float) -> None:
    llm = LLM(str(tiny_dense), max_num_seqs=4, max_model_len=128, **options)
    prompts = [list(range(40, 90)), [7, 300, 5], [11], list(range(900, 860, -1))]
    tops = (0, 5, 1, 20)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=k)
        for k in tops
    ]
    outs = llm.generate(prompts, params)
    for prompt, out, k in zip(prompts, outs, tops, strict=True):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        expected = hf_prompt_logprobs(tiny_dense, prompt)
        assert prompt_token_logprobs(out)[1:] == pytest.approx(expected, abs=abs_tol)
        assert all(max(k, 1) <= len(d) <= k + 1 for d in out.prompt_logprobs[1:])
        check_ranks(tiny_dense, prompt, out.prompt_logprobs, k, tol=10 * abs_tol)
        assert len(out.token_ids) == 24
    if options["num_kv_slots"] < 100:
        assert llm.scheduler.stats().num_preemptions > 0
    stats = llm.scheduler.stats()
    assert stats.kv_used == 0 and stats.state_used == 0
    # without the option nothing is scored
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None
    # a prompt the prefix cache holds (the plain run above saved prompts[0]'s end) is still
    # scored whole: a scored prompt takes no cache hit
    longer = prompts[0] + [5, 6, 7]
    hits = llm.scheduler.stats().prefix_cache_hits
    llm.generate(longer, SamplingParams(max_tokens=2, temperature=0))
    assert llm.scheduler.stats().prefix_cache_hits > hits  # a plain request hits
    scored = llm.generate(longer, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert prompt_token_logprobs(scored[0])[1:] == pytest.approx(
        hf_prompt_logprobs(tiny_dense, longer), abs=abs_tol
    )
