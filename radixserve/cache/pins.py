"""Pins: prefixes an operator keeps in the radix tree (system prompts), each until unpinned or its TTL runs out.

This file keeps the register of pins and their deadlines; the references that stop eviction live on the tree's
nodes (RadixCache.pin, which walks the path and counts one pin_ref per node).
"""

from __future__ import annotations

import heapq
import secrets
import time
from typing import NamedTuple


class PinInfo(NamedTuple):
    id: str
    namespace: str | None  # the cache_salt the pinned prefix lives under; None for the shared cache
    num_tokens: int
    created_at: float  # time.time()
    expires_at: float | None  # None: until unpinned


class PinRegistry:
    """Pins by id, each with the tree node its path ends at, plus a min-heap of deadlines. Unpinning leaves the
    pin's deadline in the heap; it is skipped when it comes due."""

    def __init__(self):
        self._pins: dict[str, tuple[PinInfo, object]] = {}
        self._deadlines: list[tuple[float, str]] = []

    def add(self, node, namespace: str | None, num_tokens: int, ttl_seconds: float | None) -> PinInfo:
        now = time.time()
        expires_at = None if ttl_seconds is None else now + ttl_seconds
        # Unguessable ids: a pin is dropped by id, and tenants should not drop each other's.
        info = PinInfo(f"pin-{secrets.token_hex(8)}", namespace, num_tokens, now, expires_at)
        self._pins[info.id] = (info, node)
        if expires_at is not None:
            heapq.heappush(self._deadlines, (expires_at, info.id))
        return info

    def pop(self, pin_id: str):
        """Forget a pin; returns the node it ended at, or None if there is no such pin."""
        entry = self._pins.pop(pin_id, None)
        return None if entry is None else entry[1]

    def due(self, now: float) -> list[str]:
        """Ids of the registered pins whose deadline is <= now (they stay registered until popped)."""
        ids = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, pin_id = heapq.heappop(self._deadlines)
            if pin_id in self._pins:
                ids.append(pin_id)
        return ids

    def infos(self) -> list[PinInfo]:
        return sorted((info for info, _ in self._pins.values()), key=lambda p: (p.created_at, p.id))

    def entries(self):
        """(info, node where the pin ends) per pin."""
        return self._pins.values()

    def clear(self) -> None:
        self._pins.clear()
        self._deadlines.clear()
