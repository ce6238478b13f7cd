"""vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are what the engine is sent (chat
and completions, text and token ids), echo shows them, -1 is the context length, bad values and a
cut through an image are 400s naming the field."""

from __future__ import annotations

import pytest

from appliance.messages import ImageData
from appliance.server.errors import BadRequest
from appliance.server.prompts import PromptBuilder
from tests.appliance.server.conftest import MAX_MODEL_LEN

MSG = [{"role": "user", "content": "one two three four five six seven eight nine ten"}]
TEXT = "alpha beta gamma delta epsilon zeta eta theta iota kappa"


def _last(client, engine, path: str, body: dict):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json(), engine.received[-1].prompt_token_ids


def test_completion_keeps_the_last_tokens_of_text_and_id_prompts(make_server, tokenizer):
    client, engine, _ = make_server()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 6
    body = {"prompt": TEXT, "max_tokens": 2, "truncate_prompt_tokens": 5, "echo": True}
    out, sent = _last(client, engine, "/v1/completions", body)
    assert sent == ids[-5:]
    assert out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["text"].startswith(tokenizer.decode(ids[-5:]))  # echo: what was kept
    _, sent = _last(client, engine, "/v1/completions", {**body, "prompt": ids, "echo": False})
    assert sent == ids[-5:]
    # a batch: each prompt is cut on its own; a short one is left whole
    body = {"prompt": [TEXT, "hi"], "max_tokens": 2, "truncate_prompt_tokens": 3}
    client.post("/v1/completions", json=body).raise_for_status()
    sent = [r.prompt_token_ids for r in engine.received[-2:]]
    assert sent == [ids[-3:], tokenizer.encode("hi", add_special_tokens=False)]
    # larger than the prompt: nothing is cut
    body = {"prompt": TEXT, "max_tokens": 2, "truncate_prompt_tokens": 200}
    _, sent = _last(client, engine, "/v1/completions", body)
    assert sent == ids


def test_chat_keeps_the_last_tokens_of_the_rendered_prompt(make_server, tokenizer):
    client, engine, _ = make_server()
    _, whole = _last(client, engine, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    body = {"messages": MSG, "max_tokens": 2, "truncate_prompt_tokens": 7}
    out, sent = _last(client, engine, "/v1/chat/completions", body)
    assert sent == whole[-7:] and out["usage"]["prompt_tokens"] == 7


def test_minus_one_is_the_context_length(make_server, tokenizer):
    client, engine, _ = make_server()
    long_ids = [tokenizer.encode("x", add_special_tokens=False)[0]] * (MAX_MODEL_LEN + 40)
    r = client.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 1})
    assert r.status_code == 400  # too long without truncation
    received = len(engine.received)
    body = {"prompt": long_ids, "max_tokens": 1, "truncate_prompt_tokens": -1}
    r = client.post("/v1/completions", json=body)
    # kept to the context length, which leaves no room to generate: the context error, as vLLM's
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    body["truncate_prompt_tokens"] = MAX_MODEL_LEN - 1
    _, sent = _last(client, engine, "/v1/completions", body)
    assert len(sent) == MAX_MODEL_LEN - 1 and len(engine.received) == received + 1


@pytest.mark.parametrize("value", [0, -2, MAX_MODEL_LEN + 1])
def test_bad_values_are_400s_naming_the_field(make_server, value):
    client, engine, _ = make_server()
    for path, body in [
        ("/v1/completions", {"prompt": TEXT}),
        ("/v1/chat/completions", {"messages": MSG}),
    ]:
        r = client.post(path, json={**body, "max_tokens": 1, "truncate_prompt_tokens": value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert engine.received == []


def _image(offset: int) -> ImageData:
    return ImageData("k", b"png", offset, (1, 2, 2))


def test_images_move_with_the_cut_and_are_never_cut(tokenizer):
    prompts = PromptBuilder(tokenizer, MAX_MODEL_LEN)
    ids = list(range(100, 120))
    kept, images = prompts._keep_last(ids, 12, [_image(10), _image(15)])
    assert kept == ids[8:] and [i.offset for i in images] == [2, 7]
    assert prompts._keep_last(ids, 20, [_image(0)]) is None  # nothing cut, nothing moved
    with pytest.raises(BadRequest) as info:
        prompts._keep_last(ids, 12, [_image(7)])
    assert info.value.param == "truncate_prompt_tokens" and "image 0" in str(info.value)
