"""The router's prefix cache: a radix tree over token keys whose edges hold the KV slots of their
positions, and (hybrid models) linear-attention state snapshots at node ends. Called by the
Scheduler: `match` at admission, `insert` when a snapshot was written or a request ended, `evict`
under KV or snapshot pool pressure, `clear` when an operator resets the cache.

Keys are token ids, except an image's first position, keyed by the image content (a negative int
from its hash), so the same picture in a later turn matches and a different one with the same
token count does not; a request's `cache_salt` (vLLM's) keys its first position by the salt and
that position's key, so requests share cached prefixes only within one salt. A Gated-DeltaNet
state is one snapshot per position, so on a hybrid model a match is usable only up to the deepest
snapshot at or below the matched length; every snapshot sits at the end of a node (insertion
splits a node there). KV slots are reference counted by the pool (`RefCountedSlots`): the tree
holds one reference per slot of its edges, each running request one per slot it reads, so
evicting a node a request still reads frees nothing and breaks nothing. `lock` counts the live
requests whose prefix ends in or below a node: locked nodes are not evicted (their snapshot may
be restored by a plan in flight, and their KV is still in use).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from appliance.messages import ImageInput
from appliance.router.allocators import RefCountedSlots, SlotAllocator


def image_key(image: ImageInput) -> int:
    """A negative key (token ids are >= 0) for an image's first position, from its content."""
    digest = hashlib.blake2b((image.content_key or image.handle).encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


def salted_key(salt: str, key: int) -> int:
    """A request's first key under its cache salt (vLLM's `cache_salt`): a negative key from the
    salt and the position's own key, so only requests with the same salt and first token share a
    prefix, and none shares with an unsalted request (whose first key is a token id >= 0)."""
    data = (
        b"cache_salt\0"
        + salt.encode("utf-8", "surrogatepass")
        + key.to_bytes(8, "little", signed=True)
    )
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


def cache_keys(token_ids: Sequence[int], mm: Sequence[ImageInput], salt: str = "") -> np.ndarray:
    """int64 [len(token_ids)]: the tree key of each position (the first one salted by `salt`)."""
    keys = np.asarray(token_ids, dtype=np.int64)
    if mm or (salt and keys.size):
        keys = keys.copy()
        for image in mm:
            if image.offset < keys.size:
                keys[image.offset] = image_key(image)
        if salt and keys.size:
            keys[0] = salted_key(salt, int(keys[0]))
    return keys


# what a snapshot was taken at, from the first to drop to the last: a periodic point inside a
# prompt; a chat request's end (a chat client's next turn re-renders the answer before it); a
# completion's prompt end; a completion's end; a chat turn's start (its generation prompt)
SNAPSHOT_KINDS = ("interval", "chat_end", "prompt", "end", "turn")


class Node:
    __slots__ = (
        "key", "kv", "children", "parent", "lock", "last_used", "snapshot", "kind", "end"
    )  # fmt: skip

    def __init__(self, key: np.ndarray, kv: np.ndarray, parent: Node | None, end: int) -> None:
        self.key = key  # int64 [n] keys of the edge from the parent
        self.kv = kv  # int32 [n] KV slot of each of those positions
        self.children: dict[int, Node] = {}  # first key of the child's edge -> child
        self.parent = parent
        self.lock = 0  # live requests whose cached prefix ends at or below this node
        self.last_used = 0
        self.snapshot = -1  # snapshot slot of the state after position end - 1 (-1: none)
        self.kind = ""  # what the snapshot is at: one of SNAPSHOT_KINDS
        self.end = end  # prefix length at the end of this node


class Match:
    """A usable cached prefix: `length` positions, its last node, the snapshot to restore."""

    __slots__ = ("length", "node", "snapshot")

    def __init__(self, length: int, node: Node, snapshot: int) -> None:
        self.length, self.node, self.snapshot = length, node, snapshot

    def kv_slots(self) -> np.ndarray:
        """int32 [length] the KV slots of the prefix, root first."""
        parts, node = [], self.node
        while node.parent is not None:
            parts.append(node.kv)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=np.int32)


@dataclass(frozen=True)
class Cleared:
    """What `PrefixCache.clear` dropped and what it kept (locked by live requests)."""

    freed_tokens: int  # positions dropped (tree KV references)
    freed_snapshots: int  # snapshot slots freed
    kept_tokens: int  # positions left: every node on a live request's path
    kept_snapshots: int  # snapshots on those nodes


