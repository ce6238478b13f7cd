"""SlotAllocator: ascending fresh ids, reuse after free, exhaustion and invariant checks."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.router import OutOfSlots, SlotAllocator
from appliance.router.allocators import RefCountedSlots


def test_alloc_free_reuse_and_accounting() -> None:
    pool = SlotAllocator(10)
    first = pool.alloc(4)
    assert first.tolist() == [0, 1, 2, 3] and pool.num_used == 4 and pool.num_free == 6
    assert pool.alloc_one() == 4
    pool.free(first[1:3])
    assert pool.num_free == 7 and not pool.is_allocated(1) and pool.is_allocated(0)
    assert pool.alloc(2).tolist() == [1, 2]  # last freed, first reused, in their original order
    assert pool.alloc(5).tolist() == [5, 6, 7, 8, 9]
    assert pool.num_free == 0 and not pool.can_alloc(1) and pool.can_alloc(0)
    with pytest.raises(OutOfSlots):
        pool.alloc(1)


def test_many_slots_stay_distinct_through_churn() -> None:
    rng = np.random.default_rng(0)
    pool = SlotAllocator(1000)
    held: list[np.ndarray] = []
    for _ in range(300):
        if held and (rng.random() < 0.45 or not pool.can_alloc(50)):
            pool.free(held.pop(int(rng.integers(len(held)))))
        else:
            held.append(pool.alloc(int(rng.integers(0, 50))))
        live = np.concatenate(held) if held else np.empty(0, np.int32)
        assert np.unique(live).size == live.size == pool.num_used
    for slots in held:
        pool.free(slots)
    assert pool.num_free == 1000 and sorted(pool.alloc(1000).tolist()) == list(range(1000))


def test_double_free_is_caught() -> None:
    pool = SlotAllocator(4)
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(AssertionError):
        pool.free(slots)
    with pytest.raises(AssertionError):
        pool.free([3])  # never allocated


def test_reference_counts_with_repeated_slots_in_one_call() -> None:
    """A slot named twice in one incref / free counts twice (the no-duplicate fast path must not
    lose one), and `distinct` tells the two cases apart."""
    pool = RefCountedSlots(16, "kv")
    a, b = (int(x) for x in pool.alloc(2))
    assert pool.distinct(np.array([a, b], dtype=np.int32))
    assert not pool.distinct(np.array([a, b, a], dtype=np.int32))
    pool.incref(np.array([a, a, b], dtype=np.int32))
    assert (pool.refs(a), pool.refs(b)) == (3, 2)
    pool.free(np.array([a, a], dtype=np.int32))
    assert pool.refs(a) == 1 and pool.num_free == 14
    pool.free(np.array([a, b], dtype=np.int32))
    assert pool.refs(b) == 1 and pool.num_free == 15
    pool.free(np.array([b], dtype=np.int32))
    assert pool.num_free == 16
