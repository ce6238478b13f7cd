"""SGLang's native API against the scripted engine: POST /generate (text and input_ids, batches,
n, stop strings and stop tokens with what matched, lengths, cumulative streams, SGLang's logprob
lists, the sampling fields the engine gets, the 400s naming SGLang's fields), /health_generate and
/get_model_info."""

from __future__ import annotations

import json
import time

import pytest

from appliance.server import serving_generate
from tests.appliance.server.test_first_contact import (  # noqa: F401 (access_lines: a fixture)
    _stream_then_leave,
    access_lines,
    finished,
    logged_server,
)

REPLY = "hello world héllo"


def generate(client, **body):
    return client.post("/generate", json=body)


def ok(client, **body):
    r = generate(client, **body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(client, **body) -> list:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def reply_ids(tokenizer) -> list[int]:
    return tokenizer.encode(REPLY, add_special_tokens=False)


def test_text_and_input_ids_give_sglangs_answer(make_server, tokenizer):
    client, engine, _ = make_server()
    prompt_ids = tokenizer.encode("hello world", add_special_tokens=False)
    by_text = ok(client, text="hello world", sampling_params={"temperature": 0})
    assert engine.received[-1].prompt_token_ids == prompt_ids
    by_ids = ok(client, input_ids=prompt_ids, sampling_params={"temperature": 0})
    assert engine.received[-1].prompt_token_ids == prompt_ids
    eos = tokenizer.eos_token_id
    for answer in (by_text, by_ids):
        assert set(answer) == {"text", "output_ids", "meta_info"}
        assert answer["text"] == REPLY
        assert answer["output_ids"] == reply_ids(tokenizer) + [eos]  # the eos that stopped it
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": eos}
        assert meta["prompt_tokens"] == len(prompt_ids)
        assert meta["completion_tokens"] == len(reply_ids(tokenizer)) + 1
        assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
        assert meta["id"].startswith("generate-") and "input_token_logprobs" not in meta
    assert by_text["meta_info"]["id"] != by_ids["meta_info"]["id"]


def test_batch_and_n_answer_a_list_prompt_by_prompt(make_server, tokenizer):
    # each reply starts with its prompt's first two tokens: the order shows which prompt it is
    client, engine, _ = make_server(script=lambda ids: ids[:2])
    texts = ["hello world", "The quick brown fox"]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    answers = ok(client, text=texts, rid="job")
    assert [a["output_ids"][:2] for a in answers] == [p[:2] for p in prompts]
    assert [a["meta_info"]["id"] for a in answers] == ["job_0", "job_1"]
    answers = ok(client, input_ids=prompts, sampling_params={"n": 2})
    assert [a["output_ids"][:2] for a in answers] == [p[:2] for p in prompts for _ in range(2)]
    assert [r.prompt_token_ids for r in engine.received[-4:]] == [p for p in prompts for _ in "nn"]
    assert len({a["meta_info"]["id"] for a in answers}) == 4
    (single,) = [ok(client, text="hello world", rid=["mine"])]
    assert isinstance(single, dict) and single["meta_info"]["id"] == "mine"
    one_prompt_n2 = ok(client, text="hello world", sampling_params={"n": 2, "sampling_seed": 7})
    assert isinstance(one_prompt_n2, list) and len(one_prompt_n2) == 2
    assert [r.sampling.seed for r in engine.received[-2:]] == [7, 8]  # each sample its own


def test_stop_string_names_what_matched(make_server):
    client, engine, _ = make_server()
    answer = ok(client, text="hi", sampling_params={"stop": ["nope", "world"]})
    assert answer["text"] == "hello "
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
    assert engine.received[-1].detok.stop == ["nope", "world"]
    kept = ok(client, text="hi", sampling_params={"stop": "world", "no_stop_trim": True})
    assert kept["text"] == "hello world"
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": "world"}
    assert engine.received[-1].detok.include_stop_str_in_output


def test_stop_token_id_names_the_token(make_server, tokenizer):
    first, stop_id = reply_ids(tokenizer)[:2]
    client, engine, _ = make_server(script=lambda ids: [first])
    engine.eos = stop_id  # the scripted engine ends on it, as the router ends on stop_token_ids
    answer = ok(client, text="hi", sampling_params={"stop_token_ids": [stop_id]})
    assert answer["output_ids"] == reply_ids(tokenizer)[:2]
    assert answer["text"] == tokenizer.decode(reply_ids(tokenizer)[:1])
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert engine.received[-1].stop_token_ids == [stop_id]


def test_max_new_tokens_length_default_and_room(make_server, tokenizer):
    client, engine, state = make_server()
    answer = ok(client, text="hi", sampling_params={"max_new_tokens": 2})
    assert answer["output_ids"] == reply_ids(tokenizer)[:2]
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert engine.received[-1].max_tokens == 2
    state.sampling_defaults = {"temperature": 0.6, "top_k": 20}  # generation_config.json's
    ok(client, text="hi")
    received = engine.received[-1]
    assert received.max_tokens == 128  # SGLang's default
    # SGLang's defaults for unset fields, as its /generate samples
    assert (received.sampling.temperature, received.sampling.top_k) == (1.0, -1)
    num_prompt = len(received.prompt_token_ids)
    ok(client, text="hi", sampling_params={"max_new_tokens": 1000})  # cut to the room, as SGLang
    assert engine.received[-1].max_tokens == 256 - num_prompt
    ok(client, text="hi", sampling_params={"max_new_tokens": None})  # null: the whole room
    assert engine.received[-1].max_tokens == 256 - num_prompt
    scored = ok(client, text="hi", sampling_params={"max_new_tokens": 0})
    assert scored["output_ids"] == [] and engine.received[-1].max_tokens == 0
    assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_sampling_params_reach_the_engine(make_server, tokenizer):
    client, engine, _ = make_server()
    params = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "frequency_penalty": 0.25,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_new_tokens": 3,
        "sampling_seed": 11,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "logit_bias": {"5": -100.0},
        "max_new_tokens": 20,
    }
    ok(client, text="hi", sampling_params=params, log_metrics=False, routed_dp_rank=0)
    received = engine.received[-1]
    sampling = received.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        0.5,
        0.9,
        7,
        0.05,
    )
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.25, -0.5)
    assert sampling.repetition_penalty == 1.1 and sampling.seed == 11
    assert sampling.min_tokens == 3 and sampling.logit_bias == {5: -100.0}
    assert received.ignore_eos and received.max_tokens == 20
    assert not received.detok.skip_special_tokens
    # a per-prompt list with one setting is that setting
    ok(client, text=["a", "b"], sampling_params=[{"temperature": 0}, {"temperature": 0}])
    assert [r.sampling.temperature for r in engine.received[-2:]] == [0.0, 0.0]


