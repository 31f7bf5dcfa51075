"""The radix tree's KV block events (scheduler_service/kv_events.py), one stream per data-parallel replica, handed to
Dynamo's KvEventPublisher of that replica's dp_rank, which sends them on Dynamo's event plane to every KV router.

Dynamo makes the publishers (PushSource) after the engine has started, so events that come before a replica's
publisher is ready wait here, in order. The publisher numbers events itself; a batch keeps one step's in order.
"""

from __future__ import annotations

import threading
from functools import partial

from radixserve.protocol import KvBlockEvents, KvBlocksStored, unpack_i32


class KvEventRelay:
    def __init__(self, block_size: int, dp_size: int):
        self.block_size = block_size
        self.dp_size = dp_size
        self.publishers: dict[int, object] = {}
        self.pending: dict[int, list[KvBlockEvents]] = {rank: [] for rank in range(dp_size)}
        self.lock = threading.Lock()  # Dynamo may hand a publisher over from its own thread: keep each rank in order

    def sources(self) -> list:
        """One PushSource per replica (LLMEngine.kv_event_sources)."""
        from dynamo.common.backend.publisher import PushSource

        return [PushSource(on_ready=partial(self._ready, rank), dp_rank=rank) for rank in range(self.dp_size)]

    def _ready(self, rank: int, publisher) -> None:
        with self.lock:
            for message in self.pending.pop(rank, []):
                publisher.publish_batch([self._event(e) for e in message.events])
            self.publishers[rank] = publisher

    def publish(self, message: KvBlockEvents) -> None:
        with self.lock:
            publisher = self.publishers.get(message.dp_rank)
            if publisher is None:
                self.pending.setdefault(message.dp_rank, []).append(message)
                return
            publisher.publish_batch([self._event(e) for e in message.events])

    def _event(self, event) -> dict:
        if not isinstance(event, KvBlocksStored):
            return {"type": "removed", "block_hashes": event.block_hashes}
        return {
            "type": "stored",
            "token_ids": unpack_i32(event.token_ids).tolist(),
            "num_block_tokens": [self.block_size] * len(event.block_hashes),
            "block_hashes": event.block_hashes,
            "parent_hash": event.parent_hash,
            "cache_salt": event.cache_salt,
        }

    def close(self) -> None:
        with self.lock:
            self.publishers.clear()
