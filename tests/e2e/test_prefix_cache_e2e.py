"""Prefix caching through live appliances (tiny dense Qwen3.5: KV plus GDN snapshots) and the
official SDK: a small KV pool and few snapshot slots under concurrent requests sharing a system
prompt, with disconnects, give the same greedy tokens as an appliance started with
`--no-prefix-caching` and leave nothing held but evictable cache entries; a burst needing the whole
pool then evicts the cache; a chat's turns (the template re-renders past replies) restore the
state kept where the previous turn's generation prompt started; usage.cached_tokens (n > 1
included) agrees with the metrics and the stats line; with caching off everything reports 0 and the
metric families still exist. About 1 min on a quiet 2-core box (two appliance starts)."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.live import start_appliance

KV_SLOTS = 256
SNAPSHOTS = 4
INTERVAL = 16
SYSTEM = [random.Random(1).randrange(100, 1900) for _ in range(48)]  # 3 x INTERVAL
ARGS = dict(temperature=0, extra_body={"ignore_eos": True})
FLAGS = ("--max-num-seqs", "8", "--num-kv-slots", str(KV_SLOTS), "--max-num-batched-tokens", "32")
FLAGS += ("--snapshot-slots", str(SNAPSHOTS), "--snapshot-interval", str(INTERVAL))


@pytest.fixture(scope="module")
def apps(tiny_dense, tmp_path_factory):
    """(caching on, caching off), started together."""
    started = {}

    def start(key, *flags):
        log = tmp_path_factory.mktemp(key) / "appliance.log"
        env = {"APPLIANCE_LOG_STATS_INTERVAL": "0.5"}
        started[key] = start_appliance(tiny_dense, log, *FLAGS, *flags, env=env)

    threads = [
        threading.Thread(target=start, args=("on",)),
        threading.Thread(target=start, args=("off", "--no-prefix-caching")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert set(started) == {"on", "off"}, "an appliance failed to start"
        yield started["on"], started["off"]
    finally:
        codes = {key: app.stop() for key, app in started.items()}
        assert codes == {"on": 0, "off": 0}, codes


def sdk_of(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)


def metric(app, name: str) -> float:
    text = httpx.get(f"{app.url}/metrics", timeout=10).text
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} missing from /metrics"
    return float(found.group(1))


def tail(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1900) for _ in range(n)]


def run_concurrently(calls) -> list:
    results = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def disconnect_after(app, model: str, prompt: list[int], seconds: float) -> None:
    """A stream the client drops after `seconds` (mid-prefill or mid-decode of a hit)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, timeout=30) as resp:
        start = time.monotonic()
        for _ in resp.iter_bytes():
            if time.monotonic() - start > seconds:
                break


def load(app, with_disconnects: bool) -> dict[int, str]:
    """Requests sharing the system prompt (warm first), unique ones and disconnects, at once;
    returns the completions' texts by request number."""
    sdk = sdk_of(app)
    model = sdk.models.list().data[0].id

    def complete(prompt, max_tokens):
        def call():
            out = sdk.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **ARGS)
            assert out.usage.prompt_tokens_details.cached_tokens <= len(prompt)
            return out.choices[0].text

        return call

    complete(SYSTEM, 1)()
    calls = [complete(SYSTEM + tail(i, 3 + i), 3 + i % 4) for i in range(12)]
    calls += [complete(tail(100 + i, 30 + 5 * i), 4) for i in range(3)]
    if with_disconnects:
        calls += [
            lambda s=s: disconnect_after(app, model, SYSTEM + tail(200 + s, 60), 0.05 + 0.2 * s)
            for s in range(4)
        ]
    results = run_concurrently(calls)
    return {i: r for i, r in enumerate(results) if r is not None}


def test_pressure_and_disconnects_match_caching_off_and_leave_only_the_cache(apps):
    on, off = apps
    got = load(on, with_disconnects=True)
    router = on.wait_idle()["router"]
    assert (router["num_running"], router["num_waiting"], router["kv_used"]) == (0, 0, 0)
    assert router["state_used"] == 0 and router["prefix_cache_tokens"] > 0
    assert router["snapshots_used"] <= min(SNAPSHOTS, router["prefix_cache_nodes"])
    assert router["prefix_cache_hits"] > 0
    assert got == load(off, with_disconnects=False)
    # a burst that needs the whole pool (prompt + max_tokens - 1 of 256 slots each): the cache's
    # entries are evicted, nobody is refused
    sdk = sdk_of(on)
    model = sdk.models.list().data[0].id
    prompts = [tail(300 + i, KV_SLOTS - 8) for i in range(3)]
    burst = run_concurrently(
        [
            lambda p=p: sdk.completions.create(model=model, prompt=p, max_tokens=8, **ARGS)
            for p in prompts
        ]
    )
    assert [b.usage.completion_tokens for b in burst] == [8, 8, 8]
    router = on.wait_idle()["router"]
    assert (router["num_running"], router["kv_used"]) == (0, 0)
    assert router["prefix_cache_tokens"] <= KV_SLOTS


