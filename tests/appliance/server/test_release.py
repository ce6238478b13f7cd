"""Every admitted request is released on every path: a failure injected at each step between the
HTTP body and the router (and while answering) leaves no open request in the server, no sequence
in the engine, no pinned image and no request counted in the frontend; the server still answers."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from appliance.messages import ImageData
from appliance.server import serving, serving_chat
from appliance.server.engine_client import EngineClient
from appliance.server.prompts import Prompt, PromptBuilder
from appliance.server.serving_chat import ChatFormatter
from tests.appliance.server.test_errors import MSG, assert_serving

IMAGE = ImageData("key-1", b"\x89PNG not really", 0, (1, 2, 2))


class Injected(RuntimeError):
    """The failure a test injects."""


def fail(*args, **kwargs):
    raise Injected("injected")


def fail_on_call(number: int, real):
    """`real`, except that call `number` (1-based) raises."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise zmq.ZMQError(zmq.ENOTSOCK, "injected")
        return real(*args, **kwargs)

    return wrapped


def counters(state, engine) -> dict[str, float]:
    active = list(engine.active.values())
    return {
        "open requests": state.client.num_open,
        "open sequences": len(active),
        "pinned images": sum(len(req.images) for req, _ in active),
        "frontend": state.metrics.registry.get_sample_value(
            "appliance_num_requests_frontend", {"model_name": "tiny"}
        ),
    }


def wait_released(state, engine, timeout_s: float = 3.0) -> dict[str, float]:
    """The counters once they are all zero (the engine sees aborts a step later), or as they
    stand at the timeout."""
    deadline = time.monotonic() + timeout_s
    while any(counters(state, engine).values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return counters(state, engine)


@pytest.fixture
def server(make_server, tokenizer, monkeypatch):
    """A server whose chat prompts carry one image (as the visual server would pin it) and whose
    replies (200 tokens, 10 s) outlast the wait for the release: what is not aborted shows."""
    ids = tokenizer.encode("hello world " * 150, add_special_tokens=False)
    client, engine, state = make_server(script=lambda prompt: ids)
    engine.step_s = 0.05

    async def prompts_with_image(self, state, body):
        prompt = state.prompts.chat(body.messages, body.tools, None)
        return [Prompt(prompt.token_ids, prompt.text, [IMAGE])]

    monkeypatch.setattr(serving_chat.ChatEndpoint, "prompts", prompts_with_image)
    return client, engine, state


def post(client, stream: bool, n: int = 1):
    body = {"messages": MSG, "max_tokens": 200, "n": n, "stream": stream}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        text = "".join(r.iter_text())
    return r.status_code, text


STEPS = [
    # (name, object, attribute, replacement factory (given the real one), answers it applies to)
    ("tokenize", PromptBuilder, "chat", lambda real: fail, (False, True)),
    ("choices", serving, "choice_requests", lambda real: fail, (False, True)),
    ("formatter", serving_chat.ChatEndpoint, "formatter", lambda real: fail, (False, True)),
    ("encode", EngineClient, "submit", lambda real: fail, (False, True)),
    ("send of choice 1", EngineClient, "_push", lambda real: fail_on_call(1, real), (False, True)),
    ("send of choice 2", EngineClient, "_push", lambda real: fail_on_call(2, real), (False, True)),
    ("collect", serving, "_collect", lambda real: fail, (False,)),
    ("final choice", ChatFormatter, "final_choice", lambda real: fail, (False,)),
    ("first delta", serving, "first_item", lambda real: fail, (True,)),
    ("stream never started", serving, "_stream", lambda real: _broken_stream, (True,)),
    ("mid-stream", ChatFormatter, "delta_choice", lambda real: _fail_later(real), (True,)),
]
CASES = [
    pytest.param(*step[:4], stream, id=f"{step[0]}-{'stream' if stream else 'json'}")
    for step in STEPS
    for stream in step[4]
]


async def _broken_stream(*args, **kwargs):
    raise Injected("injected before the first chunk")
    yield  # an async generator whose body fails at once


def _fail_later(real):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Injected("injected mid-stream")
        return real(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("name, owner, attribute, make, stream", CASES)
def test_a_failure_at_each_step_releases_everything(
    server, monkeypatch, name, owner, attribute, make, stream
):
    client, engine, state = server
    monkeypatch.setattr(owner, attribute, make(getattr(owner, attribute)))
    try:
        status, text = post(client, stream, n=2)
    except Injected:  # the failure ended a stream whose headers were out: the connection breaks
        status, text = None, ""
    assert status != 200 or "error" in text or status is None, (name, status, text[:300])
    assert wait_released(state, engine) == dict.fromkeys(counters(state, engine), 0), name
    monkeypatch.undo()
    assert_serving(client)
    assert wait_released(state, engine) == dict.fromkeys(counters(state, engine), 0)


def test_counters_are_live(server):
    """The counters the test above reads do count a running request (so zero means released)."""
    client, engine, state = server
    reply = threading.Thread(target=post, args=(client, False, 2))
    reply.start()
    deadline = time.monotonic() + 5
    # running: both sequences in the engine and the request past the frontend (the frontend
    # gauge drops just after the hand-off, which a loaded machine can show a moment later)
    while time.monotonic() < deadline:
        seen = counters(state, engine)
        if seen["open sequences"] == 2 and seen["frontend"] == 0:
            break
        time.sleep(0.005)
    client.portal.call(state.client.abort_all, "test over")  # as a drain timeout would
    reply.join(10)
    assert seen == {"open requests": 2, "open sequences": 2, "pinned images": 2, "frontend": 0}
    assert wait_released(state, engine) == dict.fromkeys(seen, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_router_refusals_and_a_dead_engine_release_everything(server, stream):
    client, engine, state = server
    engine.reject_status = 429  # the router's queue is full
    status, _ = post(client, stream, n=2)
    assert status == 429
    assert wait_released(state, engine) == dict.fromkeys(counters(state, engine), 0)
    engine.reject_status = 0
    assert_serving(client)


def test_a_request_past_its_deadline_is_aborted(make_server, tokenizer):
    ids = tokenizer.encode("hello world " * 20, add_special_tokens=False)
    client, engine, state = make_server(script=lambda prompt: ids, request_timeout=0.3)
    engine.step_s = 0.05  # 40 tokens take 2 s
    start = time.monotonic()
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 40})
    assert time.monotonic() - start < 1.5
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error"
    assert "0.3 s" in err["message"]
    # the OpenAI SDKs would retry a 408 twice, each run meeting the same deadline
    assert r.headers["x-should-retry"] == "false"
    assert wait_released(state, engine) == dict.fromkeys(counters(state, engine), 0)
    # A stream that already started ends with the error event, then [DONE].
    body = {"messages": MSG, "max_tokens": 40, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert "request_timeout" in events[-2] and events[-1] == "data: [DONE]"
    assert wait_released(state, engine) == dict.fromkeys(counters(state, engine), 0)
    engine.step_s = 0.002
    assert_serving(client)
