"""The worker's KV memory: the per-layer K/V buffers and the req_to_token table that maps each request's token
positions to KV slots. Which slots and rows are free is decided by the scheduler (radixserve/cache/slot_allocator.py);
these tensors only hold what every ForwardBatch says."""

from __future__ import annotations

import numpy as np
import torch

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
        rows, starts, lens = (np.asarray(a, dtype=np.int64) for a in (rows, starts, lens))
        if len(rows):
            if rows.min() < 0 or rows.max() > self.max_running:
                raise ValueError(f"req_to_token row out of range 0..{self.max_running}: {rows.tolist()}")
            if starts.min() < 0 or (starts + lens).max() > self.context_len:
                raise ValueError(f"req_to_token write past the context length {self.context_len}: a sequence of "
                                 f"{int((starts + lens).max())} tokens")
        offsets = np.cumsum(lens) - lens
        return np.repeat(rows * self.context_len + starts - offsets, lens) + np.arange(int(lens.sum()))

    def write(self, flat_index: torch.Tensor, slots: torch.Tensor) -> None:
        """table.flat[flat_index] = slots, both on the table's device (one scatter for the whole step)."""
        self.table.view(-1)[flat_index] = slots


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
