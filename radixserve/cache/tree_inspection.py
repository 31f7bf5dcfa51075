"""Walks over a whole RadixCache that read and never change it: the audit of every bookkeeping field (tests, and the
scheduler when it goes idle) and the dashboard's largest cached prefixes. RadixCache.check_invariants and
RadixCache.largest_prefixes call these; they are apart because neither is on a request's path."""

from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.tree_node import EMPTY, path_tokens, subtree

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache

PREFIX_PREVIEW_TOKENS = 32  # token ids largest_prefixes returns per prefix, enough to show its first words


def largest_prefixes(cache: RadixCache, k: int) -> list[dict]:
    """The k cached prefixes with the most tokens, across namespaces. A prefix is the path from a root to a
    node where cached sequences end or part: a leaf, a node with >= 2 children, or the end of a pin. Each:
    tokens (its first PREFIX_PREVIEW_TOKENS ids), num_tokens, hits and last_use (of its last node: a hit
    there ran through the whole prefix), pinned, namespace."""
    pin_ends = {node for _, node in cache._pins.entries()}
    ends = []  # (num_tokens, node id, node)
    for root in cache._roots.values():
        stack = [(root, 0)]
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                d = depth + len(child)
                if len(child.children) != 1 or child in pin_ends:
                    ends.append((d, child.id, child))
                stack.append((child, d))
    return [
        {
            "tokens": path_tokens(node)[:PREFIX_PREVIEW_TOKENS].tolist(),
            "num_tokens": d,
            "hits": node.hit_count,
            "last_use": node.last_use_time,
            "pinned": node.pin_ref > 0,
            "namespace": node.namespace,
        }
        for d, _, node in heapq.nlargest(k, ends)
    ]


def check_invariants(cache: RadixCache) -> None:
    """Walk the whole tree and verify every bookkeeping field (tests and idle-time audits only)."""
    assert cache._roots.get(None) is cache.root, "the default namespace lost its root"
    for ns, root in cache._roots.items():
        assert root.parent is None and root.namespace == ns and root.lock_ref == 1 and root.pin_ref == 0, (
            f"root of namespace {ns!r} is damaged: {root!r}"
        )
    pins_through: Counter = Counter()
    for info, node in cache._pins.entries():
        pin_id = info.id
        assert info.namespace == node.namespace, f"pin {pin_id} ends in another namespace"
        depth = 0
        while node.parent is not None:
            pins_through[node] += 1
            depth += len(node)
            node = node.parent
        assert node is cache._roots.get(info.namespace), f"pin {pin_id} hangs off no root of its namespace"
        assert depth == info.num_tokens, f"pin {pin_id} covers {depth} tokens, not {info.num_tokens}"
    evictable = protected = locked = pinned = 0
    leaves, slots = set(), []
    for node in subtree(*cache._roots.values()):
        assert len(node.key) == len(node.value) > 0, f"{node!r}: empty or mismatched key/value"
        assert node.parent.children.get(int(node.key[0])) is node, f"{node!r}: not its parent's child"
        assert node.namespace == node.parent.namespace, f"{node!r}: in another namespace than its parent"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        locked_below = max((c.lock_ref for c in node.children.values()), default=0)
        assert node.lock_ref >= locked_below, f"{node!r}: lock_ref below a child's"
        assert node.pin_ref == pins_through[node], f"{node!r}: {pins_through[node]} pins pass through it"
        locked += len(node) if node.lock_ref else 0
        pinned += len(node) if node.pin_ref else 0
        if node.lock_ref or node.pin_ref:
            protected += len(node)
        else:
            evictable += len(node)
            if not node.children:
                leaves.add(node)
        slots.append(node.value)
    kept = (cache.evictable_size, cache.protected_size, cache.locked_size, cache.pinned_size)
    assert (evictable, protected, locked, pinned) == kept, (
        f"sizes drifted: counted evictable/protected/locked/pinned={evictable}/{protected}/{locked}/{pinned}, "
        f"kept {'/'.join(map(str, kept))}"
    )
    all_slots = np.concatenate(slots) if slots else EMPTY
    assert len(np.unique(all_slots)) == len(all_slots), "a KV slot is cached under two tokens"
    assert leaves == set(cache._leaves), "evictable-leaf set out of sync with the tree"
    cache._leaves.check()
