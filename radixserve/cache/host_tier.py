"""The host-memory KV tier (--hicache-size): prefixes evicted from the device pool are kept in host memory and
copied back on a later hit instead of being computed again (SGLang's hierarchical cache, one level).

The tier is a second radix tree, over host slots (a TokenSlotAllocator sized to the host buffers in tokens), keyed
by the same tokens and namespaces as the device tree. A prefix is on the device (in the device tree), on the host
(in this tree), or both. The scheduler decides every copy; the workers only carry them out
(radixserve/worker/kv_cache.py HostKVCache):

- save: the device tree calls `save` (its evict_hook) for each leaf it evicts, before the leaf's slots are freed.
  The part of the leaf's path that this tree does not hold yet is given host slots and queued as a device -> host
  copy. Eviction goes leaf first, so a prompt shared by many leaves is copied with the first of them and found
  here for the others.
- load: at admission `load` is asked whether this tree holds more of a prompt than the device tree does; if so, by
  at least `min_load_tokens`, device slots are allocated for the extra tokens, a host -> device copy is queued, and
  the tokens go into the device tree, so that the request's prefill starts after them.

The copies queued during one step ride on the next ForwardBatch (`attach_copies`), and every rank runs that
batch's saves, then its loads, then its forward, in order on one stream. That order is what makes this correct
without any waiting in the scheduler:
- a device slot freed by an eviction may be handed out again in the same step (a load's target, a new token of the
  forward): its save runs first and reads the old KV before anything writes there;
- a host slot freed by this tree's own eviction may take a second save in the same step: the copies are
  deduplicated so that the last one queued wins (`_last_writes`); a load queued this step may read a node saved
  this step: saves run first, so the data is there;
- a host slot that a queued load reads must not be overwritten before the load runs: the loaded host node stays
  locked here until its batch is built (`attach_copies`); a save in a later batch runs after the load on the stream.
- with the overlapped loop, step N+1 is built (and its slots evicted and reused) while step N runs: N+1's copies run
  after N's forward on the same stream, so a slot N still reads is overwritten only after N is done, and a prefix
  that N computes (inserted into the device tree at launch) is saved only after N has written it.

Accounting: host slots are their own pool, beside the device pool. Device slots of a load are allocated from the
device pool and inserted into the device tree at once (cached, never owned), so the device invariant
free + cached + owned == total is untouched; this tier checks its own, free + cached on host == host capacity
(`check_invariant`).
"""

from __future__ import annotations

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.tree_node import MatchResult

# Below this many extra tokens, computing them is about as cheap as copying them in (one more batched chunk).
MIN_LOAD_TOKENS = 32

_EMPTY = np.zeros(0, dtype=np.int32)


