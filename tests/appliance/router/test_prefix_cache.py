"""The prefix cache: the radix tree alone (match, split, snapshots, locks, LRU eviction, image
keys), and the scheduler with it against the fake worker, which checks that every cached KV slot
holds the request's token and every restored snapshot covers exactly the cached prefix; the
operator's reset (/reset_prefix_cache) with running requests and plans in flight."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fake_worker import (
    FakeWorker,
    assert_pools_empty,
    make_scheduler,
    prompt_of,
    reference_tokens,
    req,
    run,
    run_pipelined,
)

from appliance.config import SchedulerConfig
from appliance.messages import ImageInput
from appliance.router.allocators import RefCountedSlots, SlotAllocator
from appliance.router.prefix_cache import PrefixCache, cache_keys
from appliance.router.scheduler import Scheduler


def tree(num_kv: int = 100, num_snapshots: int = 8, hybrid: bool = True):
    kv, snaps = RefCountedSlots(num_kv, "kv"), SlotAllocator(num_snapshots, "snap")
    return PrefixCache(kv, snaps, hybrid), kv, snaps


def keys(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_match_stops_at_the_deepest_snapshot_within_the_match():
    cache, kv, snaps = tree()
    slots = kv.alloc(6)
    cache.insert(keys(1, 2, 3), slots[:3], snaps.alloc_one())
    node, kept = cache.insert(keys(1, 2, 3, 4, 5, 6), slots, snaps.alloc_one())
    assert kept and node.end == 6
    m = cache.match(keys(1, 2, 3, 4, 5, 9), limit=6)  # diverges at 5: only the snapshot at 3
    assert m.length == 3 and m.snapshot == 0 and m.kv_slots().tolist() == slots[:3].tolist()
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7), limit=6).length == 6
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7), limit=5).length == 3  # limit: compute one
    assert cache.match(keys(2, 2), limit=2).length == 0


def test_without_linear_state_any_matched_length_is_usable_and_splits_the_edge():
    cache, kv, _ = tree(hybrid=False)
    slots = kv.alloc(5)
    cache.insert(keys(1, 2, 3, 4, 5), slots)
    m = cache.match(keys(1, 2, 3, 9), limit=3)
    assert m.length == 3 and m.node.end == 3 and cache.num_nodes == 2
    assert m.kv_slots().tolist() == slots[:3].tolist()


def test_insert_references_only_new_positions_and_eviction_frees_them():
    cache, kv, snaps = tree(num_kv=10)
    a = kv.alloc(4)
    cache.insert(keys(1, 2, 3, 4), a, snaps.alloc_one())
    b = kv.alloc(4)  # a second request computed the same head, then its own tail
    node, _ = cache.insert(keys(1, 2, 7, 8), b, snaps.alloc_one())
    assert [kv.refs(int(s)) for s in a] == [2, 2, 2, 2] and kv.refs(int(b[0])) == 1
    assert kv.refs(int(b[2])) == 2 and cache.num_tokens == 6
    kv.free(a)
    kv.free(b)  # both requests ended: the tree alone holds 6 slots
    assert kv.num_used == 6 and cache.num_evictable == 6
    cache.lock(node)
    cache.evict(kv_slots=10)  # 1,2 -> 7,8 is locked; 3,4 goes with its snapshot
    assert kv.num_used == 4 and snaps.num_used == 1 and cache.num_evictable == 0
    cache.unlock(node)
    cache.clear()
    assert kv.num_used == 0 and snaps.num_used == 0 and cache.num_nodes == 0


def test_eviction_is_least_recently_used_first():
    cache, kv, snaps = tree(num_kv=6)
    for first in (1, 2, 3):
        slots = kv.alloc(2)
        cache.insert(keys(first, 0), slots, snaps.alloc_one())
        kv.free(slots)
    cache.match(keys(1, 0, 5), limit=2)  # 1 is used again: 2 is now the oldest
    cache.evict(kv_slots=2)
    assert sorted(cache.root.children) == [1, 3]


def test_covered_snapshots_go_by_kind_and_branch_points_stay():
    cache, kv, snaps = tree(num_snapshots=8)
    slots = kv.alloc(16)
    cache.insert(keys(1, 2, 3), slots[:3], snaps.alloc_one(), "interval")  # 0: covered below
    cache.insert(keys(1, 2, 3, 4, 5, 6), slots[:6], snaps.alloc_one(), "prompt")  # 1
    cache.insert(keys(1, 2, 3, 4, 5, 6, 7), slots[:7], snaps.alloc_one())  # 2: its end, a leaf
    cache.insert(keys(8, 8), slots[7:9], snaps.alloc_one(), "turn")  # 3: a chat turn's start
    cache.insert(keys(8, 8, 8), slots[7:10], snaps.alloc_one())  # 4: its end
    cache.insert(keys(9, 9), slots[10:12], snaps.alloc_one(), "interval")  # 5: a branch point
    cache.insert(keys(9, 9, 1), np.append(slots[10:12], slots[12]), -1)
    cache.insert(keys(9, 9, 2), np.append(slots[10:12], slots[13]), -1)
    assert cache.drop_covered_snapshot() and snaps.num_free == 3  # the interval point
    assert cache.match(keys(1, 2, 3, 9), limit=4).length == 0  # diverging above the next: lost
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7, 0), limit=8).length == 7
    assert not cache.drop_covered_snapshot()  # the branch point stays
    # a prompt's end under its generation's end: the next turn may start at either; the turn
    # start stays whatever is below it
    assert not cache.drop_covered_snapshot(("prompt", "end"))
    cache.insert(keys(1, 2, 3, 4, 5, 6, 7, 8, 9), slots[:9], snaps.alloc_one(), "prompt")  # 6
    cache.match(keys(1, 2, 3, 4, 5, 6), limit=6)  # the prompt's end is used last
    assert cache.drop_covered_snapshot(("prompt", "end"))  # the next turn went past: the end
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7, 0), limit=8).length == 6
    assert cache.drop_covered_snapshot(("prompt", "end"))  # and then the prompt's end
    assert not cache.drop_covered_snapshot(("prompt", "end", "interval"))
    assert cache.match(keys(8, 8, 5), limit=3).length == 2
    assert cache.match(keys(9, 9, 5), limit=3).length == 2
    node, kept = cache.insert(keys(8, 8), slots[7:9], snaps.alloc_one(), "interval")
    assert not kept and node.kind == "turn"  # a point of two kinds keeps the stronger


@pytest.mark.parametrize("resend", ["answer", "other", "chat"])
def test_concurrent_conversations_keep_hitting_with_few_snapshot_slots(resend):
    """Rounds of turns of several conversations at once, interval snapshots on, fewer snapshot
    slots than a round takes (about two per waiting conversation, 11 for 4): superseded snapshots
    (earlier turns, interval points, chat requests' ends) make room, so every turn still hits
    its conversation's previous turn: its end when the client re-sends the generated answer,
    else its prompt; a chat client, which re-renders the answer, its turn start."""
    sched = make_scheduler(budget=48, max_num_seqs=4, linear_state=True, num_snapshot_slots=11)
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 16})
    worker = FakeWorker(2000)
    prompts = {c: prompt_of(24, 20 + c) for c in range(4)}
    previous: dict[int, int] = {}
    for turn in range(4):
        for c, prompt in prompts.items():
            chat = {"turn_start": len(prompt) - 3} if resend == "chat" else {}
            sched.add_request(req(f"c{c}t{turn}", prompt, max_tokens=5, **chat))
        out = run(sched, worker, keep_cache=True)
        for c, prompt in prompts.items():
            assert out.tokens[f"c{c}t{turn}"] == reference_tokens(prompt, 5)
            new = [n for p in worker.plans for n in p.new_requests if n.token_ids == prompt]
            if turn:
                assert len(new[-1].cached_kv_slots) >= previous[c], (turn, c)
            answer = out.tokens[f"c{c}t{turn}"] if resend == "answer" else prompt_of(5, 60 + c)
            previous[c] = len(prompt) + 4 if resend == "answer" else len(prompt)
            if resend == "chat":  # the template re-renders the answer after the turn start
                previous[c] = len(prompt) - 3
                prompt = prompt[:-3] + prompt_of(3, 70 + c)
            prompts[c] = prompt + answer + prompt_of(9, 40 + turn)
    sched.cache.clear()
    assert_pools_empty(sched)


def test_images_key_by_content_not_handle():
    tokens = [5, 9, 9, 9, 6]
    a = ImageInput(1, 3, (1, 2, 6), handle="shm-1", content_key="sha256:aa")
    b = ImageInput(1, 3, (1, 2, 6), handle="shm-2", content_key="sha256:aa")
    c = ImageInput(1, 3, (1, 2, 6), handle="shm-1", content_key="sha256:bb")
    assert (cache_keys(tokens, [a]) == cache_keys(tokens, [b])).all()
    assert (
        cache_keys(tokens, [a])[1] < 0 and cache_keys(tokens, [a])[1] != cache_keys(tokens, [c])[1]
    )
    assert cache_keys(tokens, [a])[2:].tolist() == [9, 9, 6]


def test_a_cache_salt_keys_the_first_position_by_salt_and_token():
    tokens = [5, 9, 9, 6]
    plain = cache_keys(tokens, [])
    salted = cache_keys(tokens, [], "tenant-a")
    assert salted[0] < 0 and salted[1:].tolist() == plain[1:].tolist() == [9, 9, 6]
    assert (cache_keys(tokens, [], "tenant-a") == salted).all()
    assert cache_keys(tokens, [], "tenant-b")[0] != salted[0]
    assert cache_keys([4, 9, 9, 6], [], "tenant-a")[0] != salted[0]  # the token still counts
    assert plain.tolist() == tokens  # the caller's ids are not written over


# ---------------------------------------------------------------- with the scheduler

HYBRID = dict(linear_state=True, num_snapshot_slots=16)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("driver", [run, run_pipelined])
def test_conversation_turns_hit_the_previous_turn(hybrid, driver):
    sched = make_scheduler(budget=16, **(HYBRID if hybrid else {}))
    worker = FakeWorker(1000)
    prompt, previous = prompt_of(40, 1), 0
    for turn in range(4):
        sched.add_request(req(f"t{turn}", prompt, max_tokens=6))
        hits_before = sched.stats().prefix_cache_hits
        out = driver(sched, worker, keep_cache=True)
        assert out.tokens[f"t{turn}"] == reference_tokens(prompt, 6)
        cached = sched.stats().prefix_cache_hits - hits_before
        if turn:
            assert cached >= previous - 1  # prompt + completion, less the unfed last token
        previous = len(prompt) + 6
        prompt = prompt + out.tokens[f"t{turn}"] + prompt_of(7, turn + 2)
    assert sched.stats().kv_used == 0
    assert_pools_empty(sched)


def test_periodic_snapshots_let_a_shared_head_hit():
    sched = make_scheduler(budget=64, **HYBRID)
    worker = FakeWorker(1000)
    head = prompt_of(40, 3)
    sched.add_request(req("a", head + [1, 2, 3], max_tokens=2))
    run(sched, worker, keep_cache=True)
    sched.add_request(req("b", head + [4, 5], max_tokens=2))
    out = run(sched, worker, keep_cache=True)
    # snapshot_interval (2048) is past the prompt: only the prompt/generation ends were kept
    assert sched.stats().prefix_cache_hits == 0 and out.tokens["b"] == reference_tokens(
        head + [4, 5], 2
    )
    short = make_scheduler(budget=64, **HYBRID)
    short.config = type(short.config)(**{**short.config.__dict__, "snapshot_interval": 16})
    worker = FakeWorker(1000)
    short.add_request(req("a", head + [1, 2, 3], max_tokens=2))
    run(short, worker, keep_cache=True)
    short.add_request(req("b", head + [4, 5], max_tokens=2))
    out = run(short, worker, keep_cache=True)
    assert short.stats().prefix_cache_hits == 32  # the snapshot at 32 of the shared 40
    assert out.tokens["b"] == reference_tokens(head + [4, 5], 2)
    assert_pools_empty(short)


@pytest.mark.parametrize("driver", [run, run_pipelined])
def test_a_chat_turn_start_is_a_cache_point(driver):
    """A chat's next turn re-renders the last reply (without its <think> block), so it first
    differs from this turn's prompt inside the generation prompt: the state is kept at
    `turn_start` (where that prompt starts) and the next turn restores it."""
    sched = make_scheduler(budget=64, **HYBRID)  # snapshot_interval 2048: past these prompts
    worker = FakeWorker(1000)
    history, generation_prompt = prompt_of(45, 5), [7, 8, 9]
    sched.add_request(req("a", history + generation_prompt, max_tokens=4, turn_start=45))
    assert driver(sched, worker, keep_cache=True).max_step_tokens == 45  # cut at the turn start
    again = history + [1, 2] + prompt_of(6, 6)  # the reply as re-rendered, a new user turn
    sched.add_request(req("b", again, max_tokens=4))
    out = driver(sched, worker, keep_cache=True)
    assert sched.stats().prefix_cache_hits == 45  # without the cut: 0 (no snapshot below 48)
    assert out.tokens["b"] == reference_tokens(again, 4)
    assert_pools_empty(sched)


@pytest.mark.parametrize("hybrid", [False, True])
def test_concurrent_requests_share_a_system_prompt(hybrid):
    sched = make_scheduler(budget=64, max_num_seqs=8, **(HYBRID if hybrid else {}))
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 16})
    worker = FakeWorker(1000)
    system = prompt_of(30, 9)
    sched.add_request(req("first", system + [1], max_tokens=3))
    plan = sched.schedule()
    sched.update(worker.execute(plan))  # the first prompt is in the tree now
    prompts = {f"r{i}": system + [i + 2, i + 3] for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=4))
    out = run(sched, worker, keep_cache=True)
    for rid, prompt in prompts.items():
        assert out.tokens[rid] == reference_tokens(prompt, 4)
    news = [n for p in worker.plans for n in p.new_requests if len(n.token_ids) == 32]
    # the prompts leave the first one's at 30; a hybrid model restores the snapshot at 16
    hit = 16 if hybrid else 30
    assert len(news) == 6 and all(len(n.cached_kv_slots) == hit for n in news)
    assert_pools_empty(sched)


@pytest.mark.parametrize("hybrid", [False, True])
def test_only_requests_of_one_cache_salt_share_a_prefix(hybrid):
    """vLLM's cache_salt: a salted prompt hits only what a prompt of the same salt cached; an
    unsalted one hits neither salted entry, and tokens stay right either way."""
    sched = make_scheduler(budget=64, **(HYBRID if hybrid else {}))
    # a hybrid model hits only at a snapshot below the prompt's end: one every 16 positions
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 16})
    worker = FakeWorker(1000)
    prompt = prompt_of(40, 4)
    hits = []
    for rid, salt in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("none", ""), ("b2", "b")):
        request = req(rid, prompt, max_tokens=3)
        request.cache_salt = salt
        sched.add_request(request)
        before = sched.stats().prefix_cache_hits
        out = run(sched, worker, keep_cache=True)
        assert out.tokens[rid] == reference_tokens(prompt, 3)
        hits.append(sched.stats().prefix_cache_hits - before)
    assert hits[0] == hits[1] == hits[3] == 0
    assert hits[2] > 0 and hits[4] > 0  # the second of each salt
    assert_pools_empty(sched)


@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefixes_under_pressure_match_reference(seed):
    rng = random.Random(seed)
    num_kv = rng.choice([48, 80, 160])
    sched = make_scheduler(
        num_kv_slots=num_kv,
        budget=rng.choice([3, 8, 32]),
        max_num_seqs=rng.choice([1, 3, 8]),
        decode_reserve=rng.choice([0, 4]),
        linear_state=True,
        num_snapshot_slots=rng.choice([1, 4, 32]),
    )
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 8})
    worker = FakeWorker(num_kv)
    heads = [prompt_of(rng.randint(4, 24), salt=seed * 10 + h) for h in range(3)]
    expected = {}
    for i in range(24):
        prompt = rng.choice(heads) + prompt_of(rng.randint(1, 8), salt=1000 + i)
        max_tokens = rng.randint(1, min(12, num_kv - len(prompt) + 1))
        sched.add_request(req(f"r{i}", prompt, max_tokens=max_tokens))
        expected[f"r{i}"] = reference_tokens(prompt, max_tokens)
        if rng.random() < 0.3:
            out = run(sched, worker, keep_cache=True)
            for rid, tokens in out.tokens.items():
                assert tokens == expected.pop(rid)
    out = run(sched, worker)  # ends with every pool empty once the cache lets go
    assert dict(out.tokens) == expected
    if sched.snapshots.num_total >= 4:  # (one slot goes to each request's end: few hits)
        assert sched.stats().prefix_cache_hits > 0


def test_abort_mid_prefill_of_a_hit_frees_its_own_slots_only():
    sched = make_scheduler(budget=8, **HYBRID)
    worker = FakeWorker(1000)
    base = prompt_of(20, 4)
    sched.add_request(req("a", base, max_tokens=3))
    run(sched, worker, keep_cache=True)
    held = sched.kv.num_used
    sched.add_request(req("b", base + reference_tokens(base, 3) + prompt_of(30, 5), max_tokens=3))
    sched.update(worker.execute(sched.schedule()))  # b restored 22 positions, prefills 8 more
    b = sched.get_request("b")
    assert b.num_cached_tokens == 22 and b.num_computed == 30
    sched.abort("b")
    assert sched.kv.num_used == held and sched.stats().kv_used == 0
    sched.add_request(req("c", base + reference_tokens(base, 3), max_tokens=2))
    out = run(sched, worker)
    assert out.tokens["c"] == reference_tokens(base + reference_tokens(base, 3), 2)


def test_a_turn_end_takes_the_oldest_snapshot_even_from_a_running_path():
    sched = make_scheduler(budget=64, max_num_seqs=2, linear_state=True, num_snapshot_slots=2)
    worker = FakeWorker(1000)
    other, convo = prompt_of(30, 6), prompt_of(20, 7)
    sched.add_request(req("long", other, max_tokens=40))  # runs throughout, holds its snapshot
    sched.add_request(req("turn1", convo, max_tokens=3))
    for _ in range(6):  # both prompts are in the tree (2 snapshots); turn1 ends
        sched.update(worker.execute(sched.schedule()))
    assert sched.get_request("turn1") is None and sched.snapshots.num_free == 0
    following = convo + reference_tokens(convo, 3) + [1, 2]
    sched.add_request(req("turn2", following, max_tokens=2))
    out = run(sched, worker)
    assert out.tokens["turn2"] == reference_tokens(following, 2)
    news = [n for p in worker.plans for n in p.new_requests if len(n.token_ids) == len(following)]
    assert len(news[0].cached_kv_slots) == len(convo) + 2  # turn 1's end, not just its prompt


def test_a_prompts_keys_are_built_once(monkeypatch):
    """The keys of a long prompt (~10 ms at 128k tokens) are built once, not at every cache point
    or admission attempt; a token added builds them again."""
    import appliance.router.scheduler as scheduler_module

    calls = []

    def counted(token_ids, mm, salt=""):
        calls.append(len(token_ids))
        return cache_keys(token_ids, mm, salt)

    monkeypatch.setattr(scheduler_module, "cache_keys", counted)
    sched = make_scheduler(budget=16, **HYBRID)
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 16})
    sched.add_request(req("a", prompt_of(80, 9), max_tokens=3))
    out = run(sched, FakeWorker(1000), keep_cache=True)
    assert out.tokens["a"] == reference_tokens(prompt_of(80, 9), 3)
    assert calls == [80, 83]  # admission and the 5 cache points; the end (every known token)
    assert_pools_empty(sched)


# ---------------------------------------------------------------- reset (/reset_prefix_cache)


def interval_scheduler(**kwargs):
    sched = make_scheduler(**{"budget": 64, **HYBRID, **kwargs})
    sched.config = type(sched.config)(**{**sched.config.__dict__, "snapshot_interval": 16})
    return sched


def test_reset_frees_every_entry_but_a_running_requests_path():
    sched, worker = interval_scheduler(), FakeWorker(1000)
    done, live = prompt_of(40, 11), prompt_of(30, 13)
    for rid, prompt in (("done", done), ("other", prompt_of(36, 12))):
        sched.add_request(req(rid, prompt, max_tokens=3))
        run(sched, worker, keep_cache=True)
    sched.add_request(req("live", live, max_tokens=50))
    for _ in range(4):  # its prompt is in the tree (points at 16 and 30), locked; it decodes
        sched.update(worker.execute(sched.schedule()))
    running = sched.get_request("live")
    assert running.prefix_node.end == 30 and running.num_output_tokens == 3
    held, snapshots = sched.cache.num_tokens, sched.snapshots.num_used
    cleared = sched.reset_prefix_cache()
    # the two finished requests' entries go; the running one's path stays whole
    assert (cleared.kept_tokens, cleared.kept_snapshots) == (30, 2)
    assert cleared.freed_tokens == held - 30 > 0 and cleared.freed_snapshots == snapshots - 2 > 0
    assert sched.cache.num_tokens == 30 and sched.cache.num_evictable == 0
    assert sched.snapshots.num_used == 2 and sched.kv.num_used == running.num_kv
    stats = sched.stats()
    assert stats.prefix_cache_tokens == 30 and stats.kv_used == running.num_kv
    assert stats.snapshots_used == 2
    # the same prompt again misses; the running request's prefix still hits
    hits = stats.prefix_cache_hits
    sched.add_request(req("again", done, max_tokens=3))
    sched.add_request(req("shares", live + [1, 2], max_tokens=3))
    out = run(sched, worker, keep_cache=True)
    news = {n.token_ids[-1]: n for p in worker.plans[-out.steps :] for n in p.new_requests}
    assert news[done[-1]].cached_kv_slots == [] and news[done[-1]].restore_snapshot == -1
    assert sched.stats().prefix_cache_hits - hits == len(news[2].cached_kv_slots) == 30
    assert out.tokens["again"] == reference_tokens(done, 3)
    assert out.tokens["live"][-1] == reference_tokens(live, 50)[-1]
    assert_pools_empty(sched)


def test_reset_with_a_restore_in_flight_is_safe():
    """A reset between plans frees the snapshot and KV slots a plan in flight reads (its request
    was aborted meanwhile); the next plan reuses them, and the worker, running plans in order,
    has read them first (the fake worker checks every restore and KV read)."""
    sched, worker = interval_scheduler(num_kv_slots=80, num_snapshot_slots=2), FakeWorker(80)
    head = prompt_of(40, 14)
    sched.add_request(req("a", head, max_tokens=2))
    run(sched, worker, keep_cache=True)
    sched.add_request(req("b", head + [3, 4, 5], max_tokens=2))
    in_flight = sched.schedule()  # b restores the snapshot at 32 and reads its KV
    assert in_flight.new_requests[0].restore_snapshot >= 0
    sched.abort("b")
    cleared = sched.reset_prefix_cache()
    assert cleared.kept_tokens == 0 and sched.kv.num_used == sched.cache.num_tokens == 0
    assert sched.snapshots.num_used == 1  # b's prompt end, saved in flight: freed with its result
    fresh = prompt_of(70, 15)  # needs every KV slot b read and a snapshot slot
    sched.add_request(req("c", fresh, max_tokens=3))
    following = sched.schedule()
    b_admitted = in_flight.new_requests[0]
    assert following.new_requests[0].cached_kv_slots == []
    # c's point at 16 takes the snapshot b restores, and its KV some of the slots b reads
    assert following.chunks[0].save_snapshot == b_admitted.restore_snapshot
    assert set(sched.get_request("c").kv_slots.tolist()) & set(b_admitted.cached_kv_slots)
    for plan in (in_flight, following):  # in order, as the workers run them
        assert sched.update(worker.execute(plan)) == []  # b's sample is dropped
    out = run(sched, worker)
    assert out.tokens["c"] == reference_tokens(fresh, 3)


def test_reset_with_caching_off_reports_none():
    config = SchedulerConfig(max_num_batched_tokens=64, prefix_caching=False)
    sched = Scheduler(config, 100, 100, linear_state=True, num_snapshot_slots=4)
    assert sched.cache is None and sched.reset_prefix_cache() is None
