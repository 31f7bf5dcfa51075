"""Radix tree over token ids that maps cached prefixes to their KV slots (page size 1).

Each edge holds a run of token ids (`key`) and the KV slots computed for them (`value`). A request
looks up its prompt, reuses the slots of the longest cached prefix, and locks the path so the slots
cannot be evicted while it runs; when it finishes it inserts prompt + output and unlocks. Eviction
removes leaves that are neither locked nor pinned, in the order of the eviction policy
(radixserve/cache/eviction_policy.py).

Namespaces (a tenant's cache_salt) are separate roots: a prefix cached in one is invisible in every
other, so a tenant cannot learn through timing what another one sent. None is the shared default.
Pins (an operator's system prompts) hold a path like a lock does, but until unpinned or expired.

Ownership: slots stored in the tree belong to the tree; it gives them back to the allocator on
eviction, on reset, and when an insert brings duplicates of tokens it already holds.

This file keeps the tree's bookkeeping (sizes, clock, eviction order, namespaces, pins) in step with every change.
The node and what is done to one node alone (split, path, subtree) are in tree_node.py; the read-only walks over
the whole tree (the invariant audit, the dashboard's largest prefixes) in tree_inspection.py.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from radixserve.cache import tree_inspection
from radixserve.cache.eviction_policy import EvictableLeaves
from radixserve.cache.pins import PinInfo, PinRegistry
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import EMPTY, MatchResult, TreeNode, common_prefix_len, path_tokens, split_node, subtree


class RadixCache:
    """Prefix cache keyed by token ids.

    Sizes are token counts, each cached token in exactly one of `evictable_size` (neither locked nor
    pinned: all reclaimable by repeated leaf eviction) and `protected_size` (locked by a running
    request or pinned); their sum is everything cached. `locked_size` and `pinned_size` count the
    protected tokens held by locks and by pins (a token held by both is in both).
    """

    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False, eviction_policy: str = "lru"):
        self.allocator = allocator
        self.disable = disable
        self._leaves = EvictableLeaves(eviction_policy)  # unlocked, unpinned leaves in eviction order
        self._clock = itertools.count(1)
        # Told of every change to what is cached, in every namespace (inserted(tokens, namespace), evicted(path, key,
        # namespace), cleared()): a data-parallel scheduler reports them so the front end's mirror of this tree stays
        # exact (scheduler_service/cache_events.py), and a Dynamo worker's as KV block events for Dynamo's router
        # (scheduler_service/kv_events.py).
        self.listener = None
        # evict_hook(path_tokens, slots, namespace) sees every evicted leaf while its slots still hold its KV
        # (the host-memory tier copies them out).
        self.evict_hook = None
        self.evicted_tokens = 0  # every token ever evicted (not counting reset)
        self._pins = PinRegistry()
        self._roots: dict[str | None, TreeNode] = {}
        self.root = self._root(None)
        self.evictable_size = 0
        self.protected_size = 0
        self.locked_size = 0
        self.pinned_size = 0

    @property
    def eviction_policy(self) -> str:
        return self._leaves.policy

    def _root(self, namespace: str | None, create: bool = True) -> TreeNode:
        """The namespace's root; without create, a detached empty one when the namespace holds nothing (so a
        stream of lookups with new salts leaves nothing behind)."""
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode(EMPTY, EMPTY, None, namespace)
            root.lock_ref = 1  # never evicted nor counted: a permanent lock keeps it out of every leaf check
            if create:
                self._roots[namespace] = root
        return root

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---------------------------------------------------------------- lookup / insert

    def peek_slots(self, tokens, namespace: str | None = None) -> np.ndarray:
        """The slots of `tokens`, which must be a path of whole cached nodes from the root of `namespace`, read
        without touching anything: no access time, no hit, no split (the host tier reads an evicted leaf's ancestors
        this way, and that read must not make them look recently used)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        node, parts, pos = self._roots.get(namespace), [], 0
        while pos < len(tokens):
            node = node.children[int(tokens[pos])]  # KeyError: not a cached path
            parts.append(node.value)
            pos += len(node.key)
        if pos != len(tokens):
            raise ValueError("peek_slots: the tokens do not end on a node boundary")
        return np.concatenate(parts) if parts else EMPTY.copy()

    def match_prefix(
        self, tokens, namespace: str | None = None, priority: int = 0, *, record_hit: bool = True
    ) -> MatchResult:
        """Longest prefix of `tokens` cached in `namespace` and its slots; touches the path for the eviction policy
        (record_hit=False for a look that is not a request using the prefix: hit counts stay unchanged).

        A node matched only partly is split so that last_node ends exactly at the match and can be
        locked on its own. The scheduler passes prompt[:-1]: at least one prompt token must be
        computed to produce logits for the first output token.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.disable:
            return MatchResult(EMPTY, self.root)
        root = self._root(namespace, create=False)
        path, _ = self._walk(root, tokens, priority, record_hit)
        # Always a fresh array: the caller may write into it; the tree's values must not change.
        slots = np.concatenate([n.value for n in path]) if path else EMPTY.copy()
        return MatchResult(slots, path[-1] if path else root)

    def record_hit(self, node: TreeNode) -> None:
        """A request goes on to use the cached path that ends at node: one hit on each of its nodes (lfu order).
        The scheduler looks with record_hit=False while a request may still wait, and counts it on admission."""
        while node.parent is not None:
            node.hit_count += 1
            self._leaves.key_changed(node)
            node = node.parent

    def insert(self, tokens, slots, namespace: str | None = None, priority: int = 0) -> int:
        """Store tokens -> slots in `namespace`; returns how many leading tokens were already cached there.

        For that cached range the tree keeps its own slots and frees the caller's where they differ
        (another request computed and inserted the same tokens meanwhile). The caller's slots for
        the new remainder become the tree's. Either way the caller no longer owns any of `slots`.
        """
        tokens, slots = _token_slot_arrays(tokens, slots)
        if self.disable or len(tokens) == 0:
            self.allocator.free(slots)
            return 0
        return self._insert(self._root(namespace), tokens, slots, priority, EMPTY)[0]

    def insert_below(self, node: TreeNode, tokens, slots, priority: int = 0) -> MatchResult:
        """insert() of a path's continuation: node ends a cached path (held by the caller's lock) and tokens -> slots
        follow it. The same as inserting the path's tokens + tokens with its slots + slots in node's namespace, at a
        cost in proportion to len(tokens), not to the path's. Returns the tree's slots for tokens (its own where it
        held them already; a fresh array) and the node ending at them."""
        tokens, slots = _token_slot_arrays(tokens, slots)
        if self.disable:
            self.allocator.free(slots)
            return MatchResult(EMPTY.copy(), node)
        if node.parent is None:  # a namespace's root: the one registered now (a request may hold a detached one)
            node = self._root(node.namespace)
        path = self._insert(node, tokens, slots, priority, None)[1]
        return MatchResult(
            np.concatenate([n.value for n in path]) if path else EMPTY.copy(), path[-1] if path else node
        )

    def _insert(self, top: TreeNode, tokens: np.ndarray, slots: np.ndarray, priority: int, above: np.ndarray | None):
        """Insert tokens -> slots below top, each node from the root down to top touched as if walked through.
        above: the tokens from the root to top (None: read from the tree if the listener needs them). Returns how
        many tokens were cached already and the path below top that now holds tokens, the new leaf included."""
        path, now = self._walk(top, tokens, priority, record_hit=False)
        wall, node = time.time(), top
        while node.parent is not None:  # (the nodes a walk from the root would have touched before top)
            node.last_access, node.last_use_time, node.priority = now, wall, max(node.priority, priority)
            self._leaves.key_changed(node)
            node = node.parent
        duplicates = []
        pos = 0
        for node in path:
            ours = slots[pos : pos + len(node)]
            differ = ours != node.value
            if differ.any():
                duplicates.append(ours[differ])
            pos += len(node)
        already_cached = pos
        if pos < len(tokens):
            parent = path[-1] if path else top
            leaf = TreeNode(tokens[pos:].copy(), slots[pos:].copy(), parent, top.namespace)
            leaf.last_access, leaf.last_use_time, leaf.priority = now, time.time(), priority
            parent.children[int(leaf.key[0])] = leaf
            self._leaves.discard(parent)  # no longer a leaf
            self.evictable_size += len(leaf)
            self._leaves.add(leaf)
            path.append(leaf)
            if self.listener is not None:
                above = path_tokens(top) if above is None else above
                self.listener.inserted(np.concatenate([above, tokens]) if len(above) else tokens, top.namespace)
        if duplicates:
            self.allocator.free(np.concatenate(duplicates))
        return already_cached, path

    # ---------------------------------------------------------------- locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (one running request's cached prefix)."""
        self._add_refs(node, lock=1)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node)."""
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on an unlocked node {node!r}")
        self._add_refs(node, lock=-1)

    # ---------------------------------------------------------------- pins

    def pin(self, tokens, namespace: str | None = None, ttl_seconds: float | None = None) -> PinInfo:
        """Keep the cached path of `tokens` in `namespace` from eviction until unpin(), reset(keep_pins=False) or,
        with ttl_seconds, expiry. ValueError unless every token is cached."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if len(tokens) == 0:
            raise ValueError("nothing to pin: no tokens")
        if self.disable:
            raise ValueError("cannot pin: the radix cache is disabled")
        path, _ = self._walk(self._root(namespace, create=False), tokens, None, record_hit=False)
        cached = sum(len(n) for n in path)
        if cached < len(tokens):
            raise ValueError(f"cannot pin: only {cached} of {len(tokens)} tokens are cached")
        self._add_refs(path[-1], pin=1)
        return self._pins.add(path[-1], namespace, len(tokens), ttl_seconds)

    def unpin(self, pin_id: str) -> bool:
        """Drop a pin; False if there is no such pin (never was, already unpinned or expired)."""
        node = self._pins.pop(pin_id)
        if node is None:
            return False
        self._add_refs(node, pin=-1)
        return True

    def list_pins(self) -> list[PinInfo]:
        """The live pins, oldest first (expired ones are dropped first)."""
        self.expire_pins()
        return self._pins.infos()

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Drop every pin whose TTL has run out by `now` (default: the wall clock); returns their ids."""
        expired = self._pins.due(time.time() if now is None else now)
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    # ---------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free whole evictable leaves, in the policy's order, until at least num_tokens slots are freed
        or nothing evictable is left. Returns the number of slots freed."""
        if num_tokens <= 0:
            return 0
        self.expire_pins()  # an expired pin's tokens are fair game under pressure even if nobody polled
        freed = 0
        freed_slots = []
        try:
            while freed < num_tokens:
                node = self._leaves.pop()
                if node is None:
                    break
                parent = node.parent
                report = self.listener is not None
                path = path_tokens(node) if report or self.evict_hook is not None else None
                del parent.children[int(node.key[0])]
                node.parent = None
                freed_slots.append(node.value)
                freed += len(node)
                self.evictable_size -= len(node)
                if parent.parent is None:
                    if not parent.children and node.namespace is not None:
                        del self._roots[node.namespace]  # an idle tenant leaves nothing behind
                elif not parent.children and not parent.lock_ref and not parent.pin_ref:
                    self._leaves.add(parent)
                if report:
                    self.listener.evicted(path[: len(path) - len(node)], node.key, node.namespace)
                if self.evict_hook is not None:
                    self.evict_hook(path, node.value, node.namespace)
        finally:
            # Even if a hook raised: the leaves taken out of the tree must not leak their slots.
            self.evicted_tokens += freed
            if freed_slots:
                self.allocator.free(np.concatenate(freed_slots))
        return freed

    def reset(self, keep_pins: bool = True) -> None:
        """Free every cached slot that no pin holds (the /flush_cache path); keep_pins=False drops the pins too.
        Only when no running request holds a lock."""
        if self.locked_size:
            raise RuntimeError(f"reset() while {self.locked_size} cached tokens are locked by running requests")
        if not keep_pins:
            self._pins.clear()
            for node in subtree(*self._roots.values()):
                node.pin_ref = 0
            self.pinned_size = 0
        freed = []
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                for first, child in list(node.children.items()):
                    if child.pin_ref:
                        stack.append(child)
                    else:
                        del node.children[first]
                        child.parent = None
                        freed += [child.value] + [n.value for n in subtree(child)]
        # Everything left is pinned, so nothing is evictable.
        self._roots = {ns: r for ns, r in self._roots.items() if r.children or ns is None}
        self.evictable_size = 0
        self.protected_size = self.pinned_size
        self._leaves.clear()
        if self.listener is not None:
            self.listener.cleared()
            for namespace, root in self._roots.items():  # what is left: each pinned path, to its leaf
                for node in subtree(root):
                    if not node.children:
                        self.listener.inserted(path_tokens(node), namespace)
        if freed:
            self.allocator.free(np.concatenate(freed))

    # ---------------------------------------------------------------- whole-tree reads (tree_inspection.py)

    def largest_prefixes(self, k: int) -> list[dict]:
        """The k cached prefixes with the most tokens, across namespaces (the dashboard)."""
        return tree_inspection.largest_prefixes(self, k)

    def pinned_prefix_len(self, tokens, namespace: str | None = None) -> int:
        """How many leading tokens of `tokens` lie in pinned nodes of `namespace` (slots a request would share
        rather than need), read without touching anything."""
        tokens = np.asarray(tokens, dtype=np.int32)
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < len(tokens):
            node = node.children.get(int(tokens[pos]))
            if node is None or node.pin_ref == 0:
                break
            matched = common_prefix_len(node.key, tokens[pos:])
            pos += matched
            if matched < len(node.key):
                break
        return pos

    def check_invariants(self) -> None:
        """Walk the whole tree and verify every bookkeeping field (tests and idle-time audits only)."""
        tree_inspection.check_invariants(self)

    # ---------------------------------------------------------------- internals

    def _walk(self, root: TreeNode, tokens: np.ndarray, priority: int | None, record_hit: bool) -> tuple[list, int]:
        """The nodes that tokens run through from root, in order, each wholly matched: a node matched only in
        part is split first. Every node on the path is touched for the eviction policy (priority None: a look
        on no request's behalf, which leaves priorities alone). Returns the path and the access time."""
        now, wall = next(self._clock), time.time()
        node, pos, path = root, 0, []
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            matched = common_prefix_len(child.key, tokens[pos:])
            if matched < len(child.key):
                child = split_node(child, matched)
            node = child
            node.last_access, node.last_use_time = now, wall
            if priority is not None:
                node.priority = max(node.priority, priority)
            node.hit_count += record_hit
            self._leaves.key_changed(node)
            path.append(node)
            # After a partial match the loop ends by itself: the split-off lower part is the only child and
            # starts with the token that mismatched.
            pos += matched
        return path, now

    def _add_refs(self, node: TreeNode, lock: int = 0, pin: int = 0) -> None:
        """Add lock and pin references to node and each ancestor below its root, moving their tokens between
        evictable and protected (and in or out of locked/pinned) as a count leaves or reaches zero."""
        while node.parent is not None:
            was_locked, was_pinned = node.lock_ref > 0, node.pin_ref > 0
            node.lock_ref += lock
            node.pin_ref += pin
            is_locked, is_pinned = node.lock_ref > 0, node.pin_ref > 0
            n = len(node)
            self.locked_size += n * (is_locked - was_locked)
            self.pinned_size += n * (is_pinned - was_pinned)
            held, was_held = is_locked or is_pinned, was_locked or was_pinned
            if held and not was_held:
                self.evictable_size -= n
                self.protected_size += n
                self._leaves.discard(node)
            elif was_held and not held:
                self.evictable_size += n
                self.protected_size -= n
                if not node.children:
                    self._leaves.add(node)
            node = node.parent


def _token_slot_arrays(tokens, slots) -> tuple[np.ndarray, np.ndarray]:
    tokens, slots = np.asarray(tokens, dtype=np.int32), np.asarray(slots, dtype=np.int32)
    if len(tokens) != len(slots):
        raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
    return tokens, slots
