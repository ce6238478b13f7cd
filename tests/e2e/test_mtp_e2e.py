"""The appliance with `--mtp-step 2` (eagle) on a tiny model whose MTP head agrees with it: streams
through the official `openai` SDK give the same greedy text as the offline engine without MTP, and
the appliance reports the accept length (Prometheus counters and the /debug/status snapshot; per
request: SGLang's /generate meta_info, vLLM's per-request `metrics`; since start: SGLang's
/get_server_info)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.testing.synthetic import permutation, sample_sequences
from tests.e2e.live import start_appliance


@pytest.fixture(scope="module")
def mtp_appliance(tiny_trained, tmp_path_factory):
    app = start_appliance(
        tiny_trained,
        tmp_path_factory.mktemp("mtp") / "appliance.log",
        "--mtp-step",
        "2",
        "--max-num-seqs",
        "8",
        "--enable-per-request-metrics",
        "--per-request-spec-decode-metrics",
        "detailed",
        "--enable-force-include-usage",
    )
    yield app
    assert app.stop() == 0, app.log()[-4000:]


def counter(metrics: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def test_streams_match_mtp_off_and_report_accept_length(mtp_appliance, tiny_trained):
    gen = torch.Generator().manual_seed(3)
    prompts = sample_sequences(permutation(0), 4, 10, gen).tolist()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [
        o.text
        for o in LLM(
            str(tiny_trained), max_num_seqs=4, num_kv_slots=2048, max_model_len=512
        ).generate(prompts, params)
    ]
    client = openai.OpenAI(base_url=f"{mtp_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for prompt, text in zip(prompts, want):
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        got = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert got == text
    metrics = httpx.get(f"{mtp_appliance.url}/metrics").text
    drafts = counter(metrics, "appliance_mtp_drafts_total")
    accepted = counter(metrics, "appliance_mtp_accepted_tokens_total")
    assert drafts > 0 and 1.0 + accepted / drafts > 1.5
    per_position = re.findall(
        r"^appliance_mtp_accepted_tokens_per_position_total{[^}]*"
        r'position="(\d)"[^}]*} (\S+)$',
        metrics,
        re.M,
    )
    assert sorted(int(p) for p, _ in per_position) == [0, 1]
    router = mtp_appliance.wait_idle()["router"]
    assert (router["kv_used"], router["state_used"]) == (0, 0)
    assert router["mtp_drafts"] == drafts and router["mtp_accepted_tokens"] == accepted
    info = httpx.get(f"{mtp_appliance.url}/get_server_info").json()  # SGLang's, since start
    assert info["internal_states"][0]["avg_spec_accept_length"] == 1.0 + accepted / drafts
    assert info["speculative_algorithm"] == "NEXTN" and info["speculative_num_steps"] == 2
    assert info["speculative_num_draft_tokens"] == 3 and info["max_running_requests"] == 8


def test_penalised_and_scored_streams_draft_and_match_mtp_off(mtp_appliance, tiny_trained):
    """Streams with logprobs and penalties draft too (the accept counters grow during them) and
    carry the text and logprobs of the engine without MTP, one entry a token, though several
    tokens arrive a step."""
    gen = torch.Generator().manual_seed(5)
    prompts = sample_sequences(permutation(0), 3, 10, gen).tolist()
    knobs = dict(max_tokens=30, temperature=0, presence_penalty=0.4, frequency_penalty=0.2)
    offline = LLM(str(tiny_trained), max_num_seqs=4, num_kv_slots=2048, max_model_len=512)
    want = offline.generate(prompts, SamplingParams(logprobs=2, ignore_eos=True, **knobs))
    client = openai.OpenAI(base_url=f"{mtp_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    before = httpx.get(f"{mtp_appliance.url}/metrics").text
    for prompt, out in zip(prompts, want):
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
            **knobs,
        )
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.text for c in chunks) == out.text
        logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        assert len(logprobs) == len(out.token_ids)
        want_logprobs = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True)]
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=1e-4)
    after = httpx.get(f"{mtp_appliance.url}/metrics").text
    drafts = counter(after, "appliance_mtp_drafts_total") - counter(
        before, "appliance_mtp_drafts_total"
    )
    accepted = counter(after, "appliance_mtp_accepted_tokens_total") - counter(
        before, "appliance_mtp_accepted_tokens_total"
    )
    assert drafts > 0 and 1.0 + accepted / drafts > 1.5


def test_generate_reports_each_requests_accept_counts(mtp_appliance):
    """SGLang's /generate meta_info with speculative decoding on: spec_verify_ct and the accept
    length (completion tokens per verify step), rate, counts and histogram of one request,
    consistent with its tokens; a stream's last chunk says what the whole answer says."""
    gen = torch.Generator().manual_seed(7)
    prompt = sample_sequences(permutation(0), 1, 10, gen).tolist()[0]
    sampling = {"max_new_tokens": 33, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sampling}
    r = httpx.post(f"{mtp_appliance.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    verify, hist = meta["spec_verify_ct"], meta["spec_accept_histogram"]
    accepted, drafts = meta["spec_accept_token_num"], meta["spec_draft_token_num"]
    assert meta["completion_tokens"] == 33 and len(hist) == 3  # --mtp-step 2: 0..2 accepted
    assert sum(hist) == verify and sum(n * c for n, c in enumerate(hist)) == accepted
    # the prefill's token, then accepted + 1 a verify step; at most one plain step at the end
    # (a single token left leaves no room for a draft)
    assert 0 <= 33 - (1 + verify + accepted) <= 1
    assert accepted <= drafts <= 2 * verify and drafts > 2 * verify - 2
    assert meta["spec_accept_rate"] == pytest.approx(accepted / drafts)
    assert meta["spec_accept_length"] == pytest.approx(33 / verify) and accepted / verify > 0.5
    with httpx.stream(
        "POST", f"{mtp_appliance.url}/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    metas = [c["meta_info"] for c in chunks]
    assert [m["spec_verify_ct"] for m in metas] == sorted(m["spec_verify_ct"] for m in metas)
    spec_keys = [k for k in meta if k.startswith("spec_")]
    assert {k: metas[-1][k] for k in spec_keys} == {k: meta[k] for k in spec_keys}


def test_per_request_metrics_reconcile_with_the_counters(mtp_appliance):
    """vLLM's --enable-per-request-metrics and --per-request-spec-decode-metrics detailed: one
    request's `metrics` (timing and speculative_decoding) through the SDK, non-streamed and on a
    stream's usage chunk (forced by --enable-force-include-usage, the client did not ask); its
    MTP counts are what the Prometheus counters grew by; several choices get `metrics: null`."""
    client = openai.OpenAI(base_url=f"{mtp_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    gen = torch.Generator().manual_seed(11)
    prompt = sample_sequences(permutation(0), 1, 10, gen).tolist()[0]
    knobs = dict(model=model, prompt=prompt, max_tokens=25, temperature=0)
    knobs |= dict(extra_body={"ignore_eos": True})
    before = httpx.get(f"{mtp_appliance.url}/metrics").text
    started = time.monotonic()
    answer = client.completions.create(**knobs)
    elapsed_ms = (time.monotonic() - started) * 1000
    after = httpx.get(f"{mtp_appliance.url}/metrics").text
    metrics = answer.model_extra["metrics"]
    spec = metrics["speculative_decoding"]
    grew = {
        name: counter(after, f"appliance_mtp_{name}_total")
        - counter(before, f"appliance_mtp_{name}_total")
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    }
    assert grew == {
        "drafts": spec["num_spec_steps"],
        "draft_tokens": spec["num_draft_tokens"],
        "accepted_tokens": spec["num_accepted_draft_tokens"],
    }
    steps, accepted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
    assert spec["num_spec_tokens"] == 2 and len(spec["acceptance_histogram"]) == 3
    assert sum(spec["acceptance_histogram"]) == steps > 0
    assert spec["per_step_accepted"] and len(spec["per_step_drafted"]) == steps
    assert sum(spec["per_step_accepted"]) == accepted
    assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps) and accepted > 0
    by_length = spec["acceptance_histogram_by_draft_length"]
    assert set(by_length) <= {"1", "2"} and sum(map(sum, by_length.values())) == steps
    tokens = answer.usage.completion_tokens
    assert tokens == 25
    ttft, decode = metrics["time_to_first_token_ms"], metrics["generation_time_ms"]
    assert metrics["queue_time_ms"] >= 0 and ttft > 0 and decode > 0
    assert metrics["queue_time_ms"] + ttft + decode < elapsed_ms
    assert metrics["mean_itl_ms"] == pytest.approx(decode / (tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(tokens / ((ttft + decode) / 1000))

    chunks = list(client.completions.create(**knobs, stream=True))
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 25
    streamed = last.model_extra["metrics"]["speculative_decoding"]
    assert streamed["per_step_accepted"] == spec["per_step_accepted"]  # greedy: the same steps
    assert all("metrics" not in c.model_extra for c in chunks[:-1])

    two = client.completions.create(**{**knobs, "n": 2})
    assert "metrics" in two.model_extra and two.model_extra["metrics"] is None


def test_chat_and_responses_carry_per_request_metrics(mtp_appliance):
    """The chat and Responses routes carry the same `metrics` object: chat at the top level (and
    on a stream's usage chunk), a Response at its top level and in response.completed."""
    client = openai.OpenAI(base_url=f"{mtp_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    metrics = chat.model_extra["metrics"]
    assert metrics["speculative_decoding"]["num_spec_steps"] > 0
    assert metrics["time_to_first_token_ms"] > 0 and metrics["queue_time_ms"] >= 0
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].model_extra["metrics"]["mean_itl_ms"] > 0
    response = client.responses.create(model=model, input="hello", max_output_tokens=12)
    assert response.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    with client.responses.stream(model=model, input="hello", max_output_tokens=12) as stream:
        events = list(stream)
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.model_extra["metrics"]["generation_time_ms"] > 0
    assert all("metrics" not in e.response.model_extra for e in events[:2])  # created, in progress


def test_thinking_budget_with_mtp_answers_what_mtp_off_answers(mtp_appliance, tiny_trained):
    """vLLM's thinking_token_budget through the MTP step: the verify rows are edited after their
    drafts, so </think> comes where it comes without MTP, and the drafts go on being accepted."""
    offline = LLM(str(tiny_trained), max_num_seqs=4, num_kv_slots=2048, max_model_len=512)
    hf = offline.tokenizer.hf
    think, end = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    gen = torch.Generator().manual_seed(13)
    prompts = [p + [think] for p in sample_sequences(permutation(0), 3, 10, gen).tolist()]
    client = openai.OpenAI(base_url=f"{mtp_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for budget, prompt in zip((0, 3, 9), prompts):
        params = SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, thinking_token_budget=budget
        )
        want = offline.generate(prompt, params, use_tqdm=False)[0].token_ids
        assert want[budget] == end and end not in want[:budget]
        got = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "thinking_token_budget": budget,
                "return_token_ids": True,
            },
        )
        assert got.choices[0].model_extra["token_ids"] == want, budget
        assert got.model_extra["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0


@pytest.fixture(scope="module")
def limited_appliance(tiny_trained, tmp_path_factory):
    app = start_appliance(
        tiny_trained,
        tmp_path_factory.mktemp("mtp_limited") / "appliance.log",
        "--mtp-step",
        "2",
        "--mtp-disable-batch-size",
        "1",
        "--max-num-seqs",
        "8",
    )
    yield app
    assert app.stop() == 0, app.log()[-4000:]


def test_steps_past_the_verify_limit_pause_and_are_counted(limited_appliance, tiny_trained):
    """--mtp-disable-batch-size 1: three prompts of one request decode together without
    verifying (their drafts still made), then the last one alone verifies; the text is MTP
    off's, the paused steps are counted in /metrics and the status snapshot, and the router
    logs the rule."""
    gen = torch.Generator().manual_seed(21)
    prompts = sample_sequences(permutation(0), 3, 10, gen).tolist()
    lengths = [6, 12, 30]
    offline = LLM(str(tiny_trained), max_num_seqs=4, num_kv_slots=2048, max_model_len=512)
    want = [
        offline.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
        for p, n in zip(prompts, lengths)
    ]
    client = openai.OpenAI(base_url=f"{limited_appliance.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(3) as pool:
        got = list(
            pool.map(
                lambda pn: (
                    client.completions.create(
                        model=model,
                        prompt=pn[0],
                        max_tokens=pn[1],
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    .choices[0]
                    .text
                ),
                zip(prompts, lengths),
            )
        )
    assert got == want
    router = limited_appliance.wait_idle()["router"]
    metrics = httpx.get(f"{limited_appliance.url}/metrics").text
    paused = counter(metrics, "appliance_mtp_paused_steps_total")
    assert paused > 0 and router["mtp_paused_steps"] == paused
    assert counter(metrics, "appliance_mtp_accepted_tokens_total") > 0  # the last one verified
    assert "more than 1 decoding requests verify no drafts" in limited_appliance.log()
