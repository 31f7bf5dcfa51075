"""Which decoding requests of a batch read a shared prefix together (kernels.decode_attention_grouped).

A request's cached KV is the path of radix-tree nodes from the root to its locked `last_node`. Requests whose
paths pass through the same node hold the same KV slots for every token up to that node's end: each of them
was pointed at the tree's own slots for those tokens. (Where that repointing is still an unsent ReusedSlots
update, the worker must apply it before the step's attention, as it already must for the plain kernel.) A group
is a node plus >= 2 such requests: the kernel reads the node's prefix once for all of them, which saves
(members - 1) x depth tokens of KV reads per layer and step.

choose_prefix_groups picks one level of groups (each request in at most one) that maximises the tokens saved.
It is exact, by dynamic programming over the nodes of the batch's paths. Going deepest-first and grouping
greedily is not exact: two requests under a 100-token node and a third that leaves the path at 99 tokens save
2 x 99 as one group at 99, but only 100 as a group of two at 100. The program rests on one fact. If a node
hosts a group, every request passing through it that is not grouped deeper joins that group. Such a request
gains the node's depth there, and loses at most a shallower depth above. So at each node the only question is
how many requests still come up from below, and the table per node has one entry per count: O(batch^2) at
worst, and close to linear when each request's own tokens are one leaf node below a shared prompt.

Locking: every member holds a lock on its own last_node, and inc_lock_ref locks all its ancestors. So a group's
node stays in the tree for as long as any member runs, and the caller needs no lock of its own. Splits made
later by other inserts leave a member's path pointing at the same tokens (tree_node.split_node keeps the lower
part in place), but the paths through the split node gain the upper part: paths kept from an earlier step are
read again after a split (decode_grouper.py, which also cuts the batch into the independent problems it holds before
choose_prefix_groups sees them, and keeps their answers from step to step).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np

# Savings are >= 0; this marks a pass-up count that no choice below can produce, and stays negative when added.
_IMPOSSIBLE = -(1 << 40)


class PrefixGroup(NamedTuple):
    prefix_len: int  # tokens shared by every member: the depth of the node at which they meet
    members: tuple[int, ...]  # indices into the batch's list of requests, ascending


def node_path(last_node) -> list:
    """Root-first nodes from below the root down to last_node (a radix_cache.TreeNode); [] for the root."""
    path = []
    node = last_node
    while node is not None and node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def choose_prefix_groups(paths: Sequence[Sequence], min_tokens: int) -> list[PrefixGroup]:
    """Groups of >= 2 requests sharing a prefix, maximising sum over groups of (members - 1) x prefix_len.

    paths[i]: the radix-tree nodes request i's cached KV passes through, root excluded, in order (node_path).
    A node is anything hashable with len() = its token count. Only nodes whose depth is >= min_tokens (and >= 1)
    host groups. Deterministic for a given input.
    """
    min_depth = max(1, min_tokens)
    root = _Root()  # the tree's root: depth 0, hosts nothing; the top nodes of the paths hang below it
    depth: dict = {root: 0}
    children: dict = defaultdict(list)
    ending: dict = defaultdict(list)
    for i, path in enumerate(paths):
        d, parent = 0, root
        for node in path:
            d += len(node)
            if node not in depth:
                depth[node] = d
                children[parent].append(node)
            parent = node
        if path:
            ending[path[-1]].append(i)

    # Parents before children, without recursion: multi-turn chats make paths of hundreds of nodes.
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children[node])
    table: dict = {}  # node -> best[k]: most tokens saved below it with exactly k requests passed up ungrouped
    splits: dict = {}  # node -> per child with a choice, k after adding that child -> k that child passed up
    grouped_from: dict = {}  # node -> pool size a group here absorbs, when grouping beats passing all up
    lone: dict = {}  # node -> children below which a single request runs: each passes exactly it up
    for node in reversed(order):
        # The common case, a request's own leaf under a shared prompt, is a fixed count, not a convolution.
        lone[node] = [c for c in children[node] if _single(table[c])]
        choosing = [c for c in children[node] if not _single(table[c])]
        best = np.full(len(ending[node]) + len(lone[node]) + 1, _IMPOSSIBLE, dtype=np.int64)
        best[-1] = 0
        node_splits = []
        for child in choosing:
            best, split = _max_plus(best, table[child])
            node_splits.append(split)
        for child in children[node]:
            del table[child]
        children[node] = choosing
        splits[node] = node_splits
        if depth[node] >= min_depth and len(best) > 2:
            with_group = best[2:] + np.arange(1, len(best) - 1) * depth[node]  # pool j = 2.. all join
            pool = int(with_group.argmax()) + 2
            if best[pool] >= 0 and with_group[pool - 2] > best[0]:
                best[0] = with_group[pool - 2]
                grouped_from[node] = pool
        table[node] = best

    # Walk back down: how many requests each node passes up, then who is in each group. Above the root
    # there is nothing: the best count is the first best one (the fewest requests left ungrouped).
    count: dict = {root: int(table[root].argmax())}
    for node in order:
        k = count[node]
        if k == 0 and node in grouped_from:
            k = grouped_from[node]
        else:
            grouped_from.pop(node, None)
        assert _distribute(children[node], splits[node], k, count) == len(ending[node]) + len(lone[node])
        for child in lone[node]:
            count[child] = 1
    groups = []
    rising: dict = {}
    for node in reversed(order):
        pool = list(ending[node])
        for child in children[node] + lone[node]:
            pool += rising.pop(child)
        if node in grouped_from:
            groups.append(PrefixGroup(depth[node], tuple(sorted(pool))))
            pool = []
        assert len(pool) == count[node]
        rising[node] = pool
    groups.sort(key=lambda g: g.members[0])
    return groups


class _Root:
    __slots__ = ()


def _single(best: np.ndarray) -> bool:
    """Exactly one request runs below: it can only pass itself up (a group needs two)."""
    return len(best) == 2 and best[0] < 0


def _max_plus(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out[k] = max over a + b = k of left[a] + right[b]; also the b that gave each out[k] (the smallest on ties).

    All pairs at once, then the best of each anti-diagonal: a few array calls instead of len(left) x len(right)
    Python steps (batches are at most a few hundred requests, so the pairs stay small).
    """
    sums = left[:, None] + right[None, :]
    sums[(left < 0)[:, None] | (right < 0)[None, :]] = _IMPOSSIBLE
    k = (np.arange(len(left))[:, None] + np.arange(len(right))[None, :]).ravel()
    b = np.broadcast_to(np.arange(len(right)), sums.shape).ravel()
    sums = sums.ravel()
    order = np.lexsort((b, -sums, k))  # by k, then the largest sum, then the smallest b
    first = np.ones(len(order), dtype=bool)
    first[1:] = k[order[1:]] != k[order[:-1]]
    chosen = order[first]  # one per k = 0 .. len(left) + len(right) - 2, in order
    return sums[chosen], b[chosen]


