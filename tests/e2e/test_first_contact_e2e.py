"""Issue 17 items 5 and 6 against a live appliance (real processes, tiny dense checkpoint with its
MTP head on, `--mtp-step 1`, prefill in chunks of 32 tokens), through the `openai` SDK: /v1/models
agrees with /health while the appliance starts, logit_bias reaches the worker's sampler (forced and
banned tokens, no MTP drafts for such requests), echo + logprobs scores the prompt as transformers
does (max_tokens 0 included), and a client that leaves mid-stream shows in the access log and the
metrics."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from appliance.testing.oracle import hf_logits
from tests.e2e.live import free_port, start_appliance
from tests.e2e.scoring import assert_scored_like_transformers

PROMPT = "def f(x):"


def _poll_models_then_health(url: str, seen: list, stop: threading.Event) -> None:
    """Records (models status, models body, health status) pairs; /v1/models first, so a
    ready model list must be followed by a ready /health (readiness only goes up at startup)."""
    with httpx.Client(timeout=2) as http:
        while not stop.is_set():
            try:
                models = http.get(f"{url}/v1/models")
                health = http.get(f"{url}/health")
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((models.status_code, models.json(), health.status_code))
            time.sleep(0.02)


@pytest.fixture(scope="module")
def started(tiny_dense, tmp_path_factory):
    """The appliance, and what /v1/models and /health answered while it started."""
    port = free_port()
    seen: list = []
    stop = threading.Event()
    poller = threading.Thread(
        target=_poll_models_then_health, args=(f"http://127.0.0.1:{port}", seen, stop)
    )
    poller.start()
    log = tmp_path_factory.mktemp("first_contact") / "appliance.log"
    try:
        app = start_appliance(
            tiny_dense, log, "--mtp-step", "1", "--max-num-batched-tokens", "32", port=port
        )
    finally:
        time.sleep(0.2)
        stop.set()
        poller.join(10)
    yield app, seen
    assert app.stop() == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def appliance(started):
    return started[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_dense):
    return AutoTokenizer.from_pretrained(tiny_dense)


def counter(metrics: str, name: str, labels: str = "") -> float:
    pattern = rf"^{name}{{([^}}]*)}} (\S+)$"
    return sum(float(v) for lab, v in re.findall(pattern, metrics, re.M) if labels in lab)


def scrape(appliance) -> str:
    return httpx.get(f"{appliance.url}/metrics", timeout=10).text


def test_models_agree_with_health_during_startup(started):
    _, seen = started
    assert any(health != 200 for _, _, health in seen), "the server answered only once ready"
    assert seen[-1][0] == 200, seen[-1]
    for status, body, health in seen:
        if status == 200:  # never a model list while /health says not ready
            assert health == 200 and body["data"][0]["max_model_len"] == 512, (body, health)
        else:
            assert status == 503, (status, body)
            assert body["error"]["type"] == "service_unavailable_error", body


def test_retrieve_model(sdk, model):
    card = sdk.models.retrieve(model)
    assert card.id == model and card.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("not-this-one")
    assert info.value.body["code"] == "model_not_found"


def _complete(sdk, model, **kw):
    return sdk.completions.create(model=model, prompt=PROMPT, logprobs=0, **kw).choices[0]


def test_logit_bias_forces_and_bans_tokens(sdk, model, tokenizer):
    forced = tokenizer.encode("x", add_special_tokens=False)[0]
    # the model's own logprobs of the forced tokens (the prompt + them, scored unbiased)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False) + [forced] * 3
    scored = sdk.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    own = scored.choices[0].logprobs.token_logprobs[-3:]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        choice = _complete(sdk, model, max_tokens=3, logit_bias={str(forced): 100}, **sampling)
        assert choice.text == tokenizer.decode([forced] * 3), sampling
        # logprobs are the model's own (vLLM's default --logprobs-mode raw_logprobs), not the
        # biased distribution's
        assert choice.logprobs.token_logprobs == pytest.approx(own, abs=1e-3), choice.logprobs
    greedy = _complete(sdk, model, max_tokens=1, temperature=0)
    first = greedy.logprobs.tokens[0]
    banned = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == first]
    assert banned, first
    again = _complete(sdk, model, max_tokens=1, temperature=0)
    assert again.logprobs.tokens[0] == first  # greedy is repeatable: the ban below is the change
    bias = {str(i): -100 for i in banned}
    choice = _complete(sdk, model, max_tokens=1, temperature=0, logit_bias=bias)
    assert choice.logprobs.tokens[0] != first


def test_logit_bias_outside_the_vocabulary_is_a_400(sdk, model, tokenizer):
    vocab = len(tokenizer)
    with pytest.raises(openai.BadRequestError) as info:
        _complete(sdk, model, max_tokens=1, logit_bias={str(vocab): 5})
    assert info.value.body["param"] == "logit_bias"
    assert f"token id {vocab} is outside the vocabulary" in info.value.body["message"]


def test_logit_bias_requests_draft_with_mtp(appliance, sdk, model, tokenizer):
    """A biased request drafts like any other (its verify rows are biased too): the bias wins
    every token and the appliance's draft counter grows."""
    other = tokenizer.encode("y", add_special_tokens=False)[0]
    drafts = counter(scrape(appliance), "appliance_mtp_drafts_total")
    out = sdk.completions.create(
        model=model, prompt="count", max_tokens=8, temperature=0, logit_bias={str(other): 100}
    )
    assert out.choices[0].text == "y" * 8
    assert counter(scrape(appliance), "appliance_mtp_drafts_total") > drafts