def test_regex_becomes_the_guide(make_server):
    client, engine, _ = make_server()
    ok(client, text="hi", sampling_params={"regex": "(hello|world)+", "max_new_tokens": 4})
    guide = engine.received[-1].sampling.guide
    assert (guide.kind, guide.spec) == ("regex", "(hello|world)+")


def test_stream_sends_cumulative_text_and_done(make_server, tokenizer):
    client, _, _ = make_server()
    chunks = stream_chunks(client, text="hi", sampling_params={"max_new_tokens": 32})
    assert len(chunks) > 2 and all("index" not in c for c in chunks)
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each the whole text so far
    ids = [c["output_ids"] for c in chunks]
    assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:]))
    last = chunks[-1]
    assert last["text"] == REPLY and last["output_ids"] == reply_ids(tokenizer) + [
        tokenizer.eos_token_id
    ]
    assert last["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "e2e_latency" in last["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]
    batch = stream_chunks(client, text=["hi", "yo"], sampling_params={"max_new_tokens": 3})
    assert {c["index"] for c in batch} == {0, 1}
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert [finals[i]["output_ids"] for i in (0, 1)] == [reply_ids(tokenizer)[:3]] * 2


def test_return_logprob_in_sglangs_lists(make_server, tokenizer):
    client, engine, _ = make_server()
    prompt = tokenizer.encode("hello world", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    meta = ok(client, **body)["meta_info"]  # the generated tokens' only (logprob_start_len -1)
    assert meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs"] == [[-0.25, t, None] for t in reply_ids(tokenizer)[:2]]
    assert "output_top_logprobs" not in meta
    assert engine.received[-1].sampling.prompt_logprobs is None
    body |= {"top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}
    meta = ok(client, **body)["meta_info"]
    assert engine.received[-1].sampling.logprobs == 2
    assert engine.received[-1].sampling.prompt_logprobs == 2
    names = [tokenizer.decode([t]) for t in prompt]
    assert meta["input_token_logprobs"] == [[None, prompt[0], names[0]]] + [
        [-1.0, t, name] for t, name in zip(prompt[1:], names[1:])
    ]
    assert meta["input_top_logprobs"] == [None] + [
        [[-1.0, t, name]] for t, name in zip(prompt[1:], names[1:])
    ]
    first, second = reply_ids(tokenizer)[:2]
    assert [e[:2] for e in meta["output_token_logprobs"]] == [[-0.25, first], [-0.25, second]]
    assert [[e[:2] for e in top] for top in meta["output_top_logprobs"]] == [
        [[-0.25, first], [-2.0, eos]],
        [[-0.25, second], [-2.0, eos]],
    ]
    body["logprob_start_len"] = 2
    meta = ok(client, **body)["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[2:]
    streamed = stream_chunks(client, **body)[-1]["meta_info"]  # the prompt is scored streamed too
    assert streamed["input_token_logprobs"] == meta["input_token_logprobs"]
    assert streamed["output_token_logprobs"] == meta["output_token_logprobs"]


def test_a_client_that_leaves_mid_stream_aborts(make_server, tokenizer, access_lines):  # noqa: F811
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = logged_server(make_server, script=lambda prompt: ids)
    engine.step_s = 0.05  # 40 tokens take 2 s: the client leaves long before the end
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 40}, "stream": True}
    messages = client.portal.call(_stream_then_leave, client.app, "/generate", body)
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    (line,) = [x for x in access_lines if " id=gone1" in x]
    assert " completion=generate-" in line and line.endswith(" aborted=client_gone")
    deadline = time.monotonic() + 3
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == 1 and state.client.num_open == 0
    assert finished(state, "abort") == 1


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"text": "hi", "image_data": "https://x/y.png"}, "image_data", "not supported by this"),
        ({"text": "hi", "image_data": [["a"]]}, "image_data", "not nested lists"),
        ({"text": ["a", "b"], "image_data": ["x"]}, "image_data", "one entry per prompt"),
        ({"text": "hi", "modalities": ["audio"]}, "modalities", "'audio' is not served"),
        ({"text": "hi", "mm_hashes": ["h"]}, "mm_hashes", "send the images in image_data"),
        ({"text": "hi", "lora_path": "adapter"}, "lora_path", "LoRA"),
        ({"text": "hi", "session_params": {"id": "s"}}, "session_params", "sessions"),
        ({"text": "hi", "return_hidden_states": True}, "return_hidden_states", "hidden"),
        ({"text": "hi", "sampling_params": {"stop_regex": "a+"}}, "sampling_params", "stop_regex"),
        ({"text": "hi", "sampling_params": {"foo": 1}}, "sampling_params", "sampling_params.foo"),
        ({"text": "hi", "input_ids": [1]}, "text", "either text or input_ids"),
        ({}, "text", "either text or input_ids"),
        ({"input_ids": []}, "input_ids", "non-empty"),
        ({"input_ids": [99999]}, "input_ids", "input_ids: token id 99999"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params", "temperature"),
        (
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params",
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "hi", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
            "sampling_params",
            "sampling_params.min_new_tokens: 5 is more than max_new_tokens (2)",
        ),
        ({"text": "hi", "sampling_params": {"n": 99}}, "sampling_params", "sampling_params.n"),
        (
            {"text": "hi", "sampling_params": {"json_schema": "{not json"}},
            "sampling_params",
            "sampling_params.json_schema",
        ),
        (
            {"text": ["a", "b"], "sampling_params": [{"top_k": 1}, {"top_k": 2}]},
            "sampling_params",
            "differ",
        ),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "one dict per prompt"),
        ({"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num", "20"),
        (
            {"text": "hi", "return_logprob": True, "logprob_start_len": 99},
            "logprob_start_len",
            "past the end",
        ),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid", "one id per prompt"),
    ],
)
def test_refusals_name_sglangs_fields(make_server, body, param, says):
    client, engine, _ = make_server()
    r = generate(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"], error["message"]
    assert engine.received == []


def test_accepted_defaults_and_ignored_bookkeeping(make_server):
    client, _, _ = make_server()
    extras = {"image_data": [None], "lora_path": None, "return_hidden_states": False}
    extras |= {"modalities": ["image"]}
    extras |= {"log_metrics": False, "conversation_id": "c-1", "model": "anything"}
    assert ok(client, text="hi", **extras)["text"] == REPLY


def test_health_generate_runs_one_token(make_server, monkeypatch):
    client, engine, _ = make_server()
    assert client.get("/health_generate").status_code == 200
    probe = engine.received[-1]
    assert probe.prompt_token_ids == [0] and probe.max_tokens == 1
    assert probe.sampling.temperature == 0.0
    engine.reject_status = 500  # the engine fails the probe
    r = client.get("/health_generate")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    engine.reject_status = 0
    monkeypatch.setattr(serving_generate, "HEALTH_GENERATE_TIMEOUT_S", 0.3)
    engine.stop()  # nothing answers now
    r = client.get("/health_generate")
    assert r.status_code == 503 and "no token within 0.3 s" in r.json()["error"]["message"]
    starting, _, _ = make_server(ready=False)
    assert starting.get("/health_generate").status_code == 503


def test_model_info_auth_and_route_label(make_server):
    client, _, _ = make_server(api_key="sk-1")
    assert client.get("/get_model_info").status_code == 401
    assert generate(client, text="hi").status_code == 401
    headers = {"Authorization": "Bearer sk-1"}
    info = client.get("/get_model_info", headers=headers).json()
    assert info["model_path"] == "tiny" and info["is_generation"] is True
    assert info["has_image_understanding"] is False
    assert client.get("/model_info", headers=headers).json() == info
    assert client.post("/generate", json={"text": "hi"}, headers=headers).status_code == 200
    assert client.put("/generate", json={"text": "hi"}, headers=headers).status_code == 200
    metrics = client.get("/metrics").text
    assert 'route="/generate",status="200"' in metrics
    assert 'route="/get_model_info",status="200"' in metrics