class PrefixCache:
    """`needs_snapshots`: a hybrid model (a hit must restore a linear-state snapshot)."""

    def __init__(
        self, kv: RefCountedSlots, snapshots: SlotAllocator, needs_snapshots: bool
    ) -> None:
        self.kv, self.snapshots, self.needs_snapshots = kv, snapshots, needs_snapshots
        self.root = Node(np.empty(0, np.int64), np.empty(0, np.int32), None, 0)
        self.root.lock = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_tokens = 0  # positions held (tree KV references)
        # positions of unlocked nodes: slots only the tree holds (free once evicted)
        self.num_evictable = 0

    # ------------------------------------------------------------------ lookup
    def match(self, keys: np.ndarray, limit: int) -> Match:
        """The longest usable cached prefix of `keys`, at most `limit` positions (a request must
        compute at least its last token). Touches the path (LRU)."""
        node, pos, now = self.root, 0, next(self._clock)
        best = Match(0, self.root, -1)
        while pos < limit:
            child = node.children.get(int(keys[pos]))
            if child is None:
                break
            n = min(child.key.size, limit - pos)
            same = int(np.argmin(np.append(child.key[:n] == keys[pos : pos + n], False)))
            child.last_used = now
            if same < child.key.size:  # ends inside this edge
                if not self.needs_snapshots and same > 0:
                    best = Match(pos + same, self._split(child, same), -1)
                break
            node, pos = child, pos + same
            if not self.needs_snapshots or node.snapshot >= 0:
                best = Match(pos, node, node.snapshot)
        return best

    # ------------------------------------------------------------------ insertion
    def insert(
        self, keys: np.ndarray, kv: np.ndarray, snapshot: int = -1, kind: str = "end"
    ) -> tuple[Node, bool]:
        """Caches positions [0, len(keys)) with their KV slots (the tree takes a reference on the
        slots of positions it did not hold); `snapshot`: the state after the last one, taken at a
        point of `kind` (SNAPSHOT_KINDS). Returns the node ending at len(keys) and whether the
        snapshot was kept (False: the caller frees it, the tree has one there already)."""
        node, pos, now = self.root, 0, next(self._clock)
        total = keys.size
        while pos < total:
            child = node.children.get(int(keys[pos]))
            if child is None:
                new = Node(keys[pos:].copy(), kv[pos:total].astype(np.int32), node, total)
                self.kv.incref(new.kv)
                node.children[int(keys[pos])] = new
                self.num_nodes += 1
                self.num_tokens += new.kv.size
                self.num_evictable += new.kv.size
                node, pos = new, total
                node.last_used = now
                break
            n = min(child.key.size, total - pos)
            same = int(np.argmin(np.append(child.key[:n] == keys[pos : pos + n], False)))
            if same < child.key.size:
                child = self._split(child, same)
            child.last_used = now
            node, pos = child, pos + same
        kept = False
        if snapshot >= 0 and node is not self.root and node.snapshot < 0:
            node.snapshot, node.kind, kept = snapshot, kind, True
        elif node.snapshot >= 0 and snapshot >= 0:  # the point of the two that keeps it longest
            node.kind = max(node.kind, kind, key=SNAPSHOT_KINDS.index)
        return node, kept

    def _split(self, node: Node, at: int) -> Node:
        """Cuts `node`'s edge after `at` keys; returns the new upper node (ending there)."""
        upper = Node(node.key[:at], node.kv[:at], node.parent, node.end - node.key.size + at)
        upper.lock, upper.last_used = node.lock, node.last_used
        upper.children[int(node.key[at])] = node
        node.parent.children[int(node.key[0])] = upper
        node.key, node.kv, node.parent = node.key[at:], node.kv[at:], upper
        self.num_nodes += 1
        return upper

    # ------------------------------------------------------------------ references
    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                self.num_evictable -= node.kv.size
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            assert node.lock >= 0, "prefix cache: unlocked more often than locked"
            if node.lock == 0:
                self.num_evictable += node.kv.size
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, kv_slots: int = 0, snapshots: int = 0) -> None:
        """Drops least recently used unlocked leaves until `kv_slots` KV slots and `snapshots`
        snapshot slots are free, or nothing more can go."""
        if self.kv.num_free >= kv_slots and self.snapshots.num_free >= snapshots:
            return
        heap = [(n.last_used, id(n), n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(heap)
        while heap and (self.kv.num_free < kv_slots or self.snapshots.num_free < snapshots):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._drop(node)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def drop_covered_snapshot(self, kinds: tuple[str, ...] = ("interval",)) -> bool:
        """Frees the least recently used snapshot of one of `kinds` that a deeper one supersedes:
        on a node with a single child holding snapshots below it (a child without any, a dead
        branch, hits nothing past this node on a hybrid model). For an interval point
        any deeper snapshot will do (a long prompt's periodic points once its end is cached);
        for a prompt's or a request's end it must not be a request's end at a leaf, since the
        next turn may start at either of the two (a client re-sending the generated answer hits
        the end, one re-sending other text only the prompt's end): they go once that turn has
        gone past them; a chat turn start goes once a later turn start is cached below it (a
        chat client re-renders the answers, so a conversation resumes at its latest one). A
        request matching through a superseded snapshot reaches the deeper one unless it diverges
        in between, so these go before whole cached entries (evict) and before the LRU snapshot
        of any path (drop_snapshot); a branch point (a shared system prompt) stays, and so does
        any but an interval point on a running request's path (other requests sharing that
        prefix may follow it). Dropping a locked one is safe for the reason given there."""
        best: Node | None = None
        # id(node) -> a snapshot below it: any, one not at a request's end leaf, a turn start
        below: dict[int, tuple[bool, bool, bool]] = {}
        for node in reversed(self._nodes()):  # children before their parents
            any_below = live_below = turn_below = False
            branches = 0  # children with a snapshot in their subtree (the others hit nothing)
            for child in node.children.values():
                child_any, child_live, child_turn = below[id(child)]
                snap = child.snapshot >= 0
                end_leaf = child.kind in ("end", "chat_end") and not child.children
                any_below |= snap or child_any
                live_below |= (snap and not end_leaf) or child_live
                turn_below |= (snap and child.kind == "turn") or child_turn
                branches += snap or child_any
            below[id(node)] = any_below, live_below, turn_below
            if node.snapshot < 0 or node.kind not in kinds or branches != 1:
                continue
            superseded = {"interval": any_below, "turn": turn_below}.get(node.kind, live_below)
            if node.kind != "interval" and node.lock:
                continue  # (a running request read it: others sharing that prefix may follow)
            if superseded and (best is None or node.last_used < best.last_used):
                best = node
        if best is None:
            return False
        self.snapshots.free(best.snapshot)
        best.snapshot = -1
        return True

    def drop_snapshot(self, kinds: tuple[str, ...] = SNAPSHOT_KINDS) -> bool:
        """Frees the least recently used snapshot of one of `kinds`, on any node, locked ones
        included (their requests run on their own state): for when every snapshot sits on a
        running request's path. Safe against restores: a restore runs in the plan that chose
        it, before that plan's chunk saves and any save of a later plan (ended requests' slots
        are allocated between plans and saved first in the next one)."""
        nodes = [n for n in self._nodes() if n.snapshot >= 0 and n.kind in kinds]
        if not nodes:
            return False
        node = min(nodes, key=lambda n: n.last_used)
        self.snapshots.free(node.snapshot)
        node.snapshot = -1
        return True

    def clear(self) -> Cleared:
        """Drops every unlocked node with its KV references and snapshot (a reset, tests); a
        locked node (on a live request's path) stays whole, its ancestors with it. As safe as
        `evict` between plans: a slot freed here is reused only by a later plan, which the worker
        runs after any restore or KV read of the plans before it."""
        tokens, snapshots = self.num_tokens, self.snapshots.num_used
        self.evict(self.kv.num_total + 1, self.snapshots.num_total + 1)
        kept_snapshots = sum(node.snapshot >= 0 for node in self._nodes())
        return Cleared(
            freed_tokens=tokens - self.num_tokens,
            freed_snapshots=snapshots - self.snapshots.num_used,
            kept_tokens=self.num_tokens,
            kept_snapshots=kept_snapshots,
        )

    def _drop(self, node: Node) -> None:
        del node.parent.children[int(node.key[0])]
        self.kv.free(node.kv)
        if node.snapshot >= 0:
            self.snapshots.free(node.snapshot)
        self.num_nodes -= 1
        self.num_tokens -= node.kv.size
        self.num_evictable -= node.kv.size

    def _leaves(self) -> list[Node]:
        return [node for node in self._nodes() if not node.children]

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            out.append(node)
        return out

    @property
    def num_snapshots(self) -> int:
        return self.snapshots.num_used
