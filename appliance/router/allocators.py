"""Slot allocators owned by the router: request slots (which also index the worker's
linear-attention state pool) and token-granular KV slots. Pure numpy; called by the scheduler.
"""

from __future__ import annotations

import numpy as np


class OutOfSlots(RuntimeError):
    """An allocation asked for more slots than are free (callers check `num_free` first)."""


class SlotAllocator:
    """Free-list of integer slots 0..num_slots-1 kept as a numpy stack: O(1) calls, O(n) copies.

    Fresh pools hand out ascending ids (0, 1, 2, ...); freed slots are reused last-in first-out. A
    per-slot `in_use` mask catches double frees and frees of slots never handed out (invariants).
    """

    def __init__(self, num_slots: int, name: str = "slots") -> None:
        if num_slots < 0:
            raise ValueError(f"{name}: expected a slot count >= 0, got {num_slots}")
        self.name = name
        self.num_total = num_slots
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int32)  # top of stack = end
        self._top = num_slots  # number of free slots = live part of the stack
        self._in_use = np.zeros(num_slots, dtype=bool)
        self._stamp = np.zeros(num_slots, dtype=np.int32)  # scratch of `distinct`

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_total - self._top

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self._top

    def alloc(self, n: int) -> np.ndarray:
        """Returns `n` distinct free slots as int32 [n]."""
        if n < 0 or n > self._top:
            raise OutOfSlots(f"{self.name}: asked for {n}, {self._top} free of {self.num_total}")
        slots = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._in_use[slots] = True
        return slots

    def distinct(self, slots: np.ndarray) -> bool:
        """No slot twice in `slots` (O(n), no sort: an 8k-slot request's free took ~3 ms with
        np.unique and ufunc.at on the CI box)."""
        order = np.arange(slots.size, dtype=np.int32)
        self._stamp[slots] = order  # a repeated slot keeps its last index only
        return bool((self._stamp[slots] == order).all())

    def alloc_one(self) -> int:
        return int(self.alloc(1)[0])

    def free(self, slots: np.ndarray | list[int] | int) -> None:
        slots = np.atleast_1d(np.asarray(slots, dtype=np.int32))
        if slots.size == 0:
            return
        assert self._in_use[slots].all(), f"{self.name}: freeing a slot that is not allocated"
        assert self.distinct(slots), f"{self.name}: duplicate slots in one free"
        self._push(slots)

    def _push(self, slots: np.ndarray) -> None:
        """Back on the free list: distinct allocated slots (the callers checked)."""
        self._in_use[slots] = False
        # Push in reverse so that alloc(n) right after free(x) returns x in its original order.
        self._stack[self._top : self._top + slots.size] = slots[::-1]
        self._top += slots.size

    def is_allocated(self, slot: int) -> bool:
        return bool(self._in_use[slot])


class RefCountedSlots(SlotAllocator):
    """A SlotAllocator whose slots carry reference counts: the KV pool, where a slot may be held by
    several running requests and the prefix tree at once. `alloc` hands out slots with one
    reference, `incref` adds one, and `free` drops one; a slot returns to the free list when its
    last reference goes."""

    def __init__(self, num_slots: int, name: str = "slots") -> None:
        super().__init__(num_slots, name)
        self._refs = np.zeros(num_slots, dtype=np.int32)

    def alloc(self, n: int) -> np.ndarray:
        slots = super().alloc(n)
        self._refs[slots] = 1
        return slots

    def incref(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int32)
        assert self._in_use[slots].all(), f"{self.name}: referencing a free slot"
        if self.distinct(slots):
            self._refs[slots] += 1
        else:
            np.add.at(self._refs, slots, 1)

    def free(self, slots: np.ndarray | list[int] | int) -> None:
        slots = np.atleast_1d(np.asarray(slots, dtype=np.int32))
        if slots.size == 0:
            return
        assert (self._refs[slots] > 0).all(), f"{self.name}: freeing a slot that is not allocated"
        if self.distinct(slots):
            self._refs[slots] -= 1
            dead = slots[self._refs[slots] == 0]
        else:
            np.subtract.at(self._refs, slots, 1)
            dead = np.unique(slots[self._refs[slots] == 0])
        if dead.size:  # (allocated and distinct: checked above)
            self._push(dead)

    def refs(self, slot: int) -> int:
        return int(self._refs[slot])
