"""Cache control in the radix tree: eviction policies, namespaces (cache_salt), pins with TTL,
reset(keep_pins), evict_hook, counters and largest_prefixes, one example each. The property test against a
reference model, per policy, is tests/unit/test_radix_cache_control_model.py."""

import numpy as np
import pytest

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_inspection import PREFIX_PREVIEW_TOKENS


def make(num_slots=100, policy="lru"):
    allocator = TokenSlotAllocator(num_slots)
    return allocator, RadixCache(allocator, eviction_policy=policy)


def put(allocator, cache, tokens, namespace=None, priority=0):
    slots = allocator.alloc(len(tokens))
    cache.insert(tokens, slots, namespace=namespace, priority=priority)
    return slots


def cached(cache, tokens, namespace=None):
    return len(cache.match_prefix(tokens, namespace=namespace, record_hit=False).slots)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make(policy="mru")


def test_lfu_evicts_the_least_hit_leaf_first_then_the_oldest():
    allocator, cache = make(policy="lfu")
    put(allocator, cache, [1, 1])
    put(allocator, cache, [2, 2])
    put(allocator, cache, [3, 3])
    for _ in range(3):
        cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])
    cache.match_prefix([3, 3], record_hit=False)  # recent, but not a hit: [3, 3] keeps 0 hits
    assert cache.eviction_policy == "lfu"
    assert cache.evict(1) == 2 and cached(cache, [3, 3]) == 0
    assert cache.evict(1) == 2 and cached(cache, [2, 2]) == 0
    assert cached(cache, [1, 1]) == 2
    assert cache.evicted_tokens == 4


def test_priority_evicts_the_lowest_priority_leaf_first_then_lru():
    allocator, cache = make(policy="priority")
    put(allocator, cache, [1], priority=5)
    put(allocator, cache, [2], priority=0)
    put(allocator, cache, [3], priority=-1)
    put(allocator, cache, [4], priority=0)
    cache.match_prefix([3], priority=9)  # a node keeps the highest priority of whoever used it
    order = []
    for _ in range(4):
        cache.evict(1)
        order.append(next(t for t in (1, 2, 3, 4) if cached(cache, [t]) == 0 and t not in order))
    assert order == [2, 4, 1, 3]


def test_lru_is_the_default_and_ignores_priority_and_hits():
    allocator, cache = make()
    put(allocator, cache, [1], priority=9)
    put(allocator, cache, [2])
    for _ in range(5):
        cache.match_prefix([1])
    cache.match_prefix([2])
    assert cache.eviction_policy == "lru"
    cache.evict(1)
    assert cached(cache, [1]) == 0 and cached(cache, [2]) == 1


def test_namespaces_never_share():
    allocator, cache = make()
    shared = put(allocator, cache, [1, 2, 3, 4])
    tenant = put(allocator, cache, [1, 2, 3, 4], namespace="tenant-a")
    assert set(shared.tolist()).isdisjoint(tenant.tolist())  # computed twice: nothing was shared
    assert cache.match_prefix([1, 2, 3, 4], namespace="tenant-a").slots.tolist() == tenant.tolist()
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == shared.tolist()
    result = cache.match_prefix([1, 2, 3, 4], namespace="tenant-b")
    assert result.slots.size == 0 and result.last_node.parent is None and result.last_node is not cache.root
    assert cache.insert([1, 2, 3, 4, 5], np.concatenate([tenant, allocator.alloc(1)]), namespace="tenant-a") == 4
    assert cache.total_size() == 9
    cache.check_invariants()
    assert cache.evict(100) == 9 and allocator.num_free == 100
    cache.check_invariants()