def test_n_choices_report_each_prompt_once(apps):
    """cached_tokens is a part of prompt_tokens: n choices of one prompt count it once."""
    sdk = sdk_of(apps[0])
    model = sdk.models.list().data[0].id
    head = tail(400, 2 * INTERVAL)  # every choice below hits its prompt-end snapshot

    def warm():
        sdk.completions.create(model=model, prompt=head, max_tokens=1, **ARGS)

    warm()
    out = sdk.completions.create(model=model, prompt=head + [7, 8, 9], max_tokens=2, n=3, **ARGS)
    assert out.usage.prompt_tokens == len(head) + 3
    assert out.usage.prompt_tokens_details.cached_tokens == len(head)  # not 3 x
    warm()
    stream = sdk.completions.create(
        model=model,
        prompt=[head + [5], head + [6]],
        max_tokens=2,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **ARGS,
    )
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens == 2 * (2 * INTERVAL + 1)
    assert usage.prompt_tokens_details.cached_tokens == 2 * 2 * INTERVAL


def test_cache_salt_shares_only_within_one_salt(apps):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for the same salt only, not for
    another salt nor for no salt, and an unsalted entry is no hit for a salted prompt; the answers
    are the same whatever hit. An empty salt is a 400 naming the field."""
    sdk = sdk_of(apps[0])
    model = sdk.models.list().data[0].id
    head = tail(500, 2 * INTERVAL)

    def complete(salt: str | None, prompt: list[int], max_tokens: int = 3):
        extra = {**ARGS["extra_body"], **({"cache_salt": salt} if salt is not None else {})}
        return sdk.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
        )

    def hit(warm: str | None, salt: str | None) -> tuple[int, str]:
        """The cached tokens of head + 2 under `salt` right after head was cached under `warm`
        (SNAPSHOTS slots keep about one prompt's states)."""
        complete(warm, head, max_tokens=1)
        out = complete(salt, head + [7, 8])
        return out.usage.prompt_tokens_details.cached_tokens, out.choices[0].text

    shared = hit("tenant-a", "tenant-a")
    assert shared[0] == len(head)
    assert hit(None, None)[0] == len(head)  # unsalted prompts still share with each other
    for warm, salt in [("tenant-a", "tenant-b"), ("tenant-a", None), (None, "tenant-a")]:
        missed = hit(warm, salt)
        assert missed == (0, shared[1]), (warm, salt)  # no hit, the same answer
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(
            model=model, prompt=head, max_tokens=1, extra_body={"cache_salt": ""}
        )
    assert "cache_salt" in str(err.value)


def chat(app, turns: int = 3) -> tuple[list, list[str], list[dict]]:
    """A conversation that re-sends every earlier turn: its usages, the replies' texts and the
    messages of the next turn."""
    sdk = sdk_of(app)
    model = sdk.models.list().data[0].id
    messages = [{"role": "user", "content": "tell me about the sea " * 3}]
    usages, replies = [], []
    for turn in range(turns):
        out = sdk.chat.completions.create(model=model, messages=messages, max_tokens=5, **ARGS)
        usages.append(out.usage)
        replies.append(out.choices[0].message.content)
        messages += [
            {"role": "assistant", "content": replies[-1]},  # re-rendered without its <think>
            {"role": "user", "content": f"and then {turn}?"},
        ]
    return usages, replies, messages


def test_usage_agrees_with_metrics_and_the_stats_line(apps):
    on = apps[0]
    sdk = sdk_of(on)
    model = sdk.models.list().data[0].id
    on.wait_idle()
    queries, hits = (metric(on, f"appliance_prefix_cache_{k}_total") for k in ("queries", "hits"))
    usages, replies, messages = chat(on)
    assert replies == chat(apps[1])[1]
    # each turn restores the state kept where the last turn's generation prompt started
    generation_prompt = 8  # "<|im_start|>assistant\n<think>\n" in the tiny BPE
    for previous, usage in zip(usages, usages[1:]):
        assert (
            usage.prompt_tokens_details.cached_tokens >= previous.prompt_tokens - generation_prompt
        )
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    stream = sdk.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        **ARGS,
    )
    usage = list(stream)[-1].usage
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    prompt_tokens += usage.prompt_tokens
    cached += usage.prompt_tokens_details.cached_tokens
    deadline = time.monotonic() + 10
    while metric(on, "appliance_prefix_cache_queries_total") < queries + prompt_tokens:
        assert time.monotonic() < deadline, "the router's counters did not arrive"
        time.sleep(0.1)
    assert metric(on, "appliance_prefix_cache_queries_total") == queries + prompt_tokens
    assert metric(on, "appliance_prefix_cache_hits_total") == hits + cached
    rates = re.findall(r"prefix cache hit (\d+\.\d)%", on.log())
    assert rates and max(float(r) for r in rates) > 0


def test_caching_off_reports_zero(apps):
    off = apps[1]
    sdk = sdk_of(off)
    model = sdk.models.list().data[0].id
    for _ in range(2):
        out = sdk.completions.create(model=model, prompt=SYSTEM + [1, 2], max_tokens=2, **ARGS)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    router = off.wait_idle()["router"]
    assert router["prefix_cache_hits"] == router["prefix_cache_queries"] == 0
    assert router["prefix_cache_nodes"] == router["snapshots_total"] == 0
    for name in ("queries_total", "hits_total", "tokens", "snapshot_usage_ratio"):
        assert metric(off, f"appliance_prefix_cache_{name}") == 0
    assert "prefix cache hit" not in off.log()
    assert "0 prefix-cache state snapshots" in off.log()
    assert f"{SNAPSHOTS} prefix-cache state snapshots" in apps[0].log()
