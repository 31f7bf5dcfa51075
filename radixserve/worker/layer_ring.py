"""A ring of GPU buffers, each one layer's K and V for up to `tokens` positions, between the model and the host KV
pool (--enable-layerwise-offload; radixserve/worker/layerwise_offload.py drives it).

Layer i of a job uses buffer i % size. Copies run on a side stream (on the CPU they are plain synchronous copies,
and the same code runs): host -> buffer before the layer computes (a decode's whole context, a prefill's cached
prefix), buffer -> host after it computes (the new tokens' K/V). Two orderings keep this correct without the host
ever waiting:
- every batch of copies first makes the side stream wait for what the compute stream has queued so far, so a copy
  out reads K/V the layer has written, and a load never overwrites a buffer an earlier layer may still read;
- filled[b], an event recorded after buffer b's latest copies, is waited for by the compute stream before the
  buffer is used again, so a buffer is never written while an earlier user's K/V is still being copied out of it
  (the source of a copy stays untouched until the copy's event has passed: the reference design copied
  synchronously because its asynchronous copies read sources that were already reused).
The side stream is in order, so the loads of layer i + size run after layer i's K/V went out of the same buffer.

`owner[b]` names the (job, layer) whose K/V the buffer holds: a job that finds its layer already loaded (prefetched,
or a prefill continuing a layer in a later step) does not load it again."""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import torch


class LayerRing:
    def __init__(
        self, size: int, tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        if size < 2:
            raise ValueError(f"the layer ring needs at least 2 buffers (one computing, one loading), got {size}")
        self.size, self.tokens = size, tokens
        shape = (tokens + 1, num_kv_heads, head_dim)  # row 0: padding, as in the KV pool
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(size)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(size)]
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.filled: list = [None] * size  # side-stream event after the buffer's latest copy
        self.owner: list[Hashable | None] = [None] * size
        self.bytes_loaded = 0
        self.bytes_saved = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def buffer(self, layer: int) -> int:
        return layer % self.size

    # ---------------------------------------------------------------- compute side
    def acquire(self, key: Hashable, layer: int, fill: Callable[[int], None]) -> int:
        """The buffer for `layer`, holding key's K/V (fill(b) loads it unless it already does), ready to compute:
        the compute stream waits for every copy queued on it so far."""
        b = self.buffer(layer)
        if self.owner[b] != key:
            self._fill(b, key, fill)
        if self.cuda and self.filled[b] is not None:
            torch.cuda.current_stream().wait_event(self.filled[b])
        return b

    def prefetch(self, key: Hashable, layer: int, fill: Callable[[int], None]) -> None:
        """Queue the loads of a later layer now, so that they run while the layers before it compute."""
        b = self.buffer(layer)
        if self.owner[b] != key:
            self._fill(b, key, fill)

    # ---------------------------------------------------------------- copies (side stream)
    def _fill(self, b: int, key: Hashable, fill: Callable[[int], None]) -> None:
        self.owner[b] = key
        with self._side(b):
            fill(b)

    def save(
        self,
        b: int,
        rows: list[tuple[int, int]],
        host_k: torch.Tensor,
        host_v: torch.Tensor,
        host_runs: list[tuple[int, int, int]],
    ) -> None:
        """Copy buffer b's K/V out to the host, after what the compute stream queued so far: rows are (first row,
        count) spans of the buffer laid end to end, host_runs (start, end, offset) runs of host slots over them."""
        with self._side(b):
            sources = _spans(rows)
            for start, end, offset in host_runs:
                for src_row, dst, n in _split(sources, offset, end - start, start):
                    host_k[dst : dst + n].copy_(self.k[b][src_row : src_row + n], non_blocking=True)
                    host_v[dst : dst + n].copy_(self.v[b][src_row : src_row + n], non_blocking=True)
                    self.bytes_saved += 2 * n * self.k[b][0].numel() * self.k[b].element_size()

    def load(
        self, b: int, row: int, host_k: torch.Tensor, host_v: torch.Tensor, host_runs: list[tuple[int, int, int]]
    ) -> None:
        """Inside a fill: buffer rows row + offset.. = host slots start..end of each run (on the side stream)."""
        for start, end, offset in host_runs:
            self.k[b][row + offset : row + offset + end - start].copy_(host_k[start:end], non_blocking=True)
            self.v[b][row + offset : row + offset + end - start].copy_(host_v[start:end], non_blocking=True)
            self.bytes_loaded += 2 * (end - start) * self.k[b][0].numel() * self.k[b].element_size()

    def _side(self, b: int):
        """A context on the side stream that first waits for the compute stream's last use of b and records
        filled[b] when it ends; on the CPU, nothing."""
        return _SideStream(self, b)

    def wait_for_copies(self) -> None:
        """The current stream waits for every copy queued so far (before another user of the host pool: the host
        tier's own copies run on the compute stream)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)


class _SideStream:
    def __init__(self, ring: LayerRing, b: int):
        self.ring, self.b = ring, b

    def __enter__(self):
        ring = self.ring
        if ring.cuda:
            # Also after everything the compute stream queued before (a host-tier save into these host slots).
            ring.stream.wait_stream(torch.cuda.current_stream())
            self._context = torch.cuda.stream(ring.stream)
            self._context.__enter__()

    def __exit__(self, *exc):
        ring = self.ring
        if ring.cuda:
            event = torch.cuda.Event()
            event.record(ring.stream)
            ring.filled[self.b] = event
            self._context.__exit__(*exc)


def _spans(rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first row, count, offset) of each span laid end to end."""
    out, offset = [], 0
    for row, n in rows:
        out.append((row, n, offset))
        offset += n
    return out


def _split(spans, offset: int, n: int, dst: int):
    """Pieces (source row, destination, count) covering positions offset..offset+n of the spans laid end to end."""
    for row, count, start in spans:
        lo, hi = max(offset, start), min(offset + n, start + count)
        if lo < hi:
            yield row + lo - start, dst + lo - offset, hi - lo


def host_runs(host_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, offset) of each run of consecutive host slots (kv_cache._runs)."""
    from radixserve.worker.kv_cache import _runs

    return _runs(np.asarray(host_slots))