def _distribute(nodes: list, splits: list[np.ndarray], k: int, count: dict) -> int:
    """Undo a _max_plus chain: give each node the pass-up count the optimum assigned it; returns what is left
    for the chain's start (the requests ending at the parent)."""
    for node, split in zip(reversed(nodes), reversed(splits)):
        count[node] = int(split[k])
        k -= count[node]
    return k


class GroupTables(NamedTuple):
    """decode_attention_grouped's int32 inputs for one batch of decodes (batch order as given)."""

    group_prefix_lens: np.ndarray  # [G]
    group_prefix_rows: np.ndarray  # [G] req_to_token row of the group's first member
    group_member_start: np.ndarray  # [G + 1]
    group_members: np.ndarray  # [sum of group sizes] batch indices
    req_group: np.ndarray  # [B] group or -1
    req_suffix_start: np.ndarray  # [B] group's prefix_len or 0


def group_tables(groups: Sequence[PrefixGroup], req_pool_indices: Sequence[int]) -> GroupTables:
    # Python lists, one array each at the end: the groups change on most steps while requests come and go, and
    # two numpy writes per group cost more than a pass over the batch's few hundred members (31 against 8 us for
    # 8 groups of 8).
    req_group = [-1] * len(req_pool_indices)
    req_suffix_start = [0] * len(req_pool_indices)
    starts = [0]
    members = []
    for g, group in enumerate(groups):
        members += group.members
        starts.append(len(members))
        for m in group.members:
            req_group[m] = g
            req_suffix_start[m] = group.prefix_len
    if len(set(members)) != len(members):
        raise ValueError(f"a request is in two groups: {groups}")
    return GroupTables(
        np.array([group.prefix_len for group in groups], dtype=np.int32),
        np.array([req_pool_indices[group.members[0]] for group in groups], dtype=np.int32),
        np.array(starts, dtype=np.int32),
        np.array(members, dtype=np.int32),
        np.array(req_group, dtype=np.int32),
        np.array(req_suffix_start, dtype=np.int32),
    )
