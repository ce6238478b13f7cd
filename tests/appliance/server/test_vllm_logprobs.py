"""vLLM's `prompt_logprobs` and `return_tokens_as_token_ids` on /v1/completions and
/v1/chat/completions, against the scripted engine: vLLM's per-token {id: {logprob, rank,
decoded_token}} dicts (the prompt token first, its vocabulary rank, then the top k), shared
scoring with echo + logprobs, the stream refusal, and "token_id:<id>" token strings."""

from __future__ import annotations

import pytest

from appliance.messages import PromptLogprobs, TokenizedRequest
from tests.appliance.server.test_serving import stream as sse

MSG = [{"role": "user", "content": "hello world"}]
FAR_RANK = 57  # a prompt token the scripted model ranks below its top k


def scripted_scores(safe_ids: list[int]):
    """Prompt scores with ranks: odd positions score their token as the most likely (rank 1,
    first of the top k), even ones rank it FAR_RANK, outside the top k. Token i's own logprob is
    -i / 10 (odd) or -5 - i / 10 (even), so each position's numbers are told apart. The
    alternatives are `safe_ids`, tokens whose texts are distinct printable ASCII (the legacy
    top_logprobs are keyed by text: byte pieces would share U+FFFD)."""

    def scores(req: TokenizedRequest, done: int) -> PromptLogprobs | None:
        k = req.sampling.prompt_logprobs
        if k is None or done:
            return None
        ids = req.prompt_token_ids
        logprobs: list[float | None] = [None]
        tops: list[list[tuple[int, float]]] = [[]]
        ranks = [0]
        for i, token in enumerate(ids[1:], 1):
            others = [t for t in safe_ids[i : i + k + 1] if t != token][:k]
            if i % 2:
                own = -i / 10
                top = [(token, own)] + [(t, own - 1 - j) for j, t in enumerate(others)]
                ranks.append(1)
            else:
                own = -5 - i / 10
                top = [(t, -0.1 * (j + 1)) for j, t in enumerate(others)]
                ranks.append(FAR_RANK)
            logprobs.append(own)
            tops.append(top[:k])
        return PromptLogprobs(0, list(ids), logprobs, tops, ranks)

    return scores


@pytest.fixture
def server(make_server, tokenizer):
    client, engine, state = make_server()
    texts = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    safe = sorted(i for t, i in texts.items() if t.isascii() and t.isprintable() and t.strip())
    assert len(safe) > 60
    engine._prompt_logprobs = scripted_scores(safe)  # the instance's, read at every step
    return client, engine, state


def check_vllm_entries(entries, prompt_ids: list[int], k: int, name) -> None:
    """vLLM's prompt_logprobs list for `prompt_ids` with top `k`; `name(id)` is the token string
    expected in decoded_token."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for i, (token, entry) in enumerate(zip(prompt_ids[1:], entries[1:]), 1):
        keys = list(entry)
        assert keys[0] == str(token)  # the prompt token leads
        own = entry[str(token)]
        assert own["decoded_token"] == name(token)
        if i % 2:  # the most likely token: rank 1, not repeated among the alternatives
            assert own == {"logprob": -i / 10, "rank": 1, "decoded_token": name(token)}
            assert len(entry) == max(k, 1)
            assert [entry[key]["rank"] for key in keys[1:]] == list(range(2, k + 1))
        else:  # outside the top k: its vocabulary rank, then k alternatives ranked 1..k
            assert own["logprob"] == -5 - i / 10 and own["rank"] == FAR_RANK > k
            assert len(entry) == k + 1
            assert [entry[key]["rank"] for key in keys[1:]] == list(range(1, k + 1))
            values = [entry[key]["logprob"] for key in keys[1:]]
            assert values == sorted(values, reverse=True)  # best first
        for key in keys[1:]:
            assert entry[key]["decoded_token"] == name(int(key))


def test_completion_prompt_logprobs_in_vllm_shape(server, tokenizer):
    client, engine, _ = server
    prompt = "hello world, this is a test"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ids) >= 5
    text = lambda token: tokenizer.decode([token])  # noqa: E731
    for k in (0, 2):
        body = {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": k}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert engine.received[-1].sampling.prompt_logprobs == k
        check_vllm_entries(choice["prompt_logprobs"], ids, k, text)
        assert choice["logprobs"] is None and not choice["text"].startswith(prompt)  # no echo
    # n choices of two prompts: each choice carries its own prompt's
    body = {"prompt": [prompt, "world"], "n": 2, "max_tokens": 1, "prompt_logprobs": 1}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    world = tokenizer.encode("world", add_special_tokens=False)
    lengths = [len(c["prompt_logprobs"]) for c in choices]
    assert lengths == [len(ids), len(ids), len(world), len(world)]
    # unasked: no such key (the answer keeps OpenAI's shape)
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    assert engine.received[-1].sampling.prompt_logprobs is None


@pytest.mark.parametrize("echo_k, prompt_k", [(1, 3), (3, 1), (2, 2)])
def test_prompt_logprobs_and_echo_share_one_scoring(server, tokenizer, echo_k, prompt_k):
    """One scoring with the larger k; echo's entries keep echo's k, prompt_logprobs its own, and
    the two report the same numbers."""
    client, engine, _ = server
    prompt = "hello world, this is a test"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    body = {"prompt": prompt, "echo": True, "logprobs": echo_k, "prompt_logprobs": prompt_k}
    r = client.post("/v1/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.received[-1].sampling.prompt_logprobs == max(echo_k, prompt_k)
    (choice,) = r.json()["choices"]
    lp, scored = choice["logprobs"], choice["prompt_logprobs"]
    check_vllm_entries(scored, ids, prompt_k, lambda token: tokenizer.decode([token]))
    echoed = lp["token_logprobs"][: len(ids)]
    assert echoed == [None] + [e[str(t)]["logprob"] for t, e in zip(ids[1:], scored[1:])]
    assert lp["token_logprobs"][len(ids) :] == [-0.25, -0.25]  # the generated tokens'
    assert all(len(top) <= echo_k + 1 for top in lp["top_logprobs"][1 : len(ids)])
    assert max(len(top) for top in lp["top_logprobs"][1 : len(ids)]) == echo_k + 1
    # max_tokens 0: only the prompt, both views
    r = client.post("/v1/completions", json={**body, "max_tokens": 0})
    (choice,) = r.json()["choices"]
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["prompt_logprobs"] == scored


def test_chat_prompt_logprobs_at_the_top_level(server, tokenizer):
    client, engine, _ = server
    body = {"messages": MSG, "max_tokens": 2, "prompt_logprobs": 1, "n": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    prompt_ids = engine.received[-1].prompt_token_ids
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"] == len(prompt_ids)
    check_vllm_entries(answer["prompt_logprobs"], prompt_ids, 1, lambda t: tokenizer.decode([t]))
    assert all("prompt_logprobs" not in c and c["logprobs"] is None for c in answer["choices"])
    assert list(answer).index("prompt_logprobs") > list(answer).index("choices")
    plain = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain
    assert engine.received[-1].sampling.prompt_logprobs is None


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": MSG}),
    ],
)
def test_prompt_logprobs_refusals(server, path, body):
    """With stream (as vLLM), out of [0, 20] or not an integer: a 400 naming the field, and
    nothing reaches the engine."""
    client, engine, _ = server
    received = len(engine.received)
    for extra in [
        {"prompt_logprobs": 1, "stream": True},
        {"prompt_logprobs": 0, "stream": True},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": 1.5},
        {"prompt_logprobs": "2"},
    ]:
        r = client.post(path, json={**body, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == "prompt_logprobs", extra
    assert len(engine.received) == received
    # the bound itself is fine
    r = client.post(path, json={**body, "prompt_logprobs": 20, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_responses_refuses_prompt_logprobs(server):
    """/v1/responses has no place for them: a 400, as before, not a silent drop."""
    client, _, _ = server
    r = client.post("/v1/responses", json={"input": "hi", "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def named(token_id: int) -> str:
    return f"token_id:{token_id}"


def tokens_of(chunks: list[dict], key: str) -> list:
    """A streamed choice's logprob entries (chat: `content`; completions: `tokens`)."""
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    return [x for lp in logprobs if lp for x in lp[key]]


