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
