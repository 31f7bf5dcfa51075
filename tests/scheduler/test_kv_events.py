"""The radix tree as KV block events (scheduler_service/kv_events.py), against the tree itself: after every insert,
eviction, pin and flush, in the shared cache and in salted namespaces, (1) the live set is exactly the full blocks of
what the tree holds, and (2) a router that only replays the events (a parent must be known when its child is stored,
a removed block must be known, and its children go with it) holds the same blocks, each with its salt."""

from __future__ import annotations

import random

import msgspec
import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import path_tokens, subtree
from radixserve.protocol import KvBlocksStored, SchedulerToTokenizer, unpack_i32
from scheduler_service.cache_events import CacheEventLog
from scheduler_service.kv_events import KvBlockLog, Listeners, block_hashes

B = 4


def tree_blocks(tree: RadixCache) -> dict[int, str | None]:
    """Every full block the tree holds: hash -> namespace (from the tree's own paths, not from the events)."""
    blocks = {}
    for namespace, root in tree._roots.items():
        for node in subtree(root):
            for h in block_hashes(path_tokens(node), B, namespace):
                blocks[h] = namespace
    return blocks


class ReplayingRouter:
    """What a router knows from the events alone; checks that each one makes sense where it arrives."""

    def __init__(self):
        self.parent: dict[int, int | None] = {}
        self.salt: dict[int, str | None] = {}

    def apply(self, message) -> None:
        # Through the wire format, as the worker's relay reads it.
        message = msgspec.msgpack.Decoder(SchedulerToTokenizer).decode(msgspec.msgpack.encode(message))
        for event in message.events:
            if isinstance(event, KvBlocksStored):
                assert len(unpack_i32(event.token_ids)) == B * len(event.block_hashes)  # full blocks only
                parent = event.parent_hash
                assert parent is None or parent in self.parent, "a block stored under an unknown parent"
                for h in event.block_hashes:
                    assert h not in self.parent, "a block stored twice"
                    self.parent[h], self.salt[h], parent = parent, event.cache_salt, h
            else:
                for h in event.block_hashes:
                    assert h in self.parent, "an unknown block removed"
                    del self.parent[h], self.salt[h]
                assert not set(self.parent.values()) & set(event.block_hashes), "a block outlived its parent"


def test_block_events_follow_the_tree_exactly():
    rng = random.Random(0)
    allocator = TokenSlotAllocator(300)
    tree = RadixCache(allocator)
    log, mirror_log = KvBlockLog(B, dp_rank=0), CacheEventLog()
    tree.listener = Listeners(mirror_log, log)  # as a --dp-size > 1 Dynamo worker's scheduler has it
    router = ReplayingRouter()
    stems = [[rng.randrange(30) for _ in range(rng.randrange(3, 25))] for _ in range(10)]
    pins, salts, seen = [], [None, None, "tenant-a", "tenant-b"], set()
    for step in range(600):
        namespace = rng.choice(salts)
        seq = rng.choice(stems)[: rng.randrange(1, 26)] + [rng.randrange(30) for _ in range(rng.randrange(0, 12))]
        if allocator.num_free < len(seq):
            tree.evict(len(seq) - allocator.num_free + rng.randrange(0, 30))
        if allocator.num_free >= len(seq):
            tree.insert(seq, allocator.alloc(len(seq)), namespace=namespace)
        if step % 97 == 50 and len(seq) >= 2 * B:
            pins.append((seq, tree.pin(seq, namespace=namespace)))
        if step % 150 == 149:
            tree.reset(keep_pins=step != 449)  # a flush: the router hears every unpinned block go
        message = log.take()
        if message is not None:
            router.apply(message)
        expected = tree_blocks(tree)
        assert log.live == set(expected), f"step {step}"
        assert router.salt == expected, f"step {step}"
        seen |= set(expected.values())
    assert tree.evicted_tokens > 1000 and len(pins) >= 4 and seen == set(salts)


def test_pins_survive_a_flush_in_every_namespace():
    allocator = TokenSlotAllocator(100)
    tree = RadixCache(allocator)
    log = KvBlockLog(B, dp_rank=0)
    tree.listener = log
    router = ReplayingRouter()
    shared, salted = list(range(1, 11)), list(range(1, 11))
    tree.insert(shared, allocator.alloc(10))
    tree.insert(salted, allocator.alloc(10), namespace="t")
    tree.insert(list(range(50, 70)), allocator.alloc(20))
    tree.pin(shared[:9])
    tree.pin(salted, namespace="t")
    router.apply(log.take())
    assert len(router.parent) == 2 + 2 + 5
    tree.reset()
    router.apply(log.take())
    # 9 pinned tokens keep 2 full blocks; the salted pin keeps its 2; the unpinned 20 tokens are gone.
    assert sorted(router.salt.values(), key=str) == [None, None, "t", "t"]
    tree.reset(keep_pins=False)
    router.apply(log.take())
    assert router.parent == {} and log.live == set()


def test_hashes_name_a_prefix_and_its_namespace():
    a = np.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int32)
    b = np.array([5, 6, 7, 8, 1, 2, 3, 4], dtype=np.int32)
    assert block_hashes(a, 4, None)[0] == block_hashes(b, 4, None)[0]  # the same first block
    assert block_hashes(a, 4, None)[1] != block_hashes(b, 4, None)[1]
    assert block_hashes(a, 4, "x") != block_hashes(a, 4, None) != block_hashes(a, 4, "y")
    assert block_hashes(a[:7], 4, None) == block_hashes(a, 4, None)[:1]  # only full blocks
    assert all(-(2**63) <= h < 2**63 for h in block_hashes(a, 4, "x"))  # Dynamo's signed 64-bit hashes
