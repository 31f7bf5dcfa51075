"""The scheduler's bookkeeping of KV memory: which KV slots and which req_to_token rows are free.

The KV cache is token-granular (page size 1): every token of every request lives in one "slot", a
row of the per-layer K/V buffers. A request's slots need not be contiguous; `req_to_token[row, i]`
says where its i-th token lives. Slot 0 and req_to_token row 0 are never handed out: padded batch
entries point at them, so a padded lane reads and writes harmless memory instead of someone's KV.

These allocators are pure numpy (called every step, so no per-slot Python loops) and live in the
scheduler process; the tensors they index live in the worker (radixserve/worker/kv_cache.py).
"""

from __future__ import annotations

import numpy as np

# Row/slot 0 is the shared dummy target of padding; real indices start at 1.
PADDING_SLOT = 0


class TokenSlotAllocator:
    """Free list of KV slots 1..num_slots, with vectorised double-free detection.

    Free slots sit in a stack; alloc takes from the top and free pushes back, so both are a slice
    copy plus one fancy-index update of the `_is_free` map.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        # Stored in descending order so the first allocations come out as 1, 2, 3, ... (readable
        # in tests and logs, and contiguous memory for a fresh pool).
        self._stack = np.arange(num_slots, 0, -1, dtype=np.int32)
        self._top = num_slots  # _stack[:_top] are the free slots
        self._is_free = np.ones(num_slots + 1, dtype=np.bool_)
        self._is_free[PADDING_SLOT] = False
        # Scratch for spotting a slot repeated inside one free() call without sorting.
        self._last_position = np.zeros(num_slots + 1, dtype=np.int32)
        self._positions = np.arange(num_slots, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_total(self) -> int:
        return self._num_slots

    @property
    def num_used(self) -> int:
        return self._num_slots - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """n distinct free slots as int32, or None (nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._top:
            return None
        # Reversed so that slots come back out in the order they were freed (see free()).
        slots = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[slots] = False
        return slots

    def free(self, slots) -> None:
        """Return slots to the pool. Raises ValueError, changing nothing, if any slot is reserved,
        out of range, already free, or listed twice."""
        slots = np.asarray(slots)
        if slots.size == 0:
            return
        if slots.ndim != 1:
            slots = slots.reshape(-1)
        if not np.issubdtype(slots.dtype, np.integer):
            raise TypeError(f"slot indices must be integers, got dtype {slots.dtype}")
        bad = (slots < 1) | (slots > self._num_slots)
        if bad.any():
            slot = int(slots[bad.argmax()])
            what = "the reserved padding slot" if slot == PADDING_SLOT else "out of range"
            raise ValueError(f"cannot free KV slot {slot}: {what} (valid slots are 1..{self._num_slots})")
        already_free = self._is_free[slots]
        if already_free.any():
            slot = int(slots[already_free.argmax()])
            raise ValueError(f"double free of KV slot {slot}: it is already free")
        n = slots.size
        if n > 1:
            # Whatever order numpy applies repeated writes in, a slot listed at positions i and j
            # can remember only one of them, so the other position reads back a mismatch.
            self._last_position[slots] = self._positions[:n]
            repeated = self._last_position[slots] != self._positions[:n]
            if repeated.any():
                slot = int(slots[repeated.argmax()])
                raise ValueError(f"double free of KV slot {slot}: listed twice in one free() call")
        self._is_free[slots] = True
        self._stack[self._top : self._top + n] = slots[::-1]
        self._top += n

    def __repr__(self) -> str:
        return f"TokenSlotAllocator(free={self.num_free}/{self.num_total})"


class ReqPoolAllocator:
    """Hands out req_to_token rows 1..max_running (row 0 is the padding row)."""

    def __init__(self, max_running: int):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self._max_running = max_running
        # Popped from the end, so row 1 is handed out first.
        self._free_rows = list(range(max_running, 0, -1))
        self._is_free = [False] + [True] * max_running

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    @property
    def num_total(self) -> int:
        return self._max_running

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        row = int(row)
        if not 1 <= row <= self._max_running:
            raise ValueError(f"cannot free req_to_token row {row}: valid rows are 1..{self._max_running}")
        if self._is_free[row]:
            raise ValueError(f"double free of req_to_token row {row}")
        self._is_free[row] = True
        self._free_rows.append(row)

    def __repr__(self) -> str:
        return f"ReqPoolAllocator(free={self.num_free}/{self.num_total})"