class HostTier:
    def __init__(
        self,
        device_tree: RadixCache,
        device_allocator: TokenSlotAllocator,
        capacity_tokens: int,
        min_load_tokens: int = MIN_LOAD_TOKENS,
        disable: bool = False,
    ):
        self.device_tree = device_tree
        self.device_allocator = device_allocator
        self.allocator = TokenSlotAllocator(capacity_tokens)
        # The host copy of evicted prefixes, LRU (disabled: a pool that keeps nothing, for layer-wise offload alone).
        self.tree = RadixCache(self.allocator, disable=disable)
        self.min_load_tokens = max(1, min_load_tokens)
        self.hits = 0  # prefix hits served by a host -> device copy
        self.loaded_tokens = 0
        self.saved_tokens = 0
        # Copies queued since the last batch was built, in order: (source slots, destination slots).
        self._saves: list[tuple[np.ndarray, np.ndarray]] = []
        self._loads: list[tuple[np.ndarray, np.ndarray]] = []
        self._locked_for_loads = []  # host nodes read by queued loads
        device_tree.evict_hook = self.save

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_total

    @property
    def size_tokens(self) -> int:
        return self.tree.total_size()

    # ---------------------------------------------------------------- device -> host

    def save(self, path_tokens, slots, namespace: str | None = None) -> None:
        """The device tree is evicting the leaf that ends path_tokens (its own KV in `slots`, still allocated):
        queue a copy of what this tree lacks of the path."""
        path_tokens = np.asarray(path_tokens, dtype=np.int32)
        slots = np.asarray(slots, dtype=np.int32)
        held = self.tree.match_prefix(path_tokens, namespace=namespace)
        have = len(held.slots)
        if have >= len(path_tokens):
            return
        leaf_start = len(path_tokens) - len(slots)
        if have >= leaf_start:
            source = slots[have - leaf_start :]
        else:  # the leaf's ancestors are missing here too: they are still in the device tree
            above = self.device_tree.peek_slots(path_tokens[:leaf_start], namespace)
            source = np.concatenate([above[have:], slots])
        host_slots = self._alloc_host(len(source), held)
        if host_slots is None:
            return
        # A full host keeps what fits: a shorter prefix of the path is still a valid prefix.
        source = source[: len(host_slots)]
        self._saves.append((source, host_slots))
        self.tree.insert(
            path_tokens[: have + len(host_slots)], np.concatenate([held.slots, host_slots]), namespace=namespace
        )
        self.saved_tokens += len(host_slots)

    def _alloc_host(self, n: int, held: MatchResult) -> np.ndarray | None:
        """Up to n host slots, evicting least recently used host leaves for them (never the path being extended)."""
        self.tree.inc_lock_ref(held.last_node)
        try:
            short = n - self.allocator.num_free
            if short > 0:
                self.tree.evict(short)
        finally:
            self.tree.dec_lock_ref(held.last_node)
        n = min(n, self.allocator.num_free)
        return self.allocator.alloc(n) if n > 0 else None

    # ---------------------------------------------------------------- host -> device

    def load(
        self, tokens, device_match: MatchResult, namespace: str | None = None, priority: int = 0, reserve: int = 0
    ) -> MatchResult:
        """Admission: if this tree holds a longer prefix of `tokens` than device_match (by min_load_tokens or more),
        copy the difference to new device slots, insert it into the device tree and return the longer device
        match; else device_match. `reserve` device slots already promised to this step stay free."""
        tokens = np.asarray(tokens, dtype=np.int32)
        on_device = len(device_match.slots)
        if len(tokens) - on_device < self.min_load_tokens:
            return device_match
        held = self.tree.match_prefix(tokens, namespace=namespace)
        extra = len(held.slots) - on_device
        if extra < self.min_load_tokens:
            return device_match
        device_slots = self._alloc_device(extra, reserve, device_match, held)
        if device_slots is None:
            return device_match
        self.tree.inc_lock_ref(held.last_node)  # its host slots must stay unwritten until the load has run
        self._locked_for_loads.append(held.last_node)
        self._loads.append((held.slots[on_device:], device_slots))
        end = on_device + extra
        self.device_tree.insert(
            tokens[:end], np.concatenate([device_match.slots, device_slots]), namespace=namespace, priority=priority
        )
        self.hits += 1
        self.loaded_tokens += extra
        return self.device_tree.match_prefix(tokens, namespace=namespace, priority=priority)

    def _alloc_device(self, n: int, reserve: int, device_match: MatchResult, held: MatchResult) -> np.ndarray | None:
        """n device slots beyond `reserve`, evicting device leaves for them (which saves them here: the prefix being
        loaded is locked meanwhile, on both sides, so neither copy of it goes)."""
        self.device_tree.inc_lock_ref(device_match.last_node)
        self.tree.inc_lock_ref(held.last_node)
        try:
            short = reserve + n - self.device_allocator.num_free
            if short > 0:
                self.device_tree.evict(short)
        finally:
            self.tree.dec_lock_ref(held.last_node)
            self.device_tree.dec_lock_ref(device_match.last_node)
        if self.device_allocator.num_free < reserve + n:
            return None
        return self.device_allocator.alloc(n)

    # ---------------------------------------------------------------- the batch

    def take_copies(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The copies queued since the last call, as (save from device, save to host, load from host, load to
        device) int32 arrays, each destination written once; unlocks the host nodes the loads read."""
        save_src, save_dst = _last_writes(self._saves)
        load_src, load_dst = _last_writes(self._loads)
        self._saves, self._loads = [], []
        for node in self._locked_for_loads:
            self.tree.dec_lock_ref(node)
        self._locked_for_loads = []
        return save_src, save_dst, load_src, load_dst

    def attach_copies(self, batch) -> None:
        """Put the queued copies on the ForwardBatch about to be sent (radixserve/protocol.py ForwardBatch)."""
        save_src, save_dst, load_src, load_dst = self.take_copies()
        batch.host_save_device_slots = save_src.tobytes()
        batch.host_save_host_slots = save_dst.tobytes()
        batch.host_load_host_slots = load_src.tobytes()
        batch.host_load_device_slots = load_dst.tobytes()

    # ---------------------------------------------------------------- reset / checks

    def reset(self, keep_pins: bool = True) -> None:
        """Drop everything held on the host (the /flush_cache path, after the device tree was reset). Queued copies
        are dropped too: their device slots were just freed by the device tree's reset."""
        self._saves, self._loads = [], []
        for node in self._locked_for_loads:
            self.tree.dec_lock_ref(node)
        self._locked_for_loads = []
        self.tree.reset(keep_pins=keep_pins)

    def check_invariant(self, walk_tree: bool = False, owned: int = 0, long_running: bool = False) -> None:
        """Host slots: free + held in this tree + owned by running long requests (layer-wise offload) == capacity
        (separate from the device pool's invariant)."""
        free, held = self.allocator.num_free, self.tree.total_size()
        if free + held + owned != self.capacity_tokens:
            raise AssertionError(
                f"host KV slot leak: free {free} + held {held} + owned by long requests {owned} != "
                f"capacity {self.capacity_tokens}"
            )
        if not self._locked_for_loads and not long_running and self.tree.locked_size:
            raise AssertionError(f"{self.tree.locked_size} host tokens locked with no load queued nor long request")
        if walk_tree:
            self.tree.check_invariants()


def _last_writes(copies: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (source, destination) pairs, keeping only the last copy queued into each destination: a batch's
    copies run as one gather and one scatter, whose order between equal destinations is not defined."""
    if not copies:
        return _EMPTY, _EMPTY
    src = np.concatenate([s for s, _ in copies]).astype(np.int32, copy=False)
    dst = np.concatenate([d for _, d in copies]).astype(np.int32, copy=False)
    _, first_in_reversed = np.unique(dst[::-1], return_index=True)
    if len(first_in_reversed) == len(dst):
        return src, dst
    keep = np.sort(len(dst) - 1 - first_in_reversed)
    return src[keep], dst[keep]
