"""SGLang's native API through the real processes on the tiny dense checkpoint: greedy /generate
gives the tokens (and logprobs) greedy /v1/completions gives for the same prompt ids, streamed and
collected alike, and /health_generate runs its token through the engine."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

PROMPT = "def f(x):\n    return"


@pytest.fixture(scope="module")
def http(appliance):
    with httpx.Client(base_url=appliance.url, timeout=60) as client:
        yield client


def test_generate_matches_completions_and_health_generate(http, tiny_dense):
    prompt_ids = AutoTokenizer.from_pretrained(tiny_dense).encode(PROMPT, add_special_tokens=False)
    completion = {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0}
    completion |= {"logprobs": 0, "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json=completion)
    assert r.status_code == 200, r.text
    assert "metrics" not in r.json()  # vLLM's per-request metrics are off by default
    logprobs = r.json()["choices"][0]["logprobs"]
    expected = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    sampling = {"max_new_tokens": 8, "temperature": 0}
    body = {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["output_ids"] == expected
    meta = answer["meta_info"]
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == len(expected)
    assert not any(key.startswith("spec_") for key in meta)  # MTP is off here, as SGLang's
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        logprobs["token_logprobs"], abs=1e-5
    )
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == expected and last["text"] == answer["text"]
    assert http.get("/health_generate").status_code == 200
