"""Host-to-device copies of a step's small index arrays through page-locked (pinned) buffers.

A copy from ordinary (pageable) host memory is not really asynchronous: CUDA stages it and, in practice, waits for the
stream to reach it. Every step copies a handful of arrays (positions, slots, group tables), so the worker waited for
the previous step's forward before it could queue the next one, and the device idled while the host prepared it
(H100 profile at batch 1: 8 copies a step, 140 us each). From pinned memory the copy is queued and the call returns.

Buffers are reused round-robin; each remembers the event recorded after its last copy, and is written again only once
that copy has run. With `depth` buffers and a few copies a step, that event belongs to a step already finished, so the
wait costs nothing. On the CPU device (and with --disable-pinned-staging) arrays go through torch.from_numpy as before.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, device: torch.device, enabled: bool = True, buffer_bytes: int = 4 << 20, depth: int = 16):
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.buffer_bytes = buffer_bytes
        self._buffers = (
            [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
            if self.enabled
            else []
        )
        # One event per buffer, recorded again at each copy out of it: creating one costs ~13 us of host time on the
        # H100 machine, a step's critical path when nothing overlaps it (a lone request's first token). An event not
        # recorded yet (a buffer never used) synchronizes at once.
        self._events = [torch.cuda.Event() for _ in self._buffers]
        self._next = 0
        self._last = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """The array on the device (same dtype); queued, not waited for."""
        array = np.ascontiguousarray(array)
        if not self.enabled or array.nbytes > self.buffer_bytes or array.nbytes == 0:
            return torch.from_numpy(array).to(self.device, non_blocking=True)
        staged = self._stage(array)
        out = staged.view(torch.from_numpy(array[:0]).dtype).to(self.device, non_blocking=True)
        self._record()
        return out.view(array.shape)

    def to_device_packed(self, ints: list[np.ndarray], longs: list[np.ndarray]) -> tuple[list, list]:
        """Small host arrays, int32 and int64, on the device in one host-to-device copy (each copy costs a launch
        and ~20 us of host time): views of one byte block, int64 parts first."""
        # Every part starts 16-byte aligned: Triton compiles a kernel variant per alignment of each pointer argument,
        # and parts at offsets that follow the batch size made new variants (and a compile mid-serving) appear as the
        # batch size changed.
        arrays = [np.asarray(a, dtype=np.int64) for a in longs] + [np.asarray(a, dtype=np.int32) for a in ints]
        sizes = [-(-a.nbytes // 16) * 16 for a in arrays]
        offsets = np.cumsum([0] + sizes[:-1]).tolist()
        block = np.zeros(sum(sizes), dtype=np.uint8)
        for offset, a in zip(offsets, arrays):
            block[offset : offset + a.nbytes] = a.view(np.uint8)
        device = self.to_device(block)
        parts = [
            device[o : o + a.nbytes].view(torch.int64 if a.itemsize == 8 else torch.int32)
            for o, a in zip(offsets, arrays)
        ]
        return parts[len(longs) :], parts[: len(longs)]

    def copy_into(self, target: torch.Tensor, array: np.ndarray) -> None:
        """target (a contiguous device tensor of the array's bytes, e.g. a CUDA graph's static inputs) = array;
        queued, not waited for."""
        array = np.ascontiguousarray(array)
        source = torch.from_numpy(array)
        if self.enabled and 0 < array.nbytes <= self.buffer_bytes:
            source = self._stage(array).view(source.dtype).view(source.shape)
        target.view(source.dtype).view(source.shape).copy_(source, non_blocking=True)
        if self.enabled:
            self._record()

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """The array's bytes in the next pinned buffer, once the last copy out of that buffer has run."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        self._events[i].synchronize()  # the previous copy out of this buffer has run
        self._last = i
        staged = self._buffers[i][: array.nbytes]
        staged.numpy()[:] = array.view(np.uint8).reshape(-1)
        return staged

    def _record(self) -> None:
        self._events[self._last].record()
