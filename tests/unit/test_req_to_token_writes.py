"""req_to_token as the worker writes it (ReqToTokenPool.batch_writes + write: one scatter, then a device-side copy of
each range that other ranges refer to, ReusedSlots.source) against the plain expansion of every range on the host."""

import numpy as np
import pytest
import torch

from radixserve.protocol import ReusedSlots
from radixserve.worker.kv_cache import ReqToTokenPool
from scheduler_service.batch_builder import shared_once

MAX_RUNNING, CONTEXT_LEN = 24, 64


def reference(batch) -> np.ndarray:
    """Every write expanded on the host, in order (what the worker did before the device-side copies)."""
    reused, rows, prefix_lens, extend_lens, new_slots = batch
    table = np.zeros((MAX_RUNNING + 1, CONTEXT_LEN), dtype=np.int32)
    offset = 0
    for row, start, n in zip(rows, prefix_lens, extend_lens):
        table[row, start : start + n] = new_slots[offset : offset + n]
        offset += n
    expanded = []
    for r in reused:
        slots = np.frombuffer(r.slots, dtype=np.int32) if r.source < 0 else expanded[r.source]
        expanded.append(slots)
        table[r.req_pool_idx, r.start : r.start + len(slots)] = slots
    return table


def random_batch(rng: np.random.Generator, chains: bool):
    """Rows that each hold one of a few cached prefixes (shared by several rows) plus new tokens after it, and a
    few ranges re-pointed inside a row's prefix; the refs made by shared_once, as the scheduler sends them."""
    prompts = [rng.integers(1, 10_000, rng.integers(1, 40), dtype=np.int32) for _ in range(rng.integers(1, 5))]
    rows = rng.permutation(np.arange(1, MAX_RUNNING + 1))[: rng.integers(1, MAX_RUNNING)]
    reused, prefix_lens, extend_lens = [], [], []
    for row in rows.tolist():
        prefix = prompts[rng.integers(len(prompts))] if rng.random() < 0.8 else np.zeros(0, dtype=np.int32)
        if len(prefix):
            reused.append(ReusedSlots(row, 0, prefix.tobytes()))
        if rng.random() < 0.2 and len(prefix) > 2:  # a re-pointed range inside it (same slots: its tree copy)
            lo = int(rng.integers(1, len(prefix) - 1))
            reused.append(ReusedSlots(row, lo, prefix[lo:].tobytes()))
        prefix_lens.append(len(prefix))
        extend_lens.append(int(rng.integers(1, CONTEXT_LEN - len(prefix) + 1)))
    new_slots = rng.integers(1, 10_000, sum(extend_lens), dtype=np.int32)
    reused = shared_once(reused)
    if chains:  # a ref to a ref (the worker follows it to the range sent with its slots)
        refs = [i for i, r in enumerate(reused) if r.source >= 0]
        for a, b in zip(refs, refs[1:]):
            if reused[a].source == reused[b].source:
                reused[b] = ReusedSlots(reused[b].req_pool_idx, reused[b].start, b"", a)
    return reused, rows.astype(np.int32), np.array(prefix_lens, np.int32), np.array(extend_lens, np.int32), new_slots


def written(batch, device: str) -> np.ndarray:
    pool = ReqToTokenPool(MAX_RUNNING, CONTEXT_LEN, device)
    writes = pool.batch_writes(*batch)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    pool.write(to(writes.index), to(writes.slots), to(writes.copy_rows), writes.copies)
    return pool.table.cpu().numpy()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_side_copies_write_what_the_host_expansion_writes(device):
    rng = np.random.default_rng(7)
    copied = 0
    for trial in range(300):
        batch = random_batch(rng, chains=trial % 3 == 0)
        writes = ReqToTokenPool(MAX_RUNNING, CONTEXT_LEN).batch_writes(*batch)
        copied += len(writes.copy_rows)
        # Only the ranges sent with their slots are expanded on the host; those that refer to them are not.
        sent = sum(len(r.slots) // 4 for r in batch[0])
        assert len(writes.index) == len(writes.slots) == int(batch[3].sum()) + sent
        np.testing.assert_array_equal(written(batch, device), reference(batch), err_msg=f"trial {trial}")
    assert copied > 1000  # (the copies were exercised, not just the scatter)


def test_copies_are_checked_like_the_scatter():
    pool = ReqToTokenPool(4, 8)
    source = ReusedSlots(1, 0, np.arange(1, 4, dtype=np.int32).tobytes())
    empty = np.zeros(0, dtype=np.int32)
    writes = pool.batch_writes([source, ReusedSlots(2, 0, b"", 0)], empty, empty, empty, empty)
    assert writes.copy_rows.tolist() == [2] and len(writes.index) == 3
    with pytest.raises(ValueError, match="row out of range"):
        pool.batch_writes([source, ReusedSlots(5, 0, b"", 0)], empty, empty, empty, empty)
