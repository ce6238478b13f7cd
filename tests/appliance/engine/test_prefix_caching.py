"""Prefix caching on real tiny models (Qwen3.5 dense and MoE: hybrid, GDN snapshots; Qwen3-VL: KV
only) through the router's engine loop and the model runner: a 4-turn conversation with an image in
turn 1 gives token-identical greedy output with caching on and off, and turns 2+ hit the previous
turn; concurrent requests sharing a system prompt; eviction under a pool sized to force it; an
abort in the middle of a hit's prefill; MTP on. Every test ends with no KV, state or snapshot slot
held once the cache lets go."""

from __future__ import annotations

import shutil

import msgspec
import pytest
import torch

from appliance.engine.mm_inputs import InProcessImageStore
from appliance.engine.pools import plan_snapshot_slots
from appliance.engine.runner import ModelRunner
from appliance.messages import SamplingOptions, TokenizedRequest
from appliance.offline.llm import build_engine_config
from appliance.router.engine import EngineCore
from appliance.router.scheduler import Scheduler
from appliance.testing.tiny_vl import (
    TINY_MAX_PIXELS,
    TINY_MIN_PIXELS,
    build_tiny_qwen3_vl,
    write_preprocessor_config,
)
from tests.models.qwen3_vl_oracle import image_inputs, make_prompt, random_image

GREEDY = SamplingOptions(temperature=0.0)
INTERVAL = 32  # snapshot_interval: small, so the tiny prompts cross it
OPTS = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=48)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("vl"), tokenizer="none", seed=21)


def with_image_processor(src, dst):
    """A copy of a tiny Qwen3.5 checkpoint (which has a ViT) with the image preprocessing config."""
    shutil.copytree(src, dst)
    write_preprocessor_config(dst, TINY_MIN_PIXELS, TINY_MAX_PIXELS)
    return dst


@pytest.fixture(scope="module")
def dense_vl(tiny_dense, tmp_path_factory):
    return with_image_processor(tiny_dense, tmp_path_factory.mktemp("dense") / "ckpt")


@pytest.fixture(scope="module")
def moe_vl(tiny_moe, tmp_path_factory):
    return with_image_processor(tiny_moe, tmp_path_factory.mktemp("moe") / "ckpt")


@pytest.fixture(params=["dense", "moe", "vl"])
def ckpt(request, dense_vl, moe_vl, tiny_vl):
    return {"dense": dense_vl, "moe": moe_vl, "vl": tiny_vl}[request.param]


class Engine:
    """A model runner and the router's engine loop around it, in this process."""

    def __init__(self, ckpt, caching: bool, **options) -> None:
        opts = {**OPTS, "num_kv_slots": 1024, "snapshot_interval": INTERVAL, **options}
        config = build_engine_config(str(ckpt), 1, dict(opts, prefix_caching=caching))
        self.ckpt, self.runner = ckpt, ModelRunner(config)
        self.runner.mm.store = InProcessImageStore()
        info = self.runner.info()
        self.scheduler = Scheduler(
            config.scheduler,
            info.num_kv_slots,
            info.max_model_len,
            num_snapshot_slots=info.num_snapshot_slots,
            linear_state=info.linear_state,
        )
        self.core = EngineCore(self.scheduler, [], self.runner)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 6, mm=()) -> None:
        msg = TokenizedRequest(req_id, prompt, GREEDY, max_tokens, ignore_eos=True, mm=list(mm))
        self.core.enqueue(msg)

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.core.has_work():
                break
            self.core.step()
            out = self.core.take_output()
            for update in out.updates if out else []:
                tokens.setdefault(update.req_id, []).extend(update.token_ids)
        return tokens

    def hits(self) -> int:
        return self.scheduler.stats().prefix_cache_hits

    def assert_nothing_leaked(self) -> None:
        sched = self.scheduler
        assert sched.stats().kv_used == 0 and sched.req_slots.num_used == 0
        if sched.cache is not None:
            sched.cache.clear()
        assert sched.kv.num_used == 0 and sched.snapshots.num_used == 0


def conversation(engine: Engine, turns: int = 4) -> tuple[list[list[int]], list[int], list[int]]:
    """Turn 1 has an image; each later turn re-sends the conversation plus new tokens. Returns the
    outputs, the tokens each turn found cached and the previous turn's prompt + completion."""
    first = make_prompt(engine.ckpt, [5, random_image(64, 64, 1), 9], seed=0)
    mm = [
        msgspec.structs.replace(image, content_key=f"sha256:img{i}")
        for i, image in enumerate(image_inputs(engine.runner, engine.ckpt, first, "turn1"))
    ]
    prompt, outputs, cached, previous = first.token_ids, [], [], []
    for turn in range(turns):
        before = engine.hits()
        engine.add(f"t{turn}", prompt, mm=mm)
        out = engine.run()[f"t{turn}"]
        outputs.append(out)
        cached.append(engine.hits() - before)
        previous.append(len(prompt) + len(out))
        prompt = prompt + out + make_prompt(engine.ckpt, [11 + 4 * turn], seed=turn + 1).token_ids
    return outputs, cached, previous