def test_chat_tokens_as_token_ids(server, tokenizer):
    """Every token string of chat logprobs is "token_id:<id>", the id the tokenizer gives that
    token; the rest (logprob, bytes) is what the texts' answer has; streamed as collected."""
    client, _, _ = server
    reply = tokenizer.encode("hello world héllo", add_special_tokens=False)  # the script's
    eos = tokenizer.eos_token_id
    body = {"messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    as_ids = {**body, "return_tokens_as_token_ids": True}
    content = client.post("/v1/chat/completions", json=as_ids).json()["choices"][0]["logprobs"]
    content = content["content"]
    assert [e["token"] for e in content] == [named(t) for t in reply[:3]]
    assert [[x["token"] for x in e["top_logprobs"]] for e in content] == [
        [named(t), named(eos)] for t in reply[:3]
    ]
    texts = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    texts = texts["content"]
    assert texts[0]["token"] == tokenizer.decode([reply[0]])  # off (the default): the texts

    def without_names(entries):
        return [
            (e["logprob"], e["bytes"], [(x["logprob"], x["bytes"]) for x in e["top_logprobs"]])
            for e in entries
        ]

    assert without_names(content) == without_names(texts)
    assert tokens_of(sse(client, "/v1/chat/completions", as_ids), "content") == content


def test_completion_tokens_as_token_ids(server, tokenizer):
    """`logprobs.tokens`, the keys of `logprobs.top_logprobs` and prompt_logprobs' decoded_token
    are "token_id:<id>"; text_offset still counts characters of the text; streamed alike."""
    client, _, _ = server
    reply = tokenizer.encode("hello world héllo", add_special_tokens=False)
    prompt = "hello world"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True}
    as_ids = {**body, "return_tokens_as_token_ids": True}
    answer = client.post("/v1/completions", json={**as_ids, "prompt_logprobs": 2}).json()
    (choice,) = answer["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [named(t) for t in ids + reply[:3]]
    generated_tops = lp["top_logprobs"][len(ids) :]
    assert [list(top) for top in generated_tops] == [[named(t)] for t in reply[:3]]
    prompt_tops = lp["top_logprobs"][1 : len(ids)]
    assert all(named(t) in top for t, top in zip(ids[1:], prompt_tops))
    assert all(key.startswith("token_id:") for top in prompt_tops for key in top)
    check_vllm_entries(choice["prompt_logprobs"], ids, 2, named)
    texts = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["text_offset"] == texts["text_offset"]
    assert lp["token_logprobs"] == texts["token_logprobs"]
    assert texts["tokens"][0] == tokenizer.decode([ids[0]])
    assert tokens_of(sse(client, "/v1/completions", as_ids), "tokens") == lp["tokens"]
