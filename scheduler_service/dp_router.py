"""Which data-parallel replica gets a request (--load-balance-method).

cache_aware routes by the longest prefix of the prompt that a replica has cached or is about to: each replica has a
mirror of its radix tree, kept exact by the tree's own insert/evict events (CacheEvents), plus the prompts routed to
it that are still running (their prefill will be cached by the time a follower is scheduled). Unlike an external
router, which guesses from the text it has sent, this is what the replica holds. When the loads drift apart (more
than BALANCE_ABS requests in flight between the busiest and the idlest replica, and the busiest has more than
BALANCE_REL times the idlest), or no replica holds any of the prompt, the least loaded replica gets it: a cache hit is
not worth a queue. round_robin and shortest_queue (fewest requests in flight) ignore the caches."""

from __future__ import annotations

import itertools

import numpy as np

from radixserve.protocol import CacheCleared, CacheEvents, CacheEvicted, CacheInserted, unpack_i32

# The thresholds sglang-router uses by default for the same decision (balance_abs_threshold, balance_rel_threshold).
BALANCE_ABS = 32
BALANCE_REL = 1.0001


class TokenTrie:
    """Token sequences, one node per token, each node counting the sequences through it (a sequence inserted twice
    counts twice, and one remove() undoes one insert())."""

    def __init__(self):
        self.root: dict = {}  # token -> [count, children]

    def insert(self, tokens) -> None:
        children = self.root
        for token in tokens.tolist() if isinstance(tokens, np.ndarray) else tokens:
            entry = children.get(token)
            if entry is None:
                entry = children[token] = [0, {}]
            entry[0] += 1
            children = entry[1]

    def remove(self, tokens) -> None:
        children = self.root
        for token in tokens.tolist() if isinstance(tokens, np.ndarray) else tokens:
            entry = children.get(token)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] <= 0:
                del children[token]
                return
            children = entry[1]

    def cut(self, path, first_token: int) -> None:
        """Drop the branch that continues path with first_token (an evicted leaf)."""
        children = self.root
        for token in path.tolist():
            entry = children.get(token)
            if entry is None:
                return
            children = entry[1]
        children.pop(first_token, None)

    def match_len(self, tokens) -> int:
        children, n = self.root, 0
        for token in tokens:
            entry = children.get(token)
            if entry is None:
                break
            children, n = entry[1], n + 1
        return n


class Replica:
    def __init__(self):
        # What the tree holds is a set: inserting a cached sequence again changes nothing, so the mirror only ever
        # gets a sequence's new part (count 1 everywhere) and evictions cut whole branches.
        self.cached = TokenTrie()
        self.in_flight = TokenTrie()
        self.running: dict[str, np.ndarray] = {}  # rid -> prompt

    def apply(self, message: CacheEvents) -> None:
        for event in message.events:
            if isinstance(event, CacheInserted):
                tokens = unpack_i32(event.tokens)
                known = self.cached.match_len(tokens.tolist())
                if known < len(tokens):
                    self._add(tokens, known)
            elif isinstance(event, CacheEvicted):
                key = unpack_i32(event.key)
                self.cached.cut(unpack_i32(event.path), int(key[0]))
            elif isinstance(event, CacheCleared):
                self.cached = TokenTrie()

    def _add(self, tokens: np.ndarray, known: int) -> None:
        children = self.cached.root
        for token in tokens[:known].tolist():
            children = children[token][1]
        for token in tokens[known:].tolist():
            entry = children[token] = [1, {}]
            children = entry[1]

    def match_len(self, prompt: list[int]) -> int:
        return max(self.cached.match_len(prompt), self.in_flight.match_len(prompt))

    @property
    def load(self) -> int:
        return len(self.running)


class DataParallelRouter:
    def __init__(self, dp_size: int, method: str):
        if method not in ("cache_aware", "round_robin", "shortest_queue"):
            raise ValueError(f"unknown --load-balance-method {method!r}")
        self.method = method
        self.replicas = [Replica() for _ in range(dp_size)]
        self._next = itertools.cycle(range(dp_size))
        self.owner: dict[str, int] = {}  # rid -> replica, while it runs

    def route(self, rid: str, prompt: np.ndarray, forced: int | None = None) -> int:
        """The replica for a new request (forced: the one an outside router chose, when in range); it counts as
        running there until finished(rid)."""
        i = forced if forced is not None and 0 <= forced < len(self.replicas) else self._choose(prompt)
        replica = self.replicas[i]
        replica.running[rid] = prompt
        replica.in_flight.insert(prompt)
        self.owner[rid] = i
        return i

    def finished(self, rid: str) -> None:
        i = self.owner.pop(rid, None)
        if i is not None:
            self.replicas[i].in_flight.remove(self.replicas[i].running.pop(rid))

    def _least_loaded(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: self.replicas[i].load)

    def _choose(self, prompt: np.ndarray) -> int:
        if self.method == "round_robin":
            return next(self._next)
        if self.method == "shortest_queue":
            return self._least_loaded()
        loads = [r.load for r in self.replicas]
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            return self._least_loaded()
        tokens = prompt.tolist()
        matches = [r.match_len(tokens) for r in self.replicas]
        best = max(matches)
        if best == 0:
            return self._least_loaded()
        # Among equal matches, the least loaded.
        return min((i for i, m in enumerate(matches) if m == best), key=lambda i: loads[i])
