"""Which cached leaf the radix tree evicts first (--radix-eviction-policy).

A policy is an ordering key over tree nodes, smallest evicted first:
- "lru": least recently used (a logical clock, so ties and wall-clock jumps cannot reorder anything);
- "lfu": fewest hits (matches that ran through the node), then least recently used;
- "priority": lowest request priority that ever inserted or matched the node, then least recently used.

EvictableLeaves keeps the tree's unlocked, unpinned leaves in a min-heap by that key, so choosing a victim costs
O(log n) and never walks the tree. Entries are never removed from the middle of the heap: when a leaf's key changes
it is pushed again, and an entry whose node left the set or whose key is no longer the node's current one is stale
and skipped when popped.
"""

from __future__ import annotations

import heapq
from typing import Callable

EVICTION_POLICIES: dict[str, Callable] = {
    "lru": lambda node: (node.last_access,),
    "lfu": lambda node: (node.hit_count, node.last_access),
    "priority": lambda node: (node.priority, node.last_access),
}


class EvictableLeaves:
    """The set of evictable leaves plus a lazily cleaned min-heap of (key, node id, node)."""

    def __init__(self, policy: str):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(EVICTION_POLICIES)}")
        self.policy = policy
        self._key = EVICTION_POLICIES[policy]
        self._members: set = set()
        self._heap: list[tuple] = []

    def __iter__(self):
        return iter(self._members)

    def add(self, node) -> None:
        self._members.add(node)
        self._push(node)

    def discard(self, node) -> None:
        self._members.discard(node)  # its heap entries go stale

    def key_changed(self, node) -> None:
        """The node's last_access, hit_count or priority moved: give it an entry under its new key."""
        if node in self._members:
            self._push(node)

    def pop(self):
        """Remove and return the leaf to evict first, or None when there is none."""
        while self._members:
            key, _, node = heapq.heappop(self._heap)
            if node in self._members and key == self._key(node):
                self._members.remove(node)
                return node
        return None

    def clear(self) -> None:
        self._members.clear()
        self._heap.clear()

    def check(self) -> None:
        """Every member has a heap entry under its current key (check_invariants)."""
        current = {node for key, _, node in self._heap if node in self._members and key == self._key(node)}
        assert current == self._members, "an evictable leaf has no heap entry under its current key"

    def _push(self, node) -> None:
        heapq.heappush(self._heap, (self._key(node), node.id, node))
        # Hot leaves touched again and again leave stale entries behind; rebuild once they dominate.
        if len(self._heap) > 2 * len(self._members) + 64:
            self._heap = [(self._key(n), n.id, n) for n in self._members]
            heapq.heapify(self._heap)
