"""A bounded, content-keyed cache of token ids: the ids of each piece of a rendered chat prompt, so that a system
prompt (or an earlier turn) seen before costs a hash lookup instead of an encode (chat_segments.py uses it).

Keys are (namespace, text). The namespace is the request's cache_salt: a tenant never hits a piece that only another
tenant sent, so the time a request takes to tokenize says nothing about other tenants' prompts (the same rule as the
radix cache's salted roots). The cache holds nothing else per tenant.

Values are tuples of ints taken from one shared table of every id (`int_table`): a tuple of shared int objects costs
8 bytes a token, where fresh ints from the tokenizer would cost 36, and a tuple extends a list ~10x faster than an
array does (the hit path is one `list.extend`). Least recently used pieces go first once the entries' estimated bytes
pass the budget; a piece larger than the whole budget is not kept.

A piece is encoded once even when many requests bring it at the same moment (a burst of users of a new system
prompt): the first to miss claims it, the others wait for its ids (`claim` hands them a Future) instead of encoding it
too. A claimer encodes its own claims before it waits on anyone else's, so no two requests ever wait on each other.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future

ENTRY_OVERHEAD_BYTES = 160  # the OrderedDict node, the key tuple and the value tuple's header, roughly


class SegmentCache:
    def __init__(self, budget_bytes: int, int_table: tuple[int, ...]):
        self.budget_bytes = budget_bytes
        self._ints = int_table
        self._entries: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()
        self._pending: dict[tuple[str | None, str], Future] = {}  # claimed pieces being encoded
        self._lock = threading.Lock()  # the tokenizer pool's threads share one cache
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _cost(text: str, ids: tuple[int, ...]) -> int:
        return sys.getsizeof(text) + 8 * len(ids) + ENTRY_OVERHEAD_BYTES

    def claim(self, namespace: str | None, text: str) -> tuple[int, ...] | Future | None:
        """The piece's ids if cached; a Future of them if another request is encoding it; None if the caller is
        now the one to encode it, and must `put` its ids (or `abandon` it)."""
        key = (namespace, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return ids
            pending = self._pending.get(key)
            if pending is not None:
                self.hits += 1
                return pending
            self._pending[key] = Future()
            self.misses += 1
            return None

    def lookup(self, namespace: str | None, text: str) -> tuple[int, ...] | None:
        """The piece's ids if cached (a hit), else None, claiming nothing: the event loop's path looks before it
        decides whether to encode here or hand the prompt to the pool."""
        key = (namespace, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return ids

    def abandon(self, namespace: str | None, texts: list[str], error: BaseException) -> None:
        """The claimed pieces could not be encoded: whoever waits for them gets the error."""
        with self._lock:
            pending = [self._pending.pop((namespace, text), None) for text in texts]
        for future in pending:
            if future is not None:
                future.set_exception(error)

    def put(self, namespace: str | None, text: str, ids: list[int]) -> tuple[int, ...]:
        """Keep `ids` for `text` (when it fits) and hand them to whoever waits for them; returns them as a tuple."""
        table = self._ints
        kept = tuple(map(table.__getitem__, ids)) if ids and max(ids) < len(table) else tuple(ids)
        cost = self._cost(text, kept)
        key = (namespace, text)
        with self._lock:
            pending = self._pending.pop(key, None)
            if cost <= self.budget_bytes:
                old = self._entries.pop(key, None)
                if old is not None:
                    self.bytes -= self._cost(text, old)
                self._entries[key] = kept
                self.bytes += cost
                while self.bytes > self.budget_bytes:
                    (_, old_text), old_ids = self._entries.popitem(last=False)
                    self.bytes -= self._cost(old_text, old_ids)
                    self.evictions += 1
        if pending is not None:
            pending.set_result(kept)
        return kept
