"""Radix tree over token ids that maps cached prefixes to their KV slots (page size 1).

Each edge holds a run of token ids (`key`) and the KV slots computed for them (`value`). A request
looks up its prompt, reuses the slots of the longest cached prefix, and locks the path so the slots
cannot be evicted while it runs; when it finishes it inserts prompt + output and unlocks. Eviction
removes unlocked leaves, least recently used first.

Ownership: slots stored in the tree belong to the tree; it gives them back to the allocator on
eviction, on reset, and when an insert brings duplicates of tokens it already holds.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import numpy as np

from radixserve.cache.slot_allocator import TokenSlotAllocator

_EMPTY = np.zeros(0, dtype=np.int32)


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "id")

    _ids = itertools.count()

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None, last_access: int):
        self.key = key  # int32 token ids of this edge
        self.value = value  # int32 KV slots, one per token of `key`
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent
        self.lock_ref = 0  # running requests whose cached prefix passes through this node
        self.last_access = last_access
        self.id = next(TreeNode._ids)  # heap tie-break; nodes themselves are not orderable

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class MatchResult(NamedTuple):
    slots: np.ndarray  # int32 KV slots of the matched prefix
    last_node: TreeNode  # the node ending exactly at the match (root when nothing matched)


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = a[:n] != b[:n]
    first = int(mismatch.argmax())
    return first if mismatch[first] else n


class RadixCache:
    """Prefix cache keyed by token ids.

    Sizes are token counts: `evictable_size` counts tokens in unlocked nodes (all reclaimable by
    repeated leaf eviction), `protected_size` those in locked nodes; their sum is everything cached.
    Unlocked leaves are kept in `_evictable_leaves` plus a min-heap by last_access whose stale
    entries (node since locked, evicted or touched again) are skipped when popped, so eviction costs
    O(log n) per node and never walks the tree.
    """

    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False):
        self.allocator = allocator
        self.disable = disable
        self._clock = itertools.count(1)
        # Told of every change to what is cached (inserted(tokens), evicted(path, key), cleared()): a data-parallel
        # scheduler reports them so the front end's mirror of this tree stays exact (scheduler_service/cache_events.py).
        self.listener = None
        self._clear()

    def _clear(self) -> None:
        self.root = TreeNode(_EMPTY, _EMPTY, None, 0)
        # The root is never evicted nor counted; a permanent lock keeps it out of every leaf check.
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._heap: list[tuple[int, int, TreeNode]] = []

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---------------------------------------------------------------- lookup / insert

    def match_prefix(self, tokens) -> MatchResult:
        """Longest cached prefix of `tokens` and its slots; touches the path for LRU.

        A node matched only partly is split so that last_node ends exactly at the match and can be
        locked on its own. The scheduler passes prompt[:-1]: at least one prompt token must be
        computed to produce logits for the first output token.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.disable or len(tokens) == 0:
            return MatchResult(_EMPTY, self.root)
        path, _ = self._walk(tokens)
        node = path[-1] if path else self.root
        # Always a fresh array: the caller may write into it; the tree's values must not change.
        slots = np.concatenate([n.value for n in path]) if path else _EMPTY.copy()
        return MatchResult(slots, node)

    def insert(self, tokens, slots) -> int:
        """Store tokens -> slots; returns how many leading tokens were already cached.

        For that cached range the tree keeps its own slots and frees the caller's where they differ
        (another request computed and inserted the same tokens meanwhile). The caller's slots for
        the new remainder become the tree's. Either way the caller no longer owns any of `slots`.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        slots = np.asarray(slots, dtype=np.int32)
        if len(tokens) != len(slots):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        if self.disable:
            self.allocator.free(slots)
            return 0
        if len(tokens) == 0:
            return 0
        path, now = self._walk(tokens)
        duplicates = []
        pos = 0
        for node in path:
            ours = slots[pos : pos + len(node)]
            differ = ours != node.value
            if differ.any():
                duplicates.append(ours[differ])
            pos += len(node)
        node = path[-1] if path else self.root
        already_cached = pos
        if pos < len(tokens):
            self._add_leaf(node, tokens[pos:].copy(), slots[pos:].copy(), now)
            if self.listener is not None:
                self.listener.inserted(tokens)
        if duplicates:
            self.allocator.free(np.concatenate(duplicates))
        return already_cached

    # ---------------------------------------------------------------- locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (one running request's cached prefix)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node)."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on an unlocked node {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if not node.children:
                    self._mark_evictable(node)
            node = node.parent

    # ---------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, oldest last_access first, until at least num_tokens slots are
        freed or nothing evictable is left. Returns the number of slots freed."""
        if num_tokens <= 0:
            return 0
        freed = 0
        freed_slots = []
        while freed < num_tokens and self._evictable_leaves:
            last_access, _, node = heapq.heappop(self._heap)
            if node not in self._evictable_leaves or node.last_access != last_access:
                continue  # stale entry
            self._evictable_leaves.remove(node)
            parent = node.parent
            if self.listener is not None:
                self.listener.evicted(self._path_tokens(parent), node.key)
            del parent.children[int(node.key[0])]
            node.parent = None
            freed_slots.append(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            if not parent.children and parent.lock_ref == 0:
                self._mark_evictable(parent)
        if freed_slots:
            self.allocator.free(np.concatenate(freed_slots))
        return freed

    def reset(self) -> None:
        """Free every cached slot and empty the tree (the /flush_cache path). Only when idle."""
        if self.protected_size:
            raise RuntimeError(f"reset() while {self.protected_size} cached tokens are locked by running requests")
        slots = [node.value for node in self._nodes()]
        self._clear()
        if self.listener is not None:
            self.listener.cleared()
        if slots:
            self.allocator.free(np.concatenate(slots))

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Walk the whole tree and verify every bookkeeping field (tests and idle-time audits only)."""
        evictable = protected = 0
        leaves = set()
        for node in self._nodes():
            assert len(node.key) == len(node.value) > 0, f"{node!r}: empty or mismatched key/value"
            assert node.parent.children.get(int(node.key[0])) is node, f"{node!r}: not its parent's child"
            assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
            locked_below = max((c.lock_ref for c in node.children.values()), default=0)
            assert node.lock_ref >= locked_below, f"{node!r}: lock_ref below a child's"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"sizes drifted: counted evictable={evictable} protected={protected}, "
            f"kept evictable={self.evictable_size} protected={self.protected_size}"
        )
        assert leaves == self._evictable_leaves, "evictable-leaf set out of sync with the tree"
        in_heap = {node for access, _, node in self._heap if node.last_access == access}
        assert leaves <= in_heap, "an evictable leaf has no current heap entry"

    # ---------------------------------------------------------------- internals

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self, tokens: np.ndarray) -> tuple[list[TreeNode], int]:
        """The nodes that tokens run through from the root, in order, each wholly matched: a node matched only in
        part is split first. Every node on the path is touched for LRU. Returns the path and the access time."""
        now = next(self._clock)
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            matched = _common_prefix_len(child.key, tokens[pos:])
            if matched < len(child.key):
                child = self._split(child, matched)
            node = child
            self._touch(node, now)
            path.append(node)
            # After a partial match the loop ends by itself: the split-off lower part is the only child and
            # starts with the token that mismatched.
            pos += matched
        return path, now

    def _path_tokens(self, node: TreeNode) -> np.ndarray:
        """The tokens from the root down to the end of node."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return np.concatenate(keys[::-1]) if keys else _EMPTY

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut node after `at` tokens; returns the new upper part. The original object keeps the
        lower part so that references held by running requests (their locked last_node) still end
        at the same token. Lock counts and sizes are unchanged: both parts inherit lock_ref."""
        upper = TreeNode(node.key[:at].copy(), node.value[:at].copy(), node.parent, node.last_access)
        upper.lock_ref = node.lock_ref
        # Copies, not views, so the upper part does not pin the old arrays after the lower is evicted.
        node.key = node.key[at:].copy()
        node.value = node.value[at:].copy()
        upper.parent.children[int(upper.key[0])] = upper
        upper.children[int(node.key[0])] = node
        node.parent = upper
        return upper

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: np.ndarray, now: int) -> None:
        leaf = TreeNode(key, value, parent, now)
        parent.children[int(key[0])] = leaf
        self._evictable_leaves.discard(parent)  # no longer a leaf
        self.evictable_size += len(key)
        self._mark_evictable(leaf)

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        if node in self._evictable_leaves:
            self._push(node)  # the old entry is now stale

    def _mark_evictable(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)
        self._push(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        # Stale entries pile up when hot leaves are touched repeatedly; rebuild once they dominate.
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:
            self._heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
            heapq.heapify(self._heap)