def test_listener_hears_every_namespace():
    events = []

    class Listener:
        def inserted(self, tokens, namespace):
            events.append(("inserted", tokens.tolist(), namespace))

        def evicted(self, path, key, namespace):
            events.append(("evicted", path.tolist(), key.tolist(), namespace))

        def cleared(self):
            events.append(("cleared",))

    allocator, cache = make()
    cache.listener = Listener()
    put(allocator, cache, [1, 2], namespace="salt")
    put(allocator, cache, [1, 2, 3])
    cache.evict(100)
    assert sorted(events[2:]) == [("evicted", [], [1, 2], "salt"), ("evicted", [], [1, 2, 3], None)]
    assert events[:2] == [("inserted", [1, 2], "salt"), ("inserted", [1, 2, 3], None)]
    put(allocator, cache, [5, 6, 7])
    put(allocator, cache, [5, 8])
    cache.pin([5, 6])
    put(allocator, cache, [9, 9, 9], namespace="salt")
    cache.pin([9, 9], namespace="salt")
    events.clear()
    cache.reset()  # the listener is told what is left: each pinned path, ending where its leaf does
    assert events == [("cleared",), ("inserted", [5, 6], None), ("inserted", [9, 9], "salt")]


def test_pinned_prefix_survives_a_flood():
    allocator, cache = make(60)
    system = put(allocator, cache, list(range(100, 120)))
    info = cache.pin(list(range(100, 120)))
    assert (info.num_tokens, info.namespace, info.expires_at) == (20, None, None) and info.id.startswith("pin-")
    assert cache.pinned_size == 20 == cache.protected_size and cache.locked_size == 0
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 50, size=int(rng.integers(1, 12))).tolist()
        if len(tokens) > allocator.num_free:
            cache.evict(len(tokens) - allocator.num_free)
        put(allocator, cache, tokens)
    assert cache.evicted_tokens > 40 * 5
    assert cache.match_prefix(list(range(100, 120))).slots.tolist() == system.tolist()
    cache.check_invariants()
    assert cache.unpin(info.id) and not cache.unpin(info.id)
    assert cache.pinned_size == 0 and cache.list_pins() == []
    cache.evict(100)
    assert cached(cache, list(range(100, 120))) == 0 and allocator.num_free == 60


def test_pin_of_part_of_a_node_splits_and_protects_only_that_part():
    allocator, cache = make()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    cache.pin([1, 2, 3])
    assert cache.pinned_size == 3 and cache.evictable_size == 3
    assert cache.evict(100) == 3 and cached(cache, [1, 2, 3, 4]) == 3
    # Two pins over one path count its tokens once; each unpin releases only its own.
    second = cache.pin([1, 2], namespace=None, ttl_seconds=60)
    assert cache.pinned_size == 3 and len(cache.list_pins()) == 2
    cache.check_invariants()
    first = cache.list_pins()[0]
    cache.unpin(first.id)
    assert cache.pinned_size == 2 and cache.evict(100) == 1
    assert [p.id for p in cache.list_pins()] == [second.id]
    cache.check_invariants()


def test_pin_refuses_what_is_not_cached():
    allocator, cache = make()
    put(allocator, cache, [1, 2, 3])
    with pytest.raises(ValueError, match="only 3 of 4 tokens are cached"):
        cache.pin([1, 2, 3, 4])
    with pytest.raises(ValueError, match="only 0 of 3 tokens"):
        cache.pin([1, 2, 3], namespace="elsewhere")
    with pytest.raises(ValueError, match="no tokens"):
        cache.pin([])
    with pytest.raises(ValueError, match="ttl_seconds must be > 0"):
        cache.pin([1], ttl_seconds=0)
    assert cache.pinned_size == 0 and cache.list_pins() == []
    cache.check_invariants()


def test_ttl_expiry_unpins():
    allocator, cache = make()
    put(allocator, cache, [1, 2, 3])
    put(allocator, cache, [7, 8])
    short = cache.pin([1, 2, 3], ttl_seconds=10)
    forever = cache.pin([7, 8])
    assert short.expires_at == pytest.approx(short.created_at + 10)
    assert cache.expire_pins(now=short.created_at + 9) == []
    assert cache.evict(100) == 0
    assert cache.expire_pins(now=short.expires_at) == [short.id]
    assert [p.id for p in cache.list_pins()] == [forever.id] and cache.pinned_size == 2
    assert cache.evict(100) == 3 and not cache.unpin(short.id)
    cache.check_invariants()


