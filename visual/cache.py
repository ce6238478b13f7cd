"""The visual server's embedding cache index: content key -> shared-memory handle, LRU eviction,
pins held by live requests; also the segments' names and their cleanup after a crash. Torch-free.

Used by the visual server's pipeline (appliance/encoder/pipeline.py, one thread); the launcher calls
`remove_leftover_segments`. The segments themselves are written by the encoder thread through
`visual.shm.UntrackedSegmentStore.put` and unlinked here through `store.release` when an entry is
evicted. A pinned entry (some live request may still be admitted, or re-admitted after preemption,
by a worker that reads its segment) is never evicted; the router's ReleaseImages unpins.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "apimg"
_SHM_DIR = Path("/dev/shm")  # where POSIX shm_open keeps segments on Linux


class SegmentStore(Protocol):
    def release(self, handle: str) -> None: ...


def segment_name(key: str, pid: int | None = None) -> str:
    """Shared-memory name of an image's embeddings: unique per visual server process."""
    return f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_{key}"


def remove_leftover_segments(pid: int) -> int:
    """Unlinks segments a dead visual server (process `pid`) left behind; called by the launcher
    after stopping it. Returns how many were removed (0 where /dev/shm does not exist)."""
    removed = 0
    if _SHM_DIR.is_dir():
        for path in _SHM_DIR.glob(f"{SEGMENT_PREFIX}{pid}_*"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


@dataclass
class CacheEntry:
    key: str  # content hash of the image file and its grid (appliance/server/images.image_key)
    handle: str  # shared-memory segment name (ImageInput.handle)
    nbytes: int  # bytes of its embeddings [1 + deepstack, tokens, hidden]
    pins: int = 0  # live requests holding it


class EmbeddingCache:
    """LRU over content keys, bounded by `capacity_bytes` of unpinned entries."""

    def __init__(self, store: SegmentStore, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: expected an integer >= 1, got {capacity_bytes}")
        self.store = store
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[str, CacheEntry] = collections.OrderedDict()
        self._pinned_by: dict[str, list[str]] = {}  # owner (request id) -> keys it pinned
        self.bytes = 0
        self.num_evicted = 0

    # ------------------------------------------------------------------ lookups
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CacheEntry | None:
        """The entry for `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    def pins_of(self, owner: str) -> list[str]:
        return list(self._pinned_by.get(owner, ()))

    # ------------------------------------------------------------------ changes
    def add(self, key: str, handle: str, nbytes: int, owners: Sequence[str] = ()) -> CacheEntry:
        """Insert a freshly written segment, pinned once per owner, then evict down to capacity
        (pins first, so the new entry cannot be evicted before its requests hold it)."""
        if key in self._entries:
            raise KeyError(f"image {key} is already cached")
        entry = CacheEntry(key, handle, nbytes)
        self._entries[key] = entry
        self.bytes += nbytes
        for owner in owners:
            self.pin(key, owner)
        self.evict()
        return entry

    def pin(self, key: str, owner: str) -> CacheEntry:
        entry = self._entries[key]
        entry.pins += 1
        self._pinned_by.setdefault(owner, []).append(key)
        self._entries.move_to_end(key)
        return entry

    def release(self, owner: str) -> int:
        """Drops every pin `owner` holds; returns how many. Evicts if the cache is over capacity."""
        keys = self._pinned_by.pop(owner, [])
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise AssertionError(f"{owner} held a pin on {key}, which has none")
            entry.pins -= 1
        if keys:
            self.evict()
        return len(keys)

    def evict(self) -> list[str]:
        """Unlinks least recently used unpinned entries until within capacity; returns their keys.
        Pinned entries may keep the cache above capacity (bounded by the live requests)."""
        evicted = []
        if self.bytes <= self.capacity_bytes:
            return evicted
        for key in list(self._entries):
            if self.bytes <= self.capacity_bytes:
                break
            entry = self._entries[key]
            if entry.pins:
                continue
            del self._entries[key]
            self.bytes -= entry.nbytes
            self.store.release(entry.handle)
            evicted.append(key)
        self.num_evicted += len(evicted)
        if self.bytes > self.capacity_bytes:
            logger.debug(
                "embedding cache over capacity while pinned: %d bytes > %d",
                self.bytes,
                self.capacity_bytes,
            )
        return evicted

    def clear(self) -> None:
        """Unlinks every segment (visual server shutdown)."""
        for entry in self._entries.values():
            self.store.release(entry.handle)
        self._entries.clear()
        self._pinned_by.clear()
        self.bytes = 0
