"""The official `openai` SDK against a live appliance (real processes, tiny dense checkpoint):
non-stream and stream agree, usage, stop strings, length, n, logprobs, 32 concurrent streams, parity
with the offline LLM and transformers, bad input, and slots freed on client disconnect."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSGS = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_dense):
    return AutoTokenizer.from_pretrained(str(tiny_dense))


def _greedy_chat(sdk, model, **kw):
    kw.setdefault("extra_body", NO_THINK)
    return sdk.chat.completions.create(model=model, messages=MSGS, temperature=0, **kw)


def test_models_endpoint(sdk, model, tiny_dense):
    assert model == tiny_dense.name
    card = sdk.models.list().data[0]
    assert card.owned_by == "appliance"


def test_non_stream_usage_and_stream_agree(sdk, model, tokenizer):
    out = _greedy_chat(sdk, model, max_tokens=24, extra_body={**NO_THINK, "ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    prompt = tokenizer.apply_chat_template(
        MSGS, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt,
        24,
        n_prompt + 24,
    )
    stream = sdk.chat.completions.create(
        model=model,
        messages=MSGS,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_string(sdk, model):
    full = (
        _greedy_chat(sdk, model, max_tokens=24, extra_body={**NO_THINK, "ignore_eos": True})
        .choices[0]
        .message.content
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = full[: full.find(stop)]
    out = sdk.chat.completions.create(
        model=model,
        messages=MSGS,
        temperature=0,
        max_tokens=24,
        stop=[stop],
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop  # vLLM's: what stopped it
    assert out.usage.completion_tokens < 24
    stream = sdk.chat.completions.create(
        model=model,
        messages=MSGS,
        temperature=0,
        max_tokens=24,
        stop=stop,
        stream=True,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_stop_reason_names_the_stop_token_and_nothing_else(sdk, model):
    """vLLM's stop_reason: the stop token id that ended a choice, null for a length finish (and
    for eos); "repetition_detected" for repetition_detection (test_repetition_detection...)."""
    free = sdk.completions.create(model=model, prompt=[5, 6, 7], max_tokens=8, temperature=0)
    assert free.choices[0].finish_reason == "length"
    assert free.choices[0].model_extra["stop_reason"] is None
    ids = (
        sdk.completions.create(
            model=model,
            prompt=[5, 6, 7],
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        .choices[0]
        .model_extra["token_ids"]
    )
    stop_id = ids[3]
    stopped = sdk.completions.create(
        model=model,
        prompt=[5, 6, 7],
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    first = ids.index(stop_id)
    assert (
        stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == first + 1
    )
    assert stopped.choices[0].model_extra["stop_reason"] == stop_id


def test_max_tokens_length_and_n(sdk, model):
    out = sdk.chat.completions.create(
        model=model,
        messages=MSGS,
        max_tokens=5,
        n=2,
        seed=3,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 10
    greedy = sdk.chat.completions.create(
        model=model, messages=MSGS, max_tokens=5, n=2, temperature=0, extra_body=NO_THINK
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_repetition_detection_ends_a_loop(sdk, model, appliance):
    """vLLM's repetition_detection: a loop the bias forces (one token again and again) ends
    after min_count repeats with finish_reason "repetition", streamed or not; without it the
    same request runs to max_tokens."""
    loop = dict(model=model, prompt=[5, 6, 7], max_tokens=20, temperature=0, logit_bias={"42": 100})
    detect = {"repetition_detection": {"max_pattern_size": 3, "min_count": 4}}
    out = sdk.completions.create(**loop, extra_body=detect)
    assert out.choices[0].finish_reason == "repetition" and out.usage.completion_tokens == 4
    assert out.choices[0].model_extra["stop_reason"] == "repetition_detected"
    chunks = list(sdk.completions.create(**loop, extra_body=detect, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "repetition"
    free = sdk.completions.create(**loop)
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 20
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(
            **loop, extra_body={"repetition_detection": {"min_count": 1, "max_pattern_size": 2}}
        )
    assert "repetition_detection" in str(err.value)
    metrics = httpx.get(f"{appliance.url}/metrics").text
    assert 'finish_reason="repetition"' in metrics


def test_logprobs_consistent_with_greedy(sdk, model):
    out = _greedy_chat(
        sdk,
        model,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == 8
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        best = max(e.top_logprobs, key=lambda t: t.logprob)
        assert best.token == e.token and best.logprob == pytest.approx(e.logprob, abs=1e-5)
        assert bytes(e.bytes) == e.token.encode() or "\ufffd" in e.token


def test_completions_token_ids_match_offline_llm_and_transformers(sdk, model, tiny_dense):
    from appliance import LLM, SamplingParams
    from appliance.testing.oracle import hf_greedy

    prompts = [[11, 300, 42, 7, 99], list(range(100, 140))]
    llm = LLM(str(tiny_dense), max_model_len=512)
    offline = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    )
    for prompt, ref in zip(prompts, offline, strict=True):
        out = sdk.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == ref.text
        ref_logprobs = [d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs, strict=True)]
        assert out.choices[0].logprobs.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        hf_tokens, gaps = hf_greedy(tiny_dense, prompt, 12)
        close = [i for i, g in enumerate(gaps) if g < 1e-3]
        if not close:  # a near-tie step may legitimately flip between implementations
            assert ref.token_ids == hf_tokens


async def _one_stream(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str, int]:
    kind = i % 4
    if kind == 3:
        stream = await client.completions.create(
            model=model,
            prompt=f"item {i}:",
            max_tokens=6 + i % 8,
            stream=True,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
        return text, finish, 6 + i % 8
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"request number {i}"}],
        max_tokens=4 + i % 8,
        stream=True,
        temperature=[0.0, 0.7, 1.0][kind],
        seed=i,
        stream_options={"include_usage": True},
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    text, finish, usage = "", None, None
    async for c in stream:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        if c.usage is not None:
            usage = c.usage
    assert usage is not None and usage.completion_tokens == 4 + i % 8
    return text, finish, 4 + i % 8


def test_32_concurrent_mixed_streams_then_slots_free(appliance, model):
    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{appliance.url}/v1", api_key="none", max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(*[_one_stream(client, model, i) for i in range(32)])
        finally:
            await client.close()

    results = asyncio.run(run())
    assert all(finish == "length" for _, finish, _ in results)
    status = appliance.wait_idle()
    router = status["router"]
    assert (router["kv_used"], router["state_used"], router["num_running"]) == (0, 0, 0)
    assert status["server"]["open_sequences"] == 0


BAD = [
    (b'{"messages": [', 400, None),
    (json.dumps({"temperature": 0}).encode(), 400, "messages"),
    (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
    (json.dumps({"messages": MSGS, "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": MSGS, "max_tokens": -4}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": MSGS, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": "no-such-model", "messages": MSGS}).encode(), 404, "model"),
    (
        json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}).encode(),
        400,
        "messages",
    ),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_then_good_request(appliance, sdk, model, body, status, param):
    r = httpx.post(
        f"{appliance.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if param == "messages" and status == 400 and b"word" in body:
        assert error["code"] == "context_length_exceeded"
        assert error["message"].startswith("This model's maximum context length is 512 tokens.")
    ok = _greedy_chat(sdk, model, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_sdk_raises_typed_errors(sdk, model):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MSGS, max_tokens=10_000)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 10000" in str(info.value)


def test_stream_disconnect_frees_slots(appliance, model):
    body = {
        "model": model,
        "messages": MSGS,
        "max_tokens": 400,
        "stream": True,
        **NO_THINK,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{appliance.url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any('"content"' in line for line in got)
            running = appliance.status()["router"]
            assert running["num_running"] == 1 and running["kv_used"] > 0
        # leaving the block closes the connection mid-stream
    start = time.monotonic()
    router = appliance.wait_idle(timeout_s=5)["router"]
    assert (router["kv_used"], router["state_used"], router["num_running"]) == (0, 0, 0)
    assert time.monotonic() - start < 5


def test_non_stream_disconnect_frees_slots(appliance, model):
    # the tiny model's context (512) allows ~480 tokens, ~1.4 s on a quiet 2-core box: the client
    # gives up well before (it once waited 1.5 s and got its 400 tokens)
    body = {"model": model, "messages": MSGS, "max_tokens": 480, **NO_THINK, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{appliance.url}/v1/chat/completions", json=body, timeout=0.4)
    router = appliance.wait_idle(timeout_s=5)["router"]
    assert (router["kv_used"], router["state_used"], router["num_running"]) == (0, 0, 0)


def test_a_shared_prefix_is_reported_as_cached_tokens(sdk, model):
    """Prefix caching (on by default): a prompt that extends an earlier one reuses its prefix, and
    usage.prompt_tokens_details.cached_tokens says how much (streamed usage too)."""
    first = [(7 * i + 3) % 1500 + 100 for i in range(40)]
    args = dict(model=model, temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    out = sdk.completions.create(prompt=first, **args)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [11, 12, 13]
    out = sdk.completions.create(prompt=second, **args)
    assert out.usage.prompt_tokens_details.cached_tokens == len(first)  # the prompt-end snapshot
    stream = sdk.completions.create(
        prompt=second, stream=True, stream_options={"include_usage": True}, **args
    )
    usage = list(stream)[-1].usage
    # the same prompt again: its last token must be computed (for the logits), and the GDN state
    # has snapshots at 40, 43 (prompt end) and 46 (generation end), so the hit is at 40 again
    assert usage.prompt_tokens == len(second)
    assert usage.prompt_tokens_details.cached_tokens == len(first)
