"""The scheduler's slot allocators (KV slots and req_to_token rows: ascending first allocations, the padding slot
never handed out, frees checked and in order) and the worker's req_to_token and KV tensors (writes, shapes, the
memory budget)."""

import numpy as np
import pytest
import torch

from radixserve.cache.slot_allocator import ReqPoolAllocator, TokenSlotAllocator
from radixserve.worker.kv_cache import KVCache, ReqToTokenPool


def test_first_allocations_are_ascending_and_skip_the_padding_slot():
    alloc = TokenSlotAllocator(10)
    slots = alloc.alloc(4)
    assert slots.dtype == np.int32
    assert slots.tolist() == [1, 2, 3, 4]
    assert alloc.num_free == 6 and alloc.num_used == 4 and alloc.num_total == 10


def test_alloc_zero_and_too_many():
    alloc = TokenSlotAllocator(5)
    empty = alloc.alloc(0)
    assert empty.dtype == np.int32 and empty.shape == (0,)
    assert alloc.alloc(6) is None
    assert alloc.num_free == 5  # a failed alloc takes nothing
    assert sorted(alloc.alloc(5).tolist()) == [1, 2, 3, 4, 5]
    assert alloc.alloc(1) is None
    with pytest.raises(ValueError):
        alloc.alloc(-1)


def test_random_alloc_free_never_hands_out_a_slot_twice():
    rng = np.random.default_rng(0)
    num_slots = 300
    alloc = TokenSlotAllocator(num_slots)
    held: list[np.ndarray] = []
    held_set: set[int] = set()
    for _ in range(3000):
        if held and rng.random() < 0.45:
            chunk = held.pop(rng.integers(len(held)))
            if rng.random() < 0.5:
                chunk = rng.permutation(chunk)
            alloc.free(chunk if rng.random() < 0.5 else chunk.tolist())
            held_set.difference_update(chunk.tolist())
        else:
            n = int(rng.integers(0, 40))
            slots = alloc.alloc(n)
            if slots is None:
                assert n > alloc.num_free
                continue
            got = slots.tolist()
            assert len(set(got)) == n
            assert all(1 <= s <= num_slots for s in got)
            assert held_set.isdisjoint(got), "slot handed out while still held"
            held.append(slots)
            held_set.update(got)
        assert alloc.num_free + len(held_set) == num_slots
    for chunk in held:
        alloc.free(chunk)
    assert alloc.num_free == num_slots
    assert sorted(alloc.alloc(num_slots).tolist()) == list(range(1, num_slots + 1))


def test_freed_slots_come_back_in_the_same_order():
    alloc = TokenSlotAllocator(20)
    alloc.alloc(20)
    alloc.free(np.array([7, 3, 15], dtype=np.int64))
    assert alloc.alloc(3).tolist() == [7, 3, 15]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([0], "slot 0"),
        ([11], "slot 11"),
        ([-3], "slot -3"),
        ([2, 5, 2], "slot 2"),  # repeated inside one call
    ],
)
def test_free_rejects_reserved_out_of_range_and_repeated(bad, message):
    alloc = TokenSlotAllocator(10)
    alloc.alloc(10)
    with pytest.raises(ValueError, match=message):
        alloc.free(np.array(bad))
    assert alloc.num_free == 0  # a rejected free changes nothing


def test_double_free_raises_with_the_slot_and_changes_nothing():
    alloc = TokenSlotAllocator(10)
    slots = alloc.alloc(5)  # 1..5
    alloc.free(slots[:2])
    with pytest.raises(ValueError, match="double free of KV slot 2"):
        alloc.free([4, 2])
    assert alloc.num_free == 7
    with pytest.raises(ValueError, match="slot 8"):
        alloc.free([8])  # never allocated: also already free
    alloc.free([4, 3, 5])
    assert alloc.num_free == 10


def test_free_accepts_empty_and_tensors():
    alloc = TokenSlotAllocator(4)
    alloc.free([])
    alloc.free(np.zeros(0, dtype=np.int32))
    slots = alloc.alloc(3)
    alloc.free(torch.from_numpy(slots.astype(np.int64)))
    assert alloc.num_free == 4
    alloc.alloc(1)
    with pytest.raises(TypeError):
        alloc.free(np.array([1.0]))
    assert alloc.num_free == 3


def test_padding_slot_never_handed_out_even_after_churn():
    alloc = TokenSlotAllocator(8)
    for _ in range(20):
        slots = alloc.alloc(8)
        assert 0 not in slots.tolist()
        alloc.free(slots[::-1])


def test_req_pool_allocator():
    pool = ReqPoolAllocator(3)
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [1, 2, 3]
    assert pool.alloc() is None and pool.num_free == 0
    pool.free(2)
    with pytest.raises(ValueError, match="row 2"):
        pool.free(2)
    with pytest.raises(ValueError, match="row 0"):
        pool.free(0)
    with pytest.raises(ValueError, match="row 4"):
        pool.free(4)
    assert pool.alloc() == 2
    for row in (1, 2, 3):
        pool.free(row)
    assert pool.num_free == 3 == pool.num_total


def test_req_to_token_pool_write():
    pool = ReqToTokenPool(max_running=2, context_len=8, device="cpu")
    assert pool.table.shape == (3, 8) and pool.table.dtype == torch.int32
    assert not pool.table.any()
    # Row 1 positions 0..2, row 2 positions 6..7, row 1 position 3: one scatter for all of them.
    index = pool.flat_index([1, 2, 1], [0, 6, 3], [3, 2, 1])
    assert index.tolist() == [8, 9, 10, 22, 23, 11]
    pool.write(torch.from_numpy(index), torch.tensor([5, 9, 2, 4, 4, 7], dtype=torch.int32))
    assert pool.table[1, :5].tolist() == [5, 9, 2, 7, 0]
    assert pool.table[2].tolist() == [0, 0, 0, 0, 0, 0, 4, 4]
    assert not pool.table[0].any()
    assert pool.flat_index([], [], []).tolist() == []
    with pytest.raises(ValueError, match="context length"):
        pool.flat_index([1], [7], [2])
    with pytest.raises(ValueError, match="row out of range"):
        pool.flat_index([3], [0], [1])


def test_kv_cache_shapes_and_budget():
    cache = KVCache(num_layers=3, num_slots=10, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    assert cache.k_cache(2).shape == (11, 2, 4) and cache.v_cache(0).dtype == torch.float16
    assert cache.k_cache(0).data_ptr() != cache.v_cache(0).data_ptr()
    assert cache.k_cache(0).data_ptr() != cache.k_cache(1).data_ptr()
    per_slot = KVCache.bytes_per_slot(3, 2, 4, torch.float16)
    assert per_slot == 2 * 3 * 2 * 4 * 2
    assert per_slot * 11 == sum(b.numel() * b.element_size() for b in cache.k_buffers + cache.v_buffers)
    assert KVCache.num_slots_for_budget(per_slot * 11, 3, 2, 4, torch.float16) == 10
