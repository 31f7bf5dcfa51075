"""Property test of cache control in the radix tree, one per eviction policy: random sequences of
matches, inserts, requests holding locks, evictions, pins (with TTLs), unpins, expiry and resets over two
namespaces, checked step by step against a per-token reference model. The evict_hook checks that every leaf goes in
the policy's order while its slots are still allocated."""

from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import path_tokens, subtree

ALPHABET = 3  # small, so prefixes collide and nodes split often
MAX_LEN = 8
NUM_SLOTS = 48  # small, so allocation runs into eviction
MAX_PENDING = 3
NAMESPACES = [None, "a"]

sequences = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=MAX_LEN)
namespaces = st.sampled_from(NAMESPACES)
priorities = st.integers(-2, 2)


class ReferenceCache:
    """The tree restated per token: every cached token is named by (namespace, its full prefix), and carries what
    the real tree keeps per node. Any operation that covers part of a node splits it first, so every token of a
    node has the same values; and only the last node of an operation's path can be a leaf, so leaf access times
    are distinct and every policy's order is unambiguous."""

    def __init__(self, policy):
        self.policy = policy
        self.slot, self.access, self.hits, self.priority, self.locks, self.pins = {}, {}, {}, {}, {}, {}
        self.clock = 0

    def walk(self, ns, tokens, priority, hit):
        """Touch the cached prefix of tokens like a match; returns its names."""
        self.clock += 1
        names = []
        for i in range(len(tokens)):
            name = (ns, tuple(tokens[: i + 1]))
            if name not in self.slot:
                break
            names.append(name)
            self.access[name] = self.clock
            self.hits[name] += hit
            if priority is not None:
                self.priority[name] = max(self.priority[name], priority)
        return names

    def insert(self, ns, tokens, slots, priority):
        """Returns (already cached count, duplicates the cache must free)."""
        names = self.walk(ns, tokens, priority, False)
        duplicates = [s for name, s in zip(names, slots) if self.slot[name] != s]
        for i in range(len(names), len(tokens)):
            name = (ns, tuple(tokens[: i + 1]))
            self.slot[name], self.access[name], self.hits[name] = slots[i], self.clock, 0
            self.priority[name], self.locks[name], self.pins[name] = priority, 0, 0
        return len(names), duplicates

    def hold(self, names, field, delta):
        for name in names:
            getattr(self, field)[name] += delta

    def is_leaf(self, name):
        ns, prefix = name
        return not any((ns, prefix + (a,)) in self.slot for a in range(ALPHABET))

    def key(self, name):
        extra = {"lru": (), "lfu": (self.hits[name],), "priority": (self.priority[name],)}[self.policy]
        return extra + (self.access[name],)

    def next_victim(self):
        leaves = [n for n in self.slot if not self.locks[n] and not self.pins[n] and self.is_leaf(n)]
        return min(leaves, key=self.key)

    def remove(self, name):
        for table in (self.slot, self.access, self.hits, self.priority, self.locks, self.pins):
            del table[name]

    def evictable_count(self):
        return sum(1 for n in self.slot if not self.locks[n] and not self.pins[n])


class Running(NamedTuple):
    """A request in flight: it matched `prefix`, locked `node` (the reference: `names`) and computes into `own`."""

    names: list
    own: np.ndarray
    node: object
    tokens: list
    ns: str | None
    priority: int
    prefix: np.ndarray


class CacheControlMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.allocator = TokenSlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(self.allocator, eviction_policy=self.policy)
        self.cache.evict_hook = self.on_evict
        self.ref = ReferenceCache(self.policy)
        self.pending: list[Running] = []
        self.pins = {}  # id -> (names, expires_at)
        self.hooked = 0

    def on_evict(self, path_tokens, slots, namespace):
        # Eviction order is the policy's: the reference, asked one token at a time, names exactly this leaf.
        assert not self.allocator._is_free[slots].any(), "evict_hook ran after the slots were freed"
        path = path_tokens.tolist()
        for end in range(len(path), len(path) - len(slots), -1):
            victim = self.ref.next_victim()
            assert victim == (namespace, tuple(path[:end])), f"evicted {path[:end]}, policy says {victim}"
            assert self.ref.slot[victim] == slots[end - len(path) + len(slots) - 1]
            self.ref.remove(victim)
        self.hooked += len(slots)

    def held_by_requests(self):
        return [s for req in self.pending for s in req.own.tolist()]

    def evict_and_check(self, num_tokens):
        evictable_before = self.ref.evictable_count()
        self.hooked = 0
        freed = self.cache.evict(num_tokens)
        assert freed == self.hooked  # the hook saw every evicted token (and checked the order)
        assert freed >= min(num_tokens, evictable_before) and freed <= evictable_before
        assert num_tokens <= 0 or freed < num_tokens + MAX_LEN

    def alloc_with_eviction(self, n):
        if n > self.allocator.num_free:
            self.evict_and_check(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    @rule(tokens=sequences, ns=namespaces, priority=priorities, hit=st.booleans())
    def match(self, tokens, ns, priority, hit):
        result = self.cache.match_prefix(tokens, namespace=ns, priority=priority, record_hit=hit)
        names = self.ref.walk(ns, tokens, priority, hit)
        assert result.slots.tolist() == [self.ref.slot[n] for n in names]

    @precondition(lambda self: len(self.pending) < MAX_PENDING)
    @rule(tokens=sequences, ns=namespaces, priority=priorities)
    def begin_request(self, tokens, ns, priority):
        result = self.cache.match_prefix(tokens[:-1], namespace=ns, priority=priority)
        names = self.ref.walk(ns, tokens[:-1], priority, True)
        assert result.slots.tolist() == [self.ref.slot[n] for n in names]
        self.cache.inc_lock_ref(result.last_node)
        self.ref.hold(names, "locks", +1)
        own = self.alloc_with_eviction(len(tokens) - len(names))
        if own is None:
            self.cache.dec_lock_ref(result.last_node)
            self.ref.hold(names, "locks", -1)
            return
        self.pending.append(Running(names, own, result.last_node, tokens, ns, priority, result.slots))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), finish=st.booleans())
    def end_request(self, data, finish):
        req = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        if finish:
            slots = np.concatenate([req.prefix, req.own])
            count, _ = self.ref.insert(req.ns, req.tokens, slots.tolist(), req.priority)
            assert self.cache.insert(req.tokens, slots, namespace=req.ns, priority=req.priority) == count
        else:
            self.allocator.free(req.own)
        self.cache.dec_lock_ref(req.node)
        self.ref.hold(req.names, "locks", -1)

    @rule(tokens=sequences, ns=namespaces, priority=priorities)
    def insert_freshly_computed(self, tokens, ns, priority):
        slots = self.alloc_with_eviction(len(tokens))
        if slots is None:
            return
        count, _ = self.ref.insert(ns, tokens, slots.tolist(), priority)
        assert self.cache.insert(tokens, slots, namespace=ns, priority=priority) == count

    @rule(num_tokens=st.integers(0, 8))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    @rule(tokens=sequences, ns=namespaces, ttl=st.sampled_from([None, 1000.0, 2000.0]))
    def pin(self, tokens, ns, ttl):
        names = self.ref.walk(ns, tokens, None, False)
        if len(names) < len(tokens):
            with pytest.raises(ValueError, match="cached"):
                self.cache.pin(tokens, namespace=ns, ttl_seconds=ttl)
            return
        info = self.cache.pin(tokens, namespace=ns, ttl_seconds=ttl)
        self.ref.hold(names, "pins", +1)
        self.pins[info.id] = (names, info.expires_at)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(sorted(self.pins)))
        assert self.cache.unpin(pin_id)
        self.ref.hold(self.pins.pop(pin_id)[0], "pins", -1)
        assert not self.cache.unpin(pin_id)

    @precondition(lambda self: any(expires for _, expires in self.pins.values()))
    @rule(data=st.data())
    def expire(self, data):
        now = data.draw(st.sampled_from(sorted(e for _, e in self.pins.values() if e)))
        expired = {i for i, (_, e) in self.pins.items() if e is not None and e <= now}
        assert set(self.cache.expire_pins(now=now)) == expired
        for pin_id in expired:
            self.ref.hold(self.pins.pop(pin_id)[0], "pins", -1)

    @precondition(lambda self: not self.pending)
    @rule(keep_pins=st.booleans())
    def reset(self, keep_pins):
        self.cache.reset(keep_pins=keep_pins)
        if not keep_pins:
            self.pins = {}
        for name in [n for n in self.ref.slot if not keep_pins or not self.ref.pins[n]]:
            self.ref.remove(name)
        assert self.cache.evictable_size == 0 and self.cache.total_size() == self.cache.pinned_size

    @rule(k=st.integers(1, 6))
    def largest_prefixes(self, k):
        pin_ends = {names[-1] for names, _ in self.pins.values()}
        ends = [
            n
            for n in self.ref.slot
            if n in pin_ends or sum((n[0], n[1] + (a,)) in self.ref.slot for a in range(ALPHABET)) != 1
        ]
        top = self.cache.largest_prefixes(k)
        assert [p["num_tokens"] for p in top] == sorted((len(n[1]) for n in ends), reverse=True)[:k]
        for p in top:
            name = (p["namespace"], tuple(p["tokens"]))
            assert name in ends and p["hits"] == self.ref.hits[name] and p["pinned"] == (self.ref.pins[name] > 0)

    @invariant()
    def sizes_are_exact(self):
        slot, locks, pins = self.ref.slot, self.ref.locks, self.ref.pins
        assert self.cache.locked_size == sum(1 for n in slot if locks[n])
        assert self.cache.pinned_size == sum(1 for n in slot if pins[n])
        assert self.cache.evictable_size == self.ref.evictable_count()
        assert self.cache.total_size() == len(slot)
        assert self.allocator.num_free + len(slot) + len(self.held_by_requests()) == NUM_SLOTS
        assert {p.id for p in self.cache.list_pins()} == set(self.pins)
        self.cache.check_invariants()

    @invariant()
    def every_node_carries_its_tokens_values(self):
        ref = self.ref
        for node in subtree(*self.cache._roots.values()):
            path = tuple(path_tokens(node).tolist())
            for end in range(len(path) - len(node) + 1, len(path) + 1):
                name = (node.namespace, path[:end])
                assert (node.last_access, node.hit_count, node.priority, node.lock_ref, node.pin_ref) == (
                    ref.access[name],
                    ref.hits[name],
                    ref.priority[name],
                    ref.locks[name],
                    ref.pins[name],
                ), name

    @invariant()
    def free_slots_are_exactly_the_unowned_ones(self):
        free = self.allocator.alloc(self.allocator.num_free)
        owned = set(self.ref.slot.values()) | set(self.held_by_requests())
        assert set(free.tolist()) == set(range(1, NUM_SLOTS + 1)) - owned
        self.allocator.free(free)


SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class LFUMachine(CacheControlMachine):
    policy = "lfu"


class PriorityMachine(CacheControlMachine):
    policy = "priority"


test_lru_matches_reference = CacheControlMachine.TestCase
test_lfu_matches_reference = LFUMachine.TestCase
test_priority_matches_reference = PriorityMachine.TestCase
test_lru_matches_reference.settings = SETTINGS
test_lfu_matches_reference.settings = SETTINGS
test_priority_matches_reference.settings = SETTINGS
