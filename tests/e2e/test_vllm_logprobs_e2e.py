"""vLLM's `prompt_logprobs` and `return_tokens_as_token_ids` through the real processes (server,
router, worker, detokenizer) on the tiny dense checkpoint: the scores agree with echo + logprobs
and with transformers, the ranks are the vocabulary's, chat scores its rendered prompt, and token
strings name the ids the tokenizer gives."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from appliance.testing.oracle import hf_logits

PROMPT = "def f(x):\n    return"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_dense):
    return AutoTokenizer.from_pretrained(tiny_dense)


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_match_echo_and_rank_the_vocabulary(http, tiny_dense, tokenizer):
    """Completions: prompt_logprobs hold echo + logprobs' numbers (one scoring, each view its own
    k), the prompt token's rank is its place among transformers' logprobs (1 where it is the
    most likely, past k where it is not among the top k)."""
    k, echo_k = 3, 1
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    greedy = {"prompt": prompt_ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    greedy |= {"logprobs": 0, "return_tokens_as_token_ids": True}
    tokens = post(http, "/completions", greedy)["choices"][0]["logprobs"]["tokens"]
    ids = prompt_ids + [int(t.removeprefix("token_id:")) for t in tokens]  # + the most likely
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": echo_k, "prompt_logprobs": k}
    (choice,) = post(http, "/completions", body)["choices"]
    scored, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert echoed["token_logprobs"] == [None] + [
        e[str(t)]["logprob"] for t, e in zip(ids[1:], scored[1:])
    ]
    assert all(len(top) <= echo_k + 1 for top in echoed["top_logprobs"][1:])
    ref = torch.log_softmax(hf_logits(tiny_dense, ids), dim=-1)  # [P, V]
    ranks = []
    for i, (token, entry) in enumerate(zip(ids[1:], scored[1:]), 1):
        own = entry[str(token)]
        assert list(entry)[0] == str(token) and own["decoded_token"] == tokenizer.decode([token])
        assert own["logprob"] == pytest.approx(ref[i - 1, token].item(), abs=1e-4)
        row = ref[i - 1]
        low = 1 + int((row > row[token] + 1e-3).sum())
        high = 1 + int((row > row[token] - 1e-3).sum())
        assert low <= own["rank"] <= high, (i, own, low, high)
        others = {int(t): v for t, v in entry.items() if int(t) != token}
        assert [v["rank"] for v in others.values()] == sorted(v["rank"] for v in others.values())
        if own["rank"] <= k:  # among the top k: one entry for it, the others fill the rest
            assert len(entry) == k and own["rank"] not in [v["rank"] for v in others.values()]
        else:
            assert len(entry) == k + 1 and [v["rank"] for v in others.values()] == [1, 2, 3]
        kth = row.topk(k).values[-1].item()
        for t, v in others.items():  # transformers' top k (up to near ties at the k-th)
            assert v["logprob"] == pytest.approx(row[t].item(), abs=1e-4)
            assert row[t].item() >= kth - 1e-3
        ranks.append(own["rank"])
    generated = ranks[len(prompt_ids) - 1 :]
    assert 1 in generated, ranks  # a greedy token scored as the most likely
    assert any(rank > k for rank in ranks), ranks  # and a prompt token far down


def test_chat_prompt_logprobs_and_stream_refusal(http):
    answer = post(
        http, "/chat/completions", {"messages": MSG, "max_tokens": 2, "prompt_logprobs": 0}
    )
    scored = answer["prompt_logprobs"]
    assert len(scored) == answer["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(entry) == 1 and list(entry.values())[0]["rank"] >= 1 for entry in scored[1:])
    for path, body in [("/chat/completions", {"messages": MSG}), ("/completions", {"prompt": "x"})]:
        r = http.post(path, json={**body, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def stream_tokens(http, path: str, body: dict, key: str) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    out = []
    for line in lines[:-1]:
        chunk = json.loads(line)
        logprobs = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
        out += logprobs[key] if logprobs else []
    return out


def test_tokens_as_token_ids(http, tokenizer):
    """return_tokens_as_token_ids: "token_id:<id>" everywhere a logprob names a token, the id the
    tokenizer gives it, in JSON answers and streams alike."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    body["return_tokens_as_token_ids"] = True
    (choice,) = post(http, "/completions", {**body, "prompt_logprobs": 1})["choices"]
    tokens = choice["logprobs"]["tokens"]
    assert tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    generated = [int(t.removeprefix("token_id:")) for t in tokens[len(ids) :]]
    assert PROMPT + tokenizer.decode(generated, skip_special_tokens=True) == choice["text"]
    assert all(
        key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"][1:] for key in top
    )
    assert all(
        v["decoded_token"] == f"token_id:{t}"
        for entry in choice["prompt_logprobs"][1:]
        for t, v in entry.items()
    )
    assert stream_tokens(http, "/completions", body, "tokens") == tokens
    chat = {"messages": MSG, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    chat["return_tokens_as_token_ids"] = True
    content = post(http, "/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    chat["return_tokens_as_token_ids"] = False
    texts = post(http, "/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    for entry, text in zip(content, texts, strict=True):
        token_id = int(entry["token"].removeprefix("token_id:"))
        assert entry["bytes"] == text["bytes"] and entry["logprob"] == text["logprob"]
        assert bytes(text["bytes"]).decode(errors="replace") == text["token"]
        if "\ufffd" not in text["token"]:  # a whole character: the tokenizer's text of the id
            assert tokenizer.decode([token_id]) == text["token"]
        tops = zip(entry["top_logprobs"], text["top_logprobs"], strict=True)
        for named, spelt in tops:
            token_id = int(named["token"].removeprefix("token_id:"))
            assert named["bytes"] == spelt["bytes"]
            if "\ufffd" not in spelt["token"]:
                assert tokenizer.decode([token_id]) == spelt["token"]
    chat["return_tokens_as_token_ids"] = True
    assert stream_tokens(http, "/chat/completions", chat, "content") == content


def sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def test_return_token_ids(http, tokenizer):
    """vLLM's return_token_ids: completions choices carry their prompt's ids and the ids they
    generated (the ids behind their logprob entries; streamed: the prompt's in each choice's
    first chunk, every chunk its new ids, joined the same ids); chat answers carry the rendered
    prompt's ids at the top level (streamed: on the role chunks) and each choice its ids."""
    prompts = [tokenizer.encode(PROMPT, add_special_tokens=False), [5, 6, 7]]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    body |= {"return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    choices = post(http, "/completions", body)["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    for c in choices:
        named = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        assert c["token_ids"] == named and len(named) == 5
    streamed: dict[int, dict] = {}
    for chunk in sse(http, "/completions", body):
        for c in chunk["choices"]:
            got = streamed.setdefault(c["index"], {"prompts": [], "ids": []})
            if "prompt_token_ids" in c:
                got["prompts"].append(c["prompt_token_ids"])
            got["ids"] += c["token_ids"]
    assert [streamed[i]["prompts"] for i in range(4)] == [[c["prompt_token_ids"]] for c in choices]
    assert [streamed[i]["ids"] for i in range(4)] == [c["token_ids"] for c in choices]

    plain = post(http, "/completions", {**body, "return_token_ids": False})
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])

    chat = {"messages": MSG, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    answer = post(http, "/chat/completions", chat)
    rendered = tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    assert answer["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    ids = answer["choices"][0]["token_ids"]
    assert 0 < len(ids) <= 6 and answer["usage"]["completion_tokens"] == len(ids)
    chunks = sse(http, "/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
