"""The radix tree: matches split nodes, inserts return the cached length and free duplicate slots, locked nodes
survive splits and eviction, LRU leaves go first, reset and the disabled cache free everything; a hypothesis state
machine checks every operation against a per-token reference cache."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.radix_cache import RadixCache


def make(num_slots=100, disable=False):
    allocator = TokenSlotAllocator(num_slots)
    return allocator, RadixCache(allocator, disable=disable)


def insert_fresh(allocator, cache, tokens):
    slots = allocator.alloc(len(tokens))
    return slots, cache.insert(tokens, slots)


# ----------------------------------------------------------------------------- unit tests


def test_match_on_empty_tree_and_empty_query():
    _, cache = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == np.int32 and len(slots) == 0 and node is cache.root
    assert len(cache.match_prefix([]).slots) == 0


def test_match_splits_a_partly_matched_node():
    allocator, cache = make()
    slots, _ = insert_fresh(allocator, cache, [1, 2, 3, 4, 5])
    matched, node = cache.match_prefix([1, 2, 3, 9])
    assert matched.tolist() == slots[:3].tolist()
    assert node.key.tolist() == [1, 2, 3] and node.parent is cache.root
    (lower,) = node.children.values()
    assert lower.key.tolist() == [4, 5] and lower.value.tolist() == slots[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()
    cache.check_invariants()
    assert cache.total_size() == 5 == cache.evictable_size


def test_insert_returns_cached_length_and_branches():
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3, 4])
    prefix = cache.match_prefix([1, 2, 7]).slots
    own = allocator.alloc(2)
    assert cache.insert([1, 2, 7, 8], np.concatenate([prefix, own])) == 2
    assert cache.match_prefix([1, 2, 7, 8]).slots.tolist() == prefix.tolist() + own.tolist()
    assert cache.insert([1, 2, 3], cache.match_prefix([1, 2, 3]).slots) == 3  # fully cached: nothing freed
    assert allocator.num_free == 100 - 6 == 100 - cache.total_size()
    cache.check_invariants()


def test_insert_frees_duplicate_slots_but_keeps_matched_ones():
    allocator, cache = make(20)
    tree_slots, _ = insert_fresh(allocator, cache, [5, 6, 7, 8])
    # Request A matched [5, 6] earlier (same slots), then computed [7, 8, 9] itself while request B
    # inserted [7, 8]: A's slots for 7 and 8 are duplicates, its slot for 9 is new.
    own = allocator.alloc(3)
    assert cache.insert([5, 6, 7, 8, 9], np.concatenate([tree_slots[:2], own])) == 4
    assert cache.match_prefix([5, 6, 7, 8, 9]).slots.tolist() == tree_slots.tolist() + [own[2]]
    assert cache.total_size() == 5
    assert allocator.num_free == 20 - 5  # the two duplicates came back
    again = allocator.alloc(allocator.num_free)
    assert set(own[:2].tolist()) <= set(again.tolist())
    cache.check_invariants()


def test_locked_node_survives_a_later_split():
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3, 4, 5, 6])
    _, held = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(held)
    assert (cache.protected_size, cache.evictable_size) == (6, 0)
    cache.match_prefix([1, 2, 9])  # splits the locked node; `held` keeps its lower part
    assert held.key.tolist() == [3, 4, 5, 6] and held.parent.lock_ref == 1
    assert cache.evict(100) == 0
    cache.dec_lock_ref(held)
    assert (cache.protected_size, cache.evictable_size) == (0, 6)
    with pytest.raises(ValueError, match="unlocked"):
        cache.dec_lock_ref(held)
    assert cache.evict(1) == 4  # whole leaves only
    assert cache.evict(1) == 2  # the parent became an evictable leaf
    assert allocator.num_free == 100
    cache.check_invariants()


def test_evict_takes_least_recently_used_leaf_first():
    allocator, cache = make()
    a, _ = insert_fresh(allocator, cache, [1, 1, 1])
    b, _ = insert_fresh(allocator, cache, [2, 2])
    c, _ = insert_fresh(allocator, cache, [3])
    cache.match_prefix([1, 1, 1])  # a is now the most recent
    assert cache.evict(1) == 2  # b
    assert cache.match_prefix([2, 2]).slots.size == 0
    assert cache.evict(1) == 1  # c
    assert cache.match_prefix([1, 1, 1]).slots.tolist() == a.tolist()
    free = allocator.alloc(allocator.num_free)
    assert set(b.tolist()) | set(c.tolist()) <= set(free.tolist())


def test_evict_skips_locked_leaves_and_stops_when_nothing_left():
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2])
    insert_fresh(allocator, cache, [3, 4, 5])
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert cache.evict(0) == 0
    assert cache.evict(10) == 3
    assert cache.total_size() == 2 == cache.protected_size
    assert cache.evict(10) == 0
    cache.check_invariants()


def test_stale_heap_entries_are_compacted():
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3])
    insert_fresh(allocator, cache, [4])
    for _ in range(1000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._leaves._heap) < 100
    assert cache.evict(1) == 1  # [4] is the older leaf despite 1000 stale entries for the other
    cache.check_invariants()


def test_reset_frees_everything_and_refuses_while_locked():
    allocator, cache = make(50)
    for seq in ([1, 2, 3], [1, 2, 4, 5], [7, 8]):
        insert_fresh(allocator, cache, seq)
    node = cache.match_prefix([7, 8]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert allocator.num_free == 50 and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).slots.size == 0
    insert_fresh(allocator, cache, [1, 2, 3])
    cache.check_invariants()


def test_disabled_cache_reuses_nothing_and_frees_on_insert():
    allocator, cache = make(10, disable=True)
    slots, cached = insert_fresh(allocator, cache, [1, 2, 3])
    assert cached == 0 and allocator.num_free == 10 and cache.total_size() == 0
    result = cache.match_prefix([1, 2, 3])
    assert result.slots.size == 0 and result.last_node is cache.root
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    assert cache.evict(5) == 0


def test_insert_rejects_length_mismatch():
    allocator, cache = make()
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        cache.insert([1, 2, 3], allocator.alloc(2))


def test_insert_does_not_alias_the_callers_arrays():
    allocator, cache = make()
    tokens = np.array([1, 2, 3], dtype=np.int32)
    slots = allocator.alloc(3)
    expected = slots.tolist()
    cache.insert(tokens, slots)
    tokens[:] = 9
    slots[:] = 0
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == expected
    cache.match_prefix([1, 2, 3]).slots[:] = 0  # nor does a match result alias the tree
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == expected


# ----------------------------------------------------------------------------- property test

ALPHABET = 3  # small, so prefixes collide and nodes split often
MAX_LEN = 8
NUM_SLOTS = 48  # small, so allocation runs into eviction
MAX_PENDING = 4

sequences = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=MAX_LEN)


class ReferenceCache:
    """The tree's behaviour restated per token: every cached token is named by its full prefix.

    A token's last access is the last operation whose path covered it; the real tree keeps the same
    value per node because any partial touch splits the node first. Only the last node of an
    operation's path can be a leaf, so leaf access times are distinct and LRU order is unambiguous.
    """

    def __init__(self):
        self.slot: dict[tuple, int] = {}
        self.access: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}
        self.clock = 0

    def match(self, tokens):
        self.clock += 1
        slots = []
        for i in range(len(tokens)):
            prefix = tuple(tokens[: i + 1])
            if prefix not in self.slot:
                break
            slots.append(self.slot[prefix])
            self.access[prefix] = self.clock
        return slots

    def insert(self, tokens, slots):
        """Returns (already cached count, slots the cache must free as duplicates)."""
        self.clock += 1
        cached, duplicates = 0, []
        for i in range(len(tokens)):
            prefix = tuple(tokens[: i + 1])
            if prefix in self.slot:
                cached += 1
                if self.slot[prefix] != slots[i]:
                    duplicates.append(slots[i])
            else:
                self.slot[prefix] = slots[i]
                self.locks[prefix] = 0
            self.access[prefix] = self.clock
        return cached, duplicates

    def lock(self, tokens, delta):
        for i in range(len(tokens)):
            self.locks[tuple(tokens[: i + 1])] += delta

    def evictable_leaves(self):
        return [p for p in self.slot if self.locks[p] == 0 and not any(p + (a,) in self.slot for a in range(ALPHABET))]

    def evict_tokens(self, count):
        for _ in range(count):
            oldest = min(self.evictable_leaves(), key=self.access.__getitem__)
            del self.slot[oldest], self.access[oldest], self.locks[oldest]

    def evictable_count(self):
        return sum(1 for p in self.slot if self.locks[p] == 0)


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.allocator = TokenSlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(self.allocator)
        self.ref = ReferenceCache()
        # Requests in flight: (tokens, matched prefix length, prefix slots, own slots, locked node).
        self.pending = []

    def held_by_requests(self):
        return [s for _, _, _, own, _ in self.pending for s in own.tolist()]

    def evict_and_check(self, num_tokens):
        evictable_before = self.ref.evictable_count()
        freed = self.cache.evict(num_tokens)
        # Whole leaves only: at least what was asked (or all there is), overshooting by < one leaf.
        assert freed >= min(num_tokens, evictable_before)
        assert freed <= evictable_before
        assert num_tokens <= 0 or freed < num_tokens + MAX_LEN
        # Which tokens went is checked by the exact free-set invariant against the reference.
        self.ref.evict_tokens(freed)

    def alloc_with_eviction(self, n):
        if n > self.allocator.num_free:
            self.evict_and_check(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def match_and_check(self, tokens):
        result = self.cache.match_prefix(tokens)
        expected = self.ref.match(tokens)
        assert result.slots.dtype == np.int32
        assert result.slots.tolist() == expected
        return result

    @rule(tokens=sequences)
    def match(self, tokens):
        self.match_and_check(tokens)

    @precondition(lambda self: len(self.pending) < MAX_PENDING)
    @rule(tokens=sequences)
    def begin_request(self, tokens):
        # As the scheduler does: match all but the last token, lock the hit, allocate the rest.
        result = self.match_and_check(tokens[:-1])
        matched = len(result.slots)
        self.cache.inc_lock_ref(result.last_node)
        self.ref.lock(tokens[:matched], +1)
        own = self.alloc_with_eviction(len(tokens) - matched)
        if own is None:  # does not fit even after eviction: give up like an aborted request
            self.cache.dec_lock_ref(result.last_node)
            self.ref.lock(tokens[:matched], -1)
            return
        self.pending.append((tokens, matched, result.slots, own, result.last_node))

    def _finish_or_abort(self, data, finish):
        index = data.draw(st.integers(0, len(self.pending) - 1))
        tokens, matched, prefix_slots, own, node = self.pending.pop(index)
        if finish:
            slots = np.concatenate([prefix_slots, own])
            cached, duplicates = self.ref.insert(tokens, slots.tolist())
            assert self.cache.insert(tokens, slots) == cached
            assert cached >= matched
        else:
            self.allocator.free(own)
        self.cache.dec_lock_ref(node)
        self.ref.lock(tokens[:matched], -1)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def finish_request(self, data):
        self._finish_or_abort(data, finish=True)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort_request(self, data):
        self._finish_or_abort(data, finish=False)

    @rule(tokens=sequences)
    def insert_freshly_computed(self, tokens):
        # A request that computed everything itself: whatever is already cached comes back freed.
        slots = self.alloc_with_eviction(len(tokens))
        if slots is None:
            return
        cached, _ = self.ref.insert(tokens, slots.tolist())
        assert self.cache.insert(tokens, slots) == cached

    @rule(num_tokens=st.integers(0, 6))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    @precondition(lambda self: not self.pending)
    @rule()
    def reset(self):
        self.cache.reset()
        self.ref = ReferenceCache()

    @invariant()
    def sizes_are_exact(self):
        locked = sum(1 for count in self.ref.locks.values() if count > 0)
        assert self.cache.protected_size == locked
        assert self.cache.evictable_size == len(self.ref.slot) - locked
        assert self.cache.total_size() == len(self.ref.slot)
        held = self.held_by_requests()
        assert self.allocator.num_free + self.cache.total_size() + len(held) == NUM_SLOTS
        self.cache.check_invariants()

    @invariant()
    def free_slots_are_exactly_the_unowned_ones(self):
        # Catches a duplicate not freed, a tree slot freed, or the wrong leaf evicted.
        free = self.allocator.alloc(self.allocator.num_free)
        owned = set(self.ref.slot.values()) | set(self.held_by_requests())
        assert len(owned) == NUM_SLOTS - len(free)
        assert set(free.tolist()) == set(range(1, NUM_SLOTS + 1)) - owned
        self.allocator.free(free)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_matches_reference = RadixCacheMachine.TestCase
