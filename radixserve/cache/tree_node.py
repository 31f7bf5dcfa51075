"""One node of the radix tree (radixserve/cache/radix_cache.py) and what can be done to nodes alone: compare a
node's key with tokens, cut a node in two, read the tokens of a path, list a subtree. None of it touches the cache's
sizes, clock or eviction order; RadixCache keeps those in step around these calls."""

from __future__ import annotations

import itertools
from typing import Iterator, NamedTuple

import numpy as np

EMPTY = np.zeros(0, dtype=np.int32)  # the key and value of every root; what a miss matches


class TreeNode:
    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "namespace",
        "lock_ref",
        "pin_ref",
        "last_access",
        "last_use_time",
        "hit_count",
        "priority",
        "id",
    )

    _ids = itertools.count()
    # split_node calls so far, in any tree of this process. A split puts a new node into the path of every node below
    # it, and the scheduler's DecodeGrouper keeps running requests' paths from step to step: a changed count tells it
    # they may be stale (scheduler_service/decode_grouper.py). It has no tree to ask, only the requests' nodes.
    splits = 0

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None, namespace: str | None):
        self.key = key  # int32 token ids of this edge
        self.value = value  # int32 KV slots, one per token of `key`
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent  # None for a namespace's root (and for a node once evicted)
        self.namespace = namespace
        self.lock_ref = 0  # running requests whose cached prefix passes through this node
        self.pin_ref = 0  # pins whose path passes through this node
        self.last_access = 0  # logical clock of the last match or insert through it (orders "lru")
        self.last_use_time = 0.0  # the same moment on the wall clock, for people
        self.hit_count = 0  # matches that ran through it (orders "lfu")
        self.priority = 0  # highest priority of the requests that inserted or matched it (orders "priority")
        self.id = next(TreeNode._ids)  # heap tie-break; nodes themselves are not orderable

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, pin_ref={self.pin_ref}, "
            f"children={len(self.children)})"
        )


class MatchResult(NamedTuple):
    slots: np.ndarray  # int32 KV slots of the matched prefix
    last_node: TreeNode  # the node ending exactly at the match (its namespace's root when nothing matched)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = a[:n] != b[:n]
    first = int(mismatch.argmax())
    return first if mismatch[first] else n


def split_node(node: TreeNode, at: int) -> TreeNode:
    """Cut node after `at` tokens; returns the new upper part. The original object keeps the
    lower part so that references held by running requests and pins (their last node) still end
    at the same token. Counts and sizes are unchanged: both parts inherit every field."""
    upper = TreeNode(node.key[:at].copy(), node.value[:at].copy(), node.parent, node.namespace)
    TreeNode.splits += 1
    for field in ("lock_ref", "pin_ref", "last_access", "last_use_time", "hit_count", "priority"):
        setattr(upper, field, getattr(node, field))
    # Copies, not views, so the upper part does not pin the old arrays after the lower is evicted.
    node.key = node.key[at:].copy()
    node.value = node.value[at:].copy()
    upper.parent.children[int(upper.key[0])] = upper
    upper.children[int(node.key[0])] = node
    node.parent = upper
    return upper


def path_tokens(node: TreeNode) -> np.ndarray:
    """The tokens from the root down to the end of node."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return np.concatenate(keys[::-1]) if keys else EMPTY


def subtree(*tops: TreeNode) -> Iterator[TreeNode]:
    """Every node below the given nodes (they themselves excluded)."""
    stack = [child for top in tops for child in top.children.values()]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
