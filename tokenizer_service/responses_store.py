"""Stored responses of /v1/responses: what GET /v1/responses/{id} returns, and the conversation that a later
`previous_response_id` goes on with.

Bounded twice: at most --responses-store-size responses per API key (the oldest go first) and none older than
--responses-store-ttl seconds. A response belongs to the API key it was made with (a digest of it: the key itself is
never kept) and to its request's cache_salt; a lookup under another key or another salt finds nothing, exactly as an
unknown id, so one tenant can neither read another's conversation nor learn that it exists.

Each entry keeps its whole conversation (messages, without the instructions, which OpenAI does not carry over) rather
than a link to the previous entry, so a chain of turns survives the eviction of its early turns; and the last turn's
prompt and output token ids, packed, so that the next turn's prompt can start with exactly those tokens and find
them in the radix cache (responses_prompt.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StoredResponse:
    id: str
    owner: str  # digest of the API key ("" without --api-key)
    cache_salt: str | None
    body: dict  # the response object, as POST returned it
    conversation: list[dict]  # chat messages of every turn so far, this response's output included
    prompt_ids: bytes  # int32, the prompt this response was generated from
    output_ids: bytes  # int32, every token generated (a stop token included)
    created: float = field(default_factory=time.monotonic)

    def token_ids(self) -> tuple[list[int], list[int]]:
        return (
            np.frombuffer(self.prompt_ids, dtype=np.int32).tolist(),
            np.frombuffer(self.output_ids, dtype=np.int32).tolist(),
        )


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def owner_of(authorization: str | None, api_key: str | None) -> str:
    """Whose responses a request may see: with --api-key, the key it authenticated with (the middleware has checked
    it); without one there is a single owner, as there is no identity to tell clients apart."""
    if not api_key or not authorization:
        return ""
    return hashlib.sha256(authorization.encode()).hexdigest()


class ResponseStore:
    def __init__(self, max_per_owner: int, ttl_s: float, clock=time.monotonic):
        self.max_per_owner, self.ttl_s, self.clock = max_per_owner, ttl_s, clock
        self._by_owner: dict[str, OrderedDict[str, StoredResponse]] = {}  # oldest first

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_owner.values())

    def _expire(self, owner: str) -> OrderedDict[str, StoredResponse]:
        entries = self._by_owner.get(owner, OrderedDict())
        deadline = self.clock() - self.ttl_s
        while entries and next(iter(entries.values())).created <= deadline:
            entries.popitem(last=False)
        return entries

    def put(self, entry: StoredResponse) -> None:
        if self.max_per_owner == 0:
            return
        entry.created = self.clock()
        entries = self._by_owner.setdefault(entry.owner, self._expire(entry.owner))
        entries[entry.id] = entry
        while len(entries) > self.max_per_owner:
            entries.popitem(last=False)

    def get(self, owner: str, cache_salt: str | None, response_id: str) -> StoredResponse | None:
        entries = self._expire(owner)
        if not entries:
            self._by_owner.pop(owner, None)
        entry = entries.get(response_id)
        return entry if entry is not None and entry.cache_salt == cache_salt else None

    def delete(self, owner: str, cache_salt: str | None, response_id: str) -> bool:
        if self.get(owner, cache_salt, response_id) is None:
            return False
        del self._by_owner[owner][response_id]
        return True