def test_echo_with_logprobs_scores_the_prompt(sdk, model, tokenizer, tiny_dense):
    prompt = list(range(50, 130))  # 80 tokens: three prefill chunks
    out = sdk.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=3, max_tokens=1, temperature=0
    )
    choice = out.choices[0]
    assert choice.text.startswith(tokenizer.decode(prompt))
    assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
    assert_scored_like_transformers(tiny_dense, prompt, choice.logprobs, 3)
    # the generated (greedy) token follows with its own logprob: the most likely one
    ref_last = torch.log_softmax(hf_logits(tiny_dense, prompt)[-1], dim=-1)
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(ref_last.max().item(), abs=1e-4)
    # max_tokens 0: only the prompt, scored; streamed alike
    text = "def f(x):\n    return x * 2\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    only = sdk.completions.create(model=model, prompt=text, echo=True, logprobs=2, max_tokens=0)
    assert only.choices[0].text == text and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0 and len(only.choices[0].logprobs.tokens) == len(ids)
    assert_scored_like_transformers(tiny_dense, ids, only.choices[0].logprobs, 2)
    stream = sdk.completions.create(
        model=model, prompt=text, echo=True, logprobs=2, max_tokens=0, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == only.choices[0].logprobs.token_logprobs


def test_client_gone_mid_stream_is_logged_and_counted(appliance, model):
    aborts = counter(scrape(appliance), "appliance_requests_finished_total", '"abort"')
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-request-id": "leaves-early"}
    with httpx.Client(timeout=60) as client:
        url = f"{appliance.url}/v1/chat/completions"
        with client.stream("POST", url, json=body, headers=headers) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]
    completion_id = re.search(r'"id": "(chatcmpl-[0-9a-f]+)"', "\n".join(first)).group(1)
    appliance.wait_idle(timeout_s=10)
    deadline = time.monotonic() + 10
    while "id=leaves-early" not in appliance.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = [x for x in appliance.log().splitlines() if "id=leaves-early" in x]
    assert f"completion={completion_id}" in line and line.endswith("aborted=client_gone"), line
    after = counter(scrape(appliance), "appliance_requests_finished_total", '"abort"')
    assert after == aborts + 1
