"""The context the worker reports (and the server advertises) never exceeds what its KV pool can
hold, so a request that asks for the whole context (no max_tokens) is admitted, not refused."""

from __future__ import annotations

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig, ModelConfig, SchedulerConfig
from appliance.engine.runner import ModelRunner


def test_max_model_len_is_capped_by_the_kv_pool(tiny_dense):
    config = EngineConfig(
        model=ModelConfig(model_dir=str(tiny_dense), max_model_len=1024),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=300),
    )
    runner = ModelRunner(config)
    assert (runner.num_kv_slots, runner.max_model_len) == (300, 300)
    # the request table is as wide as the context served, not the one asked for
    assert runner.requests.req_to_token.shape == (4, 300)
    assert runner.requests.token_ids.shape == (4, 301)
    roomy = ModelRunner(
        EngineConfig(
            model=ModelConfig(model_dir=str(tiny_dense), max_model_len=256),
            scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=300),
        )
    )
    assert roomy.max_model_len == 256  # a pool that holds the context leaves it alone


def test_a_request_for_the_whole_context_is_admitted(tiny_dense):
    llm = LLM(str(tiny_dense), max_model_len=4096, num_kv_slots=64, max_num_seqs=2)
    assert llm.scheduler.max_model_len == 64
    prompt = list(range(10, 30))
    # what the server sends for a request without max_tokens: the rest of the context
    out = llm.generate(prompt, SamplingParams(max_tokens=64 - len(prompt), temperature=0))[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 44
