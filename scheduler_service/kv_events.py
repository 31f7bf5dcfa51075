"""The radix tree as KV block events, for an outside router that routes on exact overlap (NVIDIA Dynamo's KV router;
python -m radixserve.dynamo, which turns this on with --kv-events-block-size).

Such a router thinks in fixed-size blocks chained by parent: block k of a cached sequence is its tokens
[k*B, (k+1)*B), and only full blocks count. The tree is token-granular (page size 1), but what it holds is
prefix-closed, so its block view is exact and cheap to keep in step: block k of a sequence is cached exactly when the
tree holds at least (k+1)*B tokens of it. Hence an insert of tokens[0:n] that found `c` of them cached adds blocks
[c // B, n // B), and an evicted leaf with key K under the path P removes blocks [len(P) // B, (len(P) + len(K)) // B)
(each holds at least one token of K, and a leaf's first token is its alone among its siblings').

A block's hash covers the cache_salt and every token from the root to its end (one running blake2b, a copy per
block), so hashes of different namespaces never collide and a block's hash also names its whole prefix. The set of
live hashes is kept to answer a flush, which the router hears as the removal of every block; the pinned paths the
tree keeps come back right after it as inserts (RadixCache.reset)."""

from __future__ import annotations

import hashlib

import numpy as np

from radixserve.protocol import KvBlockEvents, KvBlocksRemoved, KvBlocksStored, pack_i32


def block_hashes(tokens: np.ndarray, block_size: int, namespace: str | None) -> list[int]:
    """Signed 64-bit hashes of the full blocks of tokens (Dynamo's wire type), each of its whole prefix."""
    data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    running = hashlib.blake2b(digest_size=8)
    if namespace is not None:
        # Length-prefixed, so that no salt followed by tokens can read as another salt followed by other tokens.
        salt = namespace.encode()
        running.update(len(salt).to_bytes(4, "little") + salt)
    step = 4 * block_size
    hashes = []
    for end in range(step, len(data) + 1, step):
        running.update(data[end - step : end])
        hashes.append(int.from_bytes(running.copy().digest(), "little", signed=True))
    return hashes


class KvBlockLog:
    """A RadixCache listener that turns the tree's changes into KvBlocksStored / KvBlocksRemoved, sent once per step
    (SchedulerProcess._report_cache_events)."""

    def __init__(self, block_size: int, dp_rank: int):
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.live: set[int] = set()
        self.events: list[KvBlocksStored | KvBlocksRemoved] = []

    def inserted(self, tokens: np.ndarray, namespace: str | None) -> None:
        hashes = block_hashes(tokens, self.block_size, namespace)
        # What is live is prefix-closed, so the new blocks are a tail of the sequence's.
        first = len(hashes)
        while first > 0 and hashes[first - 1] not in self.live:
            first -= 1
        if first == len(hashes):
            return
        new = hashes[first:]
        self.live.update(new)
        tokens = tokens[first * self.block_size : len(hashes) * self.block_size]
        self.events.append(KvBlocksStored(new, hashes[first - 1] if first else None, pack_i32(tokens), namespace))

    def evicted(self, path: np.ndarray, key: np.ndarray, namespace: str | None) -> None:
        cut = len(path) // self.block_size
        gone = block_hashes(np.concatenate([path, key]), self.block_size, namespace)[cut:]
        if gone:
            self.live.difference_update(gone)
            self.events.append(KvBlocksRemoved(gone))

    def cleared(self) -> None:
        if self.live:
            self.events.append(KvBlocksRemoved(sorted(self.live)))
            self.live.clear()

    def take(self) -> KvBlockEvents | None:
        """The events since the last take(), as one message; None if there were none."""
        if not self.events:
            return None
        message, self.events = KvBlockEvents(self.dp_rank, self.events), []
        return message


class Listeners:
    """Several RadixCache listeners as one (the DP controller's mirror and the KV block events, with both on)."""

    def __init__(self, *listeners):
        self.listeners = listeners

    def inserted(self, tokens: np.ndarray, namespace: str | None) -> None:
        for listener in self.listeners:
            listener.inserted(tokens, namespace)

    def evicted(self, path: np.ndarray, key: np.ndarray, namespace: str | None) -> None:
        for listener in self.listeners:
            listener.evicted(path, key, namespace)

    def cleared(self) -> None:
        for listener in self.listeners:
            listener.cleared()
