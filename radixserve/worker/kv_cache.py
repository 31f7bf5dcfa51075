"""The worker's KV memory: the per-layer K/V buffers and the req_to_token table that maps each request's token
positions to KV slots. Which slots and rows are free is decided by the scheduler (radixserve/cache/slot_allocator.py);
these tensors only hold what every ForwardBatch says."""

from __future__ import annotations

import itertools
import math
import mmap
import weakref
from typing import NamedTuple

import numpy as np
import torch

from radixserve.protocol import ReusedSlots, unpack_i32


class ReqToTokenPool:
    """int32 table [max_running + 1, context_len]: row r, column i = slot of token i of the request
    holding row r. Zero-initialised, so unwritten entries point at the padding slot.

    One writer: the worker process holds the only copy, and the model runner writes it once per step with every
    assignment its ForwardBatch implies (the new tokens' slots, then any reused slots). The scheduler decides
    every slot but never holds a table, so there is no second copy to keep in step and no write that one side
    makes behind the other's back."""

    def __init__(self, max_running: int, context_len: int, device: torch.device | str = "cpu"):
        self.max_running = max_running
        self.context_len = context_len
        self.table = torch.zeros((max_running + 1, context_len), dtype=torch.int32, device=device)

    def flat_index(self, rows, starts, lens) -> np.ndarray:
        """Flat table index (int64) of positions starts[i] .. starts[i] + lens[i] - 1 of row rows[i], concatenated.
        Host-side numpy: the caller ships it to the device together with the step's other small arrays."""
        rows, starts, lens = self.check_ranges(rows, starts, lens)
        offsets = np.cumsum(lens) - lens
        return np.repeat(rows * self.context_len + starts - offsets, lens) + np.arange(int(lens.sum()))

    def check_ranges(self, rows, starts, lens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three as int64 arrays; ValueError for a row or a position outside the table."""
        rows, starts, lens = (np.asarray(a, dtype=np.int64) for a in (rows, starts, lens))
        if len(rows):
            if rows.min() < 0 or rows.max() > self.max_running:
                raise ValueError(f"req_to_token row out of range 0..{self.max_running}: {rows.tolist()}")
            if starts.min() < 0 or (starts + lens).max() > self.context_len:
                raise ValueError(
                    f"req_to_token write past the context length {self.context_len}: a sequence of "
                    f"{int((starts + lens).max())} tokens"
                )
        return rows, starts, lens

    def batch_writes(self, reused_slots: list[ReusedSlots], rows, prefix_lens, extend_lens, new_slots) -> TableWrites:
        """Every req_to_token assignment the batch implies: the new tokens' slots at prefix_len.., then the reused
        ranges (cached prefixes, ranges re-pointed at the tree's copy). A range sent with its slots is written by
        the scatter; the ranges that refer to it (ReusedSlots.source: a burst of hits on one cached prompt) are a
        copy of its row range made on the device after the scatter, so the host's work is per range, not per token.
        A step's ranges and new tokens do not overlap, so the order never matters."""
        index = self.flat_index(rows, prefix_lens, extend_lens)
        if not reused_slots:
            return TableWrites(index, new_slots, NO_ROWS, ())
        sent: dict[int, np.ndarray] = {}  # reused_slots index -> its slots, for each range sent with them
        copied_to: dict[int, list[int]] = {}  # the same index -> the rows of the ranges that refer to it
        for i, r in enumerate(reused_slots):
            if r.source < 0:
                sent[i] = unpack_i32(r.slots)
            else:
                source = r.source
                while reused_slots[source].source >= 0:
                    source = reused_slots[source].source
                copied_to.setdefault(source, []).append(r.req_pool_idx)
        sent_index = self.flat_index(
            [reused_slots[i].req_pool_idx for i in sent],
            [reused_slots[i].start for i in sent],
            [len(s) for s in sent.values()],
        )
        index, slots = np.concatenate([index, sent_index]), np.concatenate([new_slots, *sent.values()])
        copies, first = [], 0
        for source, dst_rows in copied_to.items():
            r = reused_slots[source]  # (its range is checked by flat_index above; the rows below)
            copies.append(RowCopy(r.req_pool_idx, r.start, r.start + len(sent[source]), first, first + len(dst_rows)))
            first += len(dst_rows)
        copy_rows = np.fromiter(itertools.chain(*copied_to.values()), dtype=np.int64, count=first)
        self.check_ranges(copy_rows, np.zeros_like(copy_rows), np.zeros_like(copy_rows))
        return TableWrites(index, slots, copy_rows, tuple(copies))

    def write(
        self, flat_index: torch.Tensor, slots: torch.Tensor, copy_rows: torch.Tensor | None = None, copies=()
    ) -> None:
        """table.flat[flat_index] = slots (one scatter for the whole step), then each RowCopy of TableWrites
        (copy_rows: TableWrites.copy_rows on the table's device): one indexed copy per shared range."""
        self.table.view(-1)[flat_index] = slots
        for c in copies:
            self.table[copy_rows[c.first : c.last], c.start : c.end] = self.table[c.source_row, c.start : c.end]


NO_ROWS = np.zeros(0, dtype=np.int64)


class RowCopy(NamedTuple):
    """req_to_token[copy_rows[first:last], start:end] = req_to_token[source_row, start:end]."""

    source_row: int
    start: int
    end: int
    first: int
    last: int


class TableWrites(NamedTuple):
    """A step's req_to_token writes (ReqToTokenPool.batch_writes), in ReqToTokenPool.write's order: the scatter's
    flat positions (int64) and slots (int32), the rows that copies write (int64), and the copies."""

    index: np.ndarray
    slots: np.ndarray
    copy_rows: np.ndarray
    copies: tuple[RowCopy, ...]


class KVCache:
    """Per-layer K and V buffers, each [num_slots + 1, num_kv_heads, head_dim] (row 0 = padding).

    num_kv_heads is the count on this tensor-parallel rank. Zero-initialised so the padding slot holds
    finite values: masked attention over garbage could still turn NaN * 0 into NaN.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k_buffers[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v_buffers[layer]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token costs on one rank: K and V, every layer."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_size

    @staticmethod
    def num_slots_for_budget(
        budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many usable slots fit in budget_bytes, counting the padding row."""
        per_slot = KVCache.bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype)
        return max(0, budget_bytes // per_slot - 1)


class HostKVCache:
    """The host-memory KV pool on this rank (--hicache-size; radixserve/cache/host_tier.py decides every slot):
    [num_layers, 2, num_slots + 1, num_kv_heads, head_dim], layer-major so that one layer's K (or V) of a run of
    consecutive host slots is one contiguous block: the layer-wise offload path (radixserve/worker/layer_ring.py)
    moves one layer at a time, and a strided source would make every copy a CPU gather first. Pinned on CUDA, so
    copies are asynchronous DMA; on the CPU it is a second ordinary buffer and the same code runs (CI tests this).

    The tier's saves and loads stay on the current stream: the scheduler frees and reuses slots at once, and every
    copy is then ordered with the forwards before and after it without making the host wait."""

    # Tokens moved per staging chunk: bounds the device memory a large copy borrows beside the KV pool.
    CHUNK_TOKENS = 1024

    def __init__(self, device_cache: KVCache, num_slots: int):
        c = device_cache
        self.device_cache = c
        self.num_slots = num_slots
        # Uninitialised: only written slots are ever read, and zeroing tens of GB would cost seconds at start-up.
        shape = (c.num_layers, 2, num_slots + 1, c.num_kv_heads, c.head_dim)
        cuda = torch.device(c.k_buffers[0].device).type == "cuda"
        self.buffer = pinned_empty(shape, c.dtype) if cuda else torch.empty(shape, dtype=c.dtype)

    @staticmethod
    def num_slots_for_gb(gb: float, device_cache: KVCache) -> int:
        c = device_cache
        return KVCache.num_slots_for_budget(int(gb * 1e9), c.num_layers, c.num_kv_heads, c.head_dim, c.dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [num_slots + 1, num_kv_heads, head_dim] each."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def save(self, device_slots: np.ndarray, host_slots: np.ndarray) -> None:
        """buffer[:, :, host_slots[i]] = KV of device slot device_slots[i], every layer."""
        c = self.device_cache
        for lo in range(0, len(host_slots), self.CHUNK_TOKENS):
            src = device_slots[lo : lo + self.CHUNK_TOKENS]
            index = torch.from_numpy(src.astype(np.int64)).to(c.k_buffers[0].device, non_blocking=True)
            runs = _runs(host_slots[lo : lo + self.CHUNK_TOKENS])
            for layer in range(c.num_layers):
                for kv, device_buffer in enumerate((c.k_buffers[layer], c.v_buffers[layer])):
                    staged = device_buffer[index]  # (a fresh tensor: the caching allocator keeps it until the copy)
                    for start, end, offset in runs:
                        self.buffer[layer, kv, start:end].copy_(
                            staged[offset : offset + end - start], non_blocking=True
                        )

    def load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None:
        """KV of device slot device_slots[i], every layer = buffer[:, :, host_slots[i]]."""
        c = self.device_cache
        device = c.k_buffers[0].device
        for lo in range(0, len(host_slots), self.CHUNK_TOKENS):
            src = host_slots[lo : lo + self.CHUNK_TOKENS]
            runs = _runs(src)
            index = torch.from_numpy(device_slots[lo : lo + self.CHUNK_TOKENS].astype(np.int64)).to(
                device, non_blocking=True
            )
            staged = torch.empty((len(src), c.num_kv_heads, c.head_dim), dtype=c.dtype, device=device)
            for layer in range(c.num_layers):
                for kv, device_buffer in enumerate((c.k_buffers[layer], c.v_buffers[layer])):
                    for start, end, offset in runs:
                        staged[offset : offset + end - start].copy_(
                            self.buffer[layer, kv, start:end], non_blocking=True
                        )
                    device_buffer.index_copy_(0, index, staged)


def pinned_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size: an anonymous mapping (page-aligned) registered with
    cudaHostRegister. torch's pinned allocator rounds every block up to a power of two, so a 78 GB pool (512K tokens
    of Qwen3-8B) would take 128 GiB, more than the host has."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # (keeps the mapping alive)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(
            f"cannot page-lock {nbytes / 1e9:.1f} GB of host memory for the host KV pool (cudaHostRegister error {err})"
        )
    # Unregistered when the mapping goes (the tensor's storage holds it): the next pool's mapping may get the same
    # addresses, and registering them again fails (error 712, seen with a second pool in one process).
    weakref.finalize(mapping, cudart.cudaHostUnregister, t.data_ptr())
    return t


def _runs(slots: np.ndarray):
    """(start, end, offset) for each maximal run of consecutive slot numbers in `slots`: slots[offset:offset +
    end - start] == start..end-1. Host slots come from a free stack and are mostly handed out in long runs."""
    if len(slots) == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    offsets = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(slots[o]), int(slots[o]) + int(e - o), int(o)) for o, e in zip(offsets, ends)]
