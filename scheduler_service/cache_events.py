"""A data-parallel replica's scheduler reports every change to its radix tree (RadixCache.listener) so that the DP
controller's mirror of the tree (scheduler_service/dp_router.py) holds exactly the prefixes cached here. Events are
collected during a step and sent once after it, in order."""

from __future__ import annotations

import numpy as np

from radixserve.protocol import CacheCleared, CacheEvents, CacheEvicted, CacheInserted, pack_i32


class CacheEventLog:
    def __init__(self):
        self.events: list[CacheInserted | CacheEvicted | CacheCleared] = []

    # RadixCache.listener. The mirror routes requests of the shared cache only: salted namespaces are not its concern.
    def inserted(self, tokens: np.ndarray, namespace: str | None) -> None:
        if namespace is None:
            self.events.append(CacheInserted(pack_i32(tokens)))

    def evicted(self, path: np.ndarray, key: np.ndarray, namespace: str | None) -> None:
        if namespace is None:
            self.events.append(CacheEvicted(pack_i32(path), pack_i32(key)))

    def cleared(self) -> None:
        self.events = [CacheCleared()]  # what came before no longer matters

    def take(self) -> CacheEvents | None:
        """The events since the last take(), as one message; None if there were none."""
        if not self.events:
            return None
        message, self.events = CacheEvents(self.events), []
        return message
