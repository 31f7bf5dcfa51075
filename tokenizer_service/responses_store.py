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

The entries live in sqlite (the standard library's), as msgpack: in memory with one front end; with several
(--api-server-count) in one file of the server's private run directory that every front end opens, since a follow-up
may land on another process than its previous turn. Their ages are CLOCK_MONOTONIC readings, one clock for every
process of the machine. A write to the shared file can wait a moment for another front end's write, so the routes
call the store through run(), which takes it off the event loop then.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

RESPONSES_DB = "responses.sqlite"  # with several front ends, in the server's private run directory
BUSY_TIMEOUT_S = 5.0  # the longest a write waits for another front end's (each takes well under a millisecond)


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
    def __init__(self, max_per_owner: int, ttl_s: float, clock=time.monotonic, path: str = ":memory:"):
        self.max_per_owner, self.ttl_s, self.clock, self.path = max_per_owner, ttl_s, clock, path
        # One connection, used by one thread at a time (the lock): the event loop's, or a worker thread of run().
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        if path != ":memory:":
            # Readers never wait for a writer; the file goes with the server, so nothing is synced to disk.
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=OFF")
        # seq orders an owner's entries by age (the oldest go first past max_per_owner).
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
            " owner TEXT NOT NULL, cache_salt TEXT, created REAL NOT NULL, entry BLOB NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_owner ON responses (owner, seq)")
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created)")
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(StoredResponse).decode

    async def run(self, method, *args):
        """method(*args): at once in memory (nothing to wait for), in a thread with a file other front ends write."""
        if self.path == ":memory:":
            return method(*args)
        return await asyncio.to_thread(method, *args)

    def __len__(self) -> int:
        with self._lock:
            (count,) = self._db.execute(
                "SELECT COUNT(*) FROM responses WHERE created > ?", (self.clock() - self.ttl_s,)
            ).fetchone()
        return count

    def put(self, entry: StoredResponse) -> None:
        if self.max_per_owner == 0:
            return
        entry.created = self.clock()
        with self._lock, self._db:  # one transaction: the bounds hold whenever another front end reads
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM responses WHERE created <= ?", (entry.created - self.ttl_s,))
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, owner, cache_salt, created, entry) VALUES (?, ?, ?, ?, ?)",
                (entry.id, entry.owner, entry.cache_salt, entry.created, self._encode(entry)),
            )
            self._db.execute(
                "DELETE FROM responses WHERE owner = ? AND seq <= (SELECT seq FROM responses WHERE owner = ?"
                " ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (entry.owner, entry.owner, self.max_per_owner),
            )

    def get(self, owner: str, cache_salt: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT entry FROM responses WHERE id = ? AND owner = ? AND cache_salt IS ? AND created > ?",
                (response_id, owner, cache_salt, self.clock() - self.ttl_s),
            ).fetchone()
        return None if row is None else self._decode(row[0])

    def delete(self, owner: str, cache_salt: str | None, response_id: str) -> bool:
        with self._lock:
            deleted = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? AND cache_salt IS ? AND created > ?",
                (response_id, owner, cache_salt, self.clock() - self.ttl_s),
            ).rowcount
        return deleted > 0

    def close(self) -> None:
        self._db.close()
