"""The offline `LLM` and the served path end requests the same way: the same prompt and sampling
parameters give the same tokens, text, finish reason and token count, with stop token ids, stop
strings (split across tokens or not, kept or cut), eos and length limits, greedy and seeded."""

from __future__ import annotations

import openai
import pytest

from appliance import LLM, SamplingParams

PROMPTS = [[11, 300, 42, 7, 99], list(range(100, 130)), [5, 6, 7]]


@pytest.fixture(scope="module")
def sdk(appliance):
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_dense):
    return LLM(str(tiny_dense), max_model_len=512)


def _served(sdk, prompt: list[int], params: SamplingParams):
    extra = {"ignore_eos": params.ignore_eos, "stop_token_ids": params.stop_token_ids}
    extra |= {"top_k": params.top_k, "min_p": params.min_p}  # every sampling field: no defaults
    extra["repetition_penalty"] = params.repetition_penalty
    if params.include_stop_str_in_output:
        extra["include_stop_str_in_output"] = True
    out = sdk.completions.create(
        model=sdk.models.list().data[0].id,
        prompt=prompt,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop or None,
        extra_body=extra,
    )
    choice = out.choices[0]
    return choice.text, choice.finish_reason, out.usage.completion_tokens


def _cases(llm) -> list[tuple[list[int], SamplingParams]]:
    """Stop ids and strings taken from each prompt's own free-running continuation."""
    cases = []
    for seed, prompt in enumerate(PROMPTS):
        for temperature in (0.0, 1.0):
            base = dict(max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True)
            free = llm.generate(prompt, SamplingParams(**base))[0]
            text = free.text
            cases.append((prompt, SamplingParams(**base)))
            cases.append((prompt, SamplingParams(**base, stop_token_ids=[free.token_ids[5]])))
            if len(text) > 8:
                stop = text[len(text) // 2 : len(text) // 2 + 3]
                cases.append((prompt, SamplingParams(**base, stop=[stop])))
                cases.append(
                    (prompt, SamplingParams(**base, stop=[stop], include_stop_str_in_output=True))
                )
            cases.append((prompt, SamplingParams(**{**base, "ignore_eos": False})))
    return cases


def test_offline_and_served_agree_on_every_way_to_end(sdk, llm):
    cases = _cases(llm)
    assert len(cases) >= 20
    ends = set()
    for prompt, params in cases:
        ref = llm.generate(prompt, params)[0]
        text, finish, num_tokens = _served(sdk, prompt, params)
        assert (text, finish, num_tokens) == (ref.text, ref.finish_reason, len(ref.token_ids)), (
            prompt,
            params,
        )
        ends.add(finish)
    assert ends >= {"stop", "length"}
    stats = llm.scheduler.stats()
    assert stats.kv_used == 0 and stats.state_used == 0 and stats.num_running == 0
