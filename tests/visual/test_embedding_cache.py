"""The visual server's embedding cache: LRU eviction by bytes, pins held by live requests, segments
really unlinked from shared memory, and the launcher's cleanup after a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from visual.cache import EmbeddingCache, remove_leftover_segments, segment_name
from visual.shm import ImageInputError, SharedMemoryImageStore, UntrackedSegmentStore

SHM = Path("/dev/shm")


@pytest.fixture
def store():
    return UntrackedSegmentStore()


def _put(store, cache: EmbeddingCache, key: str, owners=(), tokens: int = 4) -> str:
    """A [1 + 1, tokens, 8] fp32 entry (64 * tokens bytes)."""
    embeds = torch.full((tokens, 8), float(len(key)))
    handle = store.put(segment_name(key), embeds, [embeds + 1])
    cache.add(key, handle, 2 * tokens * 8 * 4, owners)
    return handle


def _exists(handle: str) -> bool:
    return (SHM / handle).exists()


def test_lru_evicts_least_recently_used_and_unlinks(store):
    cache = EmbeddingCache(store, capacity_bytes=3 * 256)
    a, b, c = (_put(store, cache, k) for k in ("a", "b", "c"))
    assert len(cache) == 3 and cache.bytes == 768
    assert cache.get("a").handle == a  # a is now the most recently used
    d = _put(store, cache, "d")
    assert "b" not in cache and not _exists(b)  # b was the least recently used
    assert all(k in cache for k in ("a", "c", "d")) and all(map(_exists, (a, c, d)))
    assert cache.num_evicted == 1 and cache.bytes == 768
    # the segment a worker reads holds [main, deepstack] as written
    loaded = SharedMemoryImageStore().load(a)
    assert loaded.shape == (2, 4, 8) and loaded[0, 0, 0] == 1.0 and loaded[1, 0, 0] == 2.0
    cache.clear()
    assert not any(map(_exists, (a, c, d))) and len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ImageInputError):
        SharedMemoryImageStore().load(a)


def test_pinned_entries_survive_eviction_until_released(store):
    cache = EmbeddingCache(store, capacity_bytes=256)  # room for one entry
    a = _put(store, cache, "a", owners=["req-1"])
    b = _put(store, cache, "b", owners=["req-2", "req-2"])  # one image twice in a request
    assert cache.num_pinned == 2 and cache.bytes == 512  # over capacity while pinned
    cache.pin("a", "req-3")  # a cache hit by another request
    assert cache.release("req-1") == 1
    assert "a" in cache and cache.get("a").pins == 1  # req-3 still holds it
    assert cache.release("req-3") == 1
    assert "a" not in cache and not _exists(a)  # unpinned and over capacity: evicted
    assert cache.release("req-2") == 2
    assert "b" in cache and _exists(b) and cache.num_pinned == 0  # within capacity: stays
    assert cache.release("never-pinned") == 0
    cache.clear()


def test_new_entry_is_pinned_before_eviction(store):
    cache = EmbeddingCache(store, capacity_bytes=100)  # smaller than any one entry
    handle = _put(store, cache, "a", owners=["req-1"])
    assert "a" in cache and _exists(handle)
    cache.release("req-1")
    assert "a" not in cache and not _exists(handle)
    handle = _put(store, cache, "b")  # nobody wants it: gone at once
    assert "b" not in cache and not _exists(handle)


def test_duplicate_key_and_bad_capacity_are_refused(store):
    cache = EmbeddingCache(store, capacity_bytes=10_000)
    _put(store, cache, "a")
    with pytest.raises(KeyError):
        cache.add("a", "other", 1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        EmbeddingCache(store, 0)
    cache.clear()


def test_leftover_segments_of_a_dead_process_are_removed(store):
    pid = os.getpid()
    handles = [store.put(segment_name(k), torch.zeros(2, 4)) for k in ("x", "y")]
    other = store.put(segment_name("z", pid + 1), torch.zeros(2, 4))
    assert all(map(_exists, handles)) and handles[0].startswith(f"apimg{pid}_")
    assert remove_leftover_segments(pid) == 2
    assert not any(map(_exists, handles)) and _exists(other)
    store.release(other)
    assert not _exists(other)
