"""RadixCache.insert_below (a request's tokens past the prefix it holds, inserted from the node it holds) against
insert of the whole sequence from the root: the same tree, clock, eviction order, freed slots and listener events."""

import itertools

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import path_tokens, subtree


class Events:
    def __init__(self):
        self.log = []

    def inserted(self, tokens, namespace):
        self.log.append(("inserted", tuple(np.asarray(tokens).tolist()), namespace))

    def evicted(self, path, key, namespace):
        self.log.append(("evicted", tuple(path.tolist()), tuple(key.tolist()), namespace))

    def cleared(self):
        self.log.append(("cleared",))


def snapshot(cache: RadixCache, allocator: TokenSlotAllocator):
    nodes = sorted(
        (
            str(ns),
            tuple(path_tokens(n).tolist()),
            tuple(n.value.tolist()),
            n.last_access,
            n.priority,
            n.hit_count,
            n.lock_ref,
        )
        for ns, root in cache._roots.items()
        for n in subtree(root)
    )
    return nodes, allocator.num_free, cache.evictable_size, cache.protected_size, cache.listener.log


def run(use_insert_below: bool, seed: int):
    """Requests over a few shared prefixes in two namespaces, each matching, locking, computing its tail (a chunk
    at a time) and inserting it, with evictions between; returns a snapshot after every operation."""
    rng = np.random.default_rng(seed)
    allocator = TokenSlotAllocator(4000)
    cache = RadixCache(allocator)
    cache.listener = Events()
    prefixes = [rng.integers(1, 50, rng.integers(1, 30)).tolist() for _ in range(4)]
    snapshots, running = [], []
    for _ in range(150):
        if running and rng.random() < 0.5:  # a running request inserts its next chunk (or its last)
            i = int(rng.integers(len(running)))
            req = running[i]
            end = min(len(req["tokens"]), max(1, req["done"] + int(rng.integers(0, 6))))  # (a request holds a token)
            tokens, slots = req["tokens"], req["slots"]
            if use_insert_below:
                start = req["done"]
                got = cache.insert_below(req["node"], tokens[start:end], slots[start:end], req["priority"])
                slots[start:end] = got.slots
                node = got.last_node
            else:
                cache.insert(tokens[:end], slots[:end], req["namespace"], req["priority"])
                tick = next(cache._clock) - 1  # (the insert's: the match that follows touches with it too)
                cache._clock = itertools.count(tick)
                match = cache.match_prefix(tokens[:end], req["namespace"], req["priority"], record_hit=False)
                cache._clock = itertools.count(tick + 1)
                slots[:end] = match.slots
                node = match.last_node
            cache.inc_lock_ref(node)
            cache.dec_lock_ref(req["node"])
            req["node"], req["done"] = node, end
            if end == len(tokens) and rng.random() < 0.5:
                cache.dec_lock_ref(node)
                running.pop(i)
        elif rng.random() < 0.15:
            cache.evict(int(rng.integers(1, 40)))
        else:  # a request arrives: a shared prefix (or none), a tail, maybe one another request has too
            namespace = [None, "tenant"][int(rng.integers(2))] if rng.random() < 0.3 else None
            prefix = prefixes[int(rng.integers(len(prefixes)))] if rng.random() < 0.8 else []
            tokens = np.array(prefix + rng.integers(1, 4, rng.integers(1, 8)).tolist(), dtype=np.int32)
            priority = int(rng.integers(3))
            match = cache.match_prefix(tokens, namespace, priority)
            cache.inc_lock_ref(match.last_node)
            slots = np.zeros(len(tokens), dtype=np.int32)
            slots[: len(match.slots)] = match.slots
            fresh = allocator.alloc(len(tokens) - len(match.slots))
            slots[len(match.slots) :] = fresh
            done = len(match.slots)
            running.append(dict(tokens=tokens, slots=slots, done=done, node=match.last_node, namespace=namespace))
            running[-1]["priority"] = priority
        cache.check_invariants()
        snapshots.append(snapshot(cache, allocator))
    return snapshots


def test_insert_below_equals_inserting_the_whole_sequence():
    for seed in range(12):
        below, whole = run(True, seed), run(False, seed)
        for step, (a, b) in enumerate(zip(below, whole)):
            assert a == b, f"seed {seed}, operation {step}"