def test_conversation_with_an_image_is_identical_and_hits(ckpt):
    off, on = Engine(ckpt, caching=False), Engine(ckpt, caching=True)
    want, none, _ = conversation(off)
    got, cached, previous = conversation(on)
    assert got == want and none == [0, 0, 0, 0]
    assert cached[0] == 0
    for turn in range(1, 4):  # the unfed last token is all a turn-end snapshot misses
        assert cached[turn] >= previous[turn - 1] - 1, (turn, cached, previous)
    on.assert_nothing_leaked()


def test_mtp_conversation_is_identical_and_hits(dense_vl):
    off = Engine(dense_vl, caching=False, mtp_step=2)
    on = Engine(dense_vl, caching=True, mtp_step=2)
    want, _, _ = conversation(off)
    got, cached, previous = conversation(on)
    assert got == want
    assert all(cached[t] >= previous[t - 1] - 3 for t in range(1, 4)), (cached, previous)
    assert on.scheduler.stats().mtp_drafts > 0
    on.assert_nothing_leaked()


def _shared_system_prompts(ckpt) -> list[list[int]]:
    system = make_prompt(ckpt, [70], seed=7).token_ids
    return [system + make_prompt(ckpt, [3 + i], seed=20 + i).token_ids for i in range(6)]


def test_concurrent_requests_share_a_system_prompt(tiny_dense):
    prompts = _shared_system_prompts(tiny_dense)
    outs = []
    for caching in (False, True):
        engine = Engine(tiny_dense, caching=caching)
        engine.add("warm", prompts[0][:71], max_tokens=1)  # the system prompt gets cached
        engine.run()
        for i, prompt in enumerate(prompts):
            engine.add(f"r{i}", prompt)
        outs.append(engine.run())
    assert outs[0] == outs[1]
    assert engine.hits() >= 6 * 64  # each restored the snapshot at 64 (of the 70 shared)
    engine.assert_nothing_leaked()


def test_eviction_under_a_small_pool(tiny_moe):
    prompts = _shared_system_prompts(tiny_moe) + [
        make_prompt(tiny_moe, [60 + i], seed=40 + i).token_ids for i in range(4)
    ]
    outs, engines = [], []
    for caching in (False, True):
        engine = Engine(tiny_moe, caching=caching, num_kv_slots=300, snapshot_slots=3)
        for round_ in range(2):
            for i, prompt in enumerate(prompts):
                engine.add(f"{round_}-{i}", prompt, max_tokens=8)
        outs.append(engine.run())
        engines.append(engine)
    assert outs[0] == outs[1]
    stats = engines[1].scheduler.stats()
    assert stats.prefix_cache_hits > 0 and stats.snapshots_used <= 3
    engines[1].assert_nothing_leaked()


def test_abort_in_the_middle_of_a_hits_prefill(tiny_dense):
    base = make_prompt(tiny_dense, [40], seed=3).token_ids
    engine = Engine(tiny_dense, caching=True, max_num_batched_tokens=16)
    engine.add("a", base)
    first = engine.run()["a"]
    long = base + first + make_prompt(tiny_dense, [60], seed=4).token_ids
    engine.add("b", long)
    engine.core.step()  # admitted at its cached prefix, one chunk in
    b = engine.scheduler.get_request("b")
    assert b.num_cached_tokens >= len(base) + len(first) - 1 and b.num_computed < len(long)
    engine.core.abort("b")
    engine.run()
    engine.add("c", long)
    got = engine.run()["c"]
    ref = Engine(tiny_dense, caching=False)
    ref.add("c", long)
    assert got == ref.run()["c"]
    engine.assert_nothing_leaked()


def test_snapshot_pool_plan():
    """--snapshot-slots wins; auto is 4 x max_num_seqs, on a GPU within snapshot_mem_fraction of
    the pool memory, and beside a fixed --num-kv-slots pool within what it leaves."""
    mib = 2**20
    assert plan_snapshot_slots(5, 64, 150 * mib, 1000 * mib, 0.2) == 5
    assert plan_snapshot_slots(0, 64, 150 * mib, None, 0.2) == 256  # CPU: no memory bound
    assert plan_snapshot_slots(0, 64, 150 * mib, 60_000 * mib, 0.2) == 80
    assert plan_snapshot_slots(0, 64, 150 * mib, 60_000 * mib, 0.2, 58_500 * mib) == 10
    assert plan_snapshot_slots(0, 64, 150 * mib, 60_000 * mib, 0.2, 70_000 * mib) == 0