def test_evict_expires_pins_whose_time_has_passed():
    allocator, cache = make()
    put(allocator, cache, [1, 2, 3])
    info = cache.pin([1, 2, 3], ttl_seconds=1e-9)  # already over by the time evict looks at the clock
    assert cache.evict(1) == 3 and cache.pinned_size == 0 and not cache.unpin(info.id)


def test_reset_keeps_pins_unless_asked_and_refuses_while_locked():
    allocator, cache = make(50)
    system = put(allocator, cache, [1, 2, 3, 4])
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    put(allocator, cache, [9, 9])
    salted = put(allocator, cache, [1, 2, 3], namespace="t")
    put(allocator, cache, [5], namespace="u")
    cache.pin([1, 2, 3, 4])
    cache.pin([1, 2, 3], namespace="t")
    node = cache.match_prefix([9, 9]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset(keep_pins=True)
    cache.check_invariants()
    assert cache.total_size() == 7 == cache.pinned_size == cache.protected_size and allocator.num_free == 43
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == system.tolist()
    assert cache.match_prefix([1, 2, 3], namespace="t").slots.tolist() == salted.tolist()
    assert cached(cache, [9, 9]) == 0 and cached(cache, [5], namespace="u") == 0
    assert len(cache.list_pins()) == 2
    cache.reset(keep_pins=False)
    cache.check_invariants()
    assert cache.total_size() == 0 and cache.pinned_size == 0 and allocator.num_free == 50
    assert cache.list_pins() == []


def test_evict_hook_sees_each_leaf_before_its_slots_are_freed():
    allocator, cache = make(20)
    put(allocator, cache, [1, 2, 3])
    put(allocator, cache, [1, 2, 3, 4, 5], namespace="t")
    put(allocator, cache, [1, 2, 7])  # the default namespace now has [1, 2] -> {[3], [7]}
    seen = []

    def hook(path_tokens, slots, namespace):
        assert path_tokens.dtype == np.int32 and len(slots) <= len(path_tokens)
        assert not allocator._is_free[slots].any(), "slots already freed when the hook ran"
        seen.append((path_tokens.tolist(), slots.tolist(), namespace))

    cache.evict_hook = hook
    full = {
        ns: cache.match_prefix(t, namespace=ns, record_hit=False).slots.tolist()
        for ns, t in ((None, [1, 2, 3]), ("t", [1, 2, 3, 4, 5]))
    }
    seven = cache.match_prefix([1, 2, 7], record_hit=False).slots.tolist()
    assert cache.evict(100) == 9
    assert sorted(seen, key=str) == sorted(
        [
            ([1, 2, 3], full[None][2:], None),
            ([1, 2, 7], seven[2:], None),
            ([1, 2], full[None][:2], None),
            ([1, 2, 3, 4, 5], full["t"], "t"),
        ],
        key=str,
    )
    # The parent [1, 2] goes after both of its children, never before.
    assert [s[0] for s in seen if s[2] is None][-1] == [1, 2]
    assert allocator.num_free == 20


def test_largest_prefixes_lists_leaves_branch_points_and_pin_ends():
    allocator, cache = make()
    put(allocator, cache, list(range(40)))
    put(allocator, cache, list(range(10)) + [99, 98])
    put(allocator, cache, [5, 6, 7], namespace="t")
    cache.pin(list(range(20)))
    for _ in range(3):
        cache.match_prefix(list(range(10)) + [99, 98])
    top = cache.largest_prefixes(10)
    assert [(p["num_tokens"], p["pinned"], p["namespace"]) for p in top] == [
        (40, False, None),
        (20, True, None),
        (12, False, None),
        (10, True, None),
        (3, False, "t"),
    ]
    assert top[0]["tokens"] == list(range(PREFIX_PREVIEW_TOKENS))
    assert top[2]["tokens"] == list(range(10)) + [99, 98] and top[2]["hits"] == 3
    assert top[3]["hits"] == 3 and top[0]["hits"] == 0 and top[0]["last_use"] > 0
    assert [p["num_tokens"] for p in cache.largest_prefixes(2)] == [40, 20]
