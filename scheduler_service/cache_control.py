"""Pinned prefixes, the scheduler's side: POST /v1/cache/pin, GET /v1/cache/pins, DELETE /v1/cache/pin/{id} and
--pin-prompts arrive here as PinPrefixRequest / ListPinsRequest / UnpinPrefixRequest (radixserve/protocol.py).

A pin keeps a token sequence in the radix tree (RadixCache.pin: pinned nodes are never evicted) until it is unpinned
or its TTL passes. The tree can only pin tokens it holds, so a prefix that is not cached yet is computed first: an
internal request with the prefix as its prompt and one greedy output token runs through the normal scheduler path
(admission, chunked prefill, the cache_salt's namespace); when it finishes its prompt is in the tree and is pinned
right after that step (should memory pressure have evicted part of it meanwhile, the rest is computed again). Its
outputs never reach the front end.

--max-pinned-tokens bounds the tokens pins hold (each cached token counted once, however many pins share it): a pin
that would go past it is undone and answered with a 409. Without the flag the bound is half the KV pool, so that
pins never take the room running requests need; 0 turns pinning off.

With --enable-layerwise-offload a prefix longer than the device pool is computed by the long path and lives in the
host tier's tree (scheduler_service/long_context.py): it is pinned there, against a bound of its own (half the host
pool unless --max-pinned-tokens is given), and never evicted from host memory while pinned.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from radixserve.protocol import ListPinsRequest, PinEntry, PinPrefixRequest, PinsReply, UnpinPrefixRequest, unpack_i32
from radixserve.sampling import SamplingParams
from scheduler_service.request import Req
from scheduler_service.step_output import StepOutput

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # computations of one prefix before giving up (each time, pressure evicted it before the pin)
INTERNAL_RID_PREFIX = "compute-pin-"  # front-end rids are hex or "<route>-<hex>-<index>": never this


@dataclass
class _PendingPin:
    request_id: str  # the PinPrefixRequest to answer
    tokens: np.ndarray
    cache_salt: str | None
    ttl_seconds: float | None
    attempts: int = 0  # internal requests run for it so far


def pin_entry(info) -> PinEntry:
    """The socket form of a RadixCache PinInfo."""
    return PinEntry(
        info.id,
        info.namespace,
        int(info.num_tokens),
        float(info.created_at),
        None if info.expires_at is None else float(info.expires_at),
    )


class CacheControl:
    """Pins for one scheduler: answers the pin messages, computes missing prefixes, expires TTLs."""

    def __init__(self, scheduler, max_pinned_tokens: int | None):
        self.scheduler = scheduler
        self.tree = scheduler.tree
        total = scheduler.slot_allocator.num_total
        self.max_pinned_tokens = total // 2 if max_pinned_tokens is None else max_pinned_tokens
        # Layer-wise offload: documents longer than the device pool are pinned in the host tier's tree.
        self.host_tree = scheduler.host_tier.tree if scheduler.long is not None else None
        if self.host_tree is not None:
            host = scheduler.host_tier.capacity_tokens
            self.max_host_pinned_tokens = host // 2 if max_pinned_tokens is None else max_pinned_tokens
        self._pending: dict[str, _PendingPin] = {}  # internal rid -> the pin to make when it finishes

    # ------------------------------------------------------------------ requests
    def handle(self, message) -> PinsReply | None:
        """The reply to a pin message; None while a prefix is being computed (take_outputs() answers it later)."""
        if isinstance(message, PinPrefixRequest):
            return self._pin(message)
        if isinstance(message, UnpinPrefixRequest):
            for tree in self._trees():
                pins = {p.id: p for p in tree.list_pins()}
                if message.pin_id in pins and tree.unpin(message.pin_id):
                    return self._reply(message.request_id, 200, pins=[pin_entry(pins[message.pin_id])])
            return self._reply(message.request_id, 404, f"no pin with id {message.pin_id!r}")
        if isinstance(message, ListPinsRequest):
            return self._reply(
                message.request_id, 200, pins=[pin_entry(p) for tree in self._trees() for p in tree.list_pins()]
            )
        raise TypeError(f"not a pin message: {type(message).__name__}")

    def _pin(self, message: PinPrefixRequest) -> PinsReply | None:
        tokens = unpack_i32(message.input_ids).copy()
        if len(tokens) == 0:
            return self._reply(message.request_id, 400, "nothing to pin: the prompt is empty")
        if self.tree.disable:
            return self._reply(
                message.request_id, 400, "the radix cache is off (--disable-radix-cache): there is nothing to pin"
            )
        bound = self._where(tokens)[1]
        if len(tokens) > bound:
            return self._reply(message.request_id, 409, self._over_bound(len(tokens), bound=bound))
        pending = _PendingPin(message.request_id, tokens, message.cache_salt, message.ttl_seconds)
        reply = self._pin_cached(pending)  # None unless the whole prompt is cached already
        return reply if reply is not None else self._compute(pending)

    def _compute(self, pending: _PendingPin) -> PinsReply | None:
        """Queue the internal request that computes the prefix: one greedy token, so that the whole prompt's KV
        goes into the tree when it finishes."""
        pending.attempts += 1
        if pending.attempts > MAX_ATTEMPTS:
            return self._reply(
                pending.request_id,
                503,
                "the prefix kept being evicted before it could be pinned "
                "(the KV cache is under pressure); try again later",
            )
        req = Req(
            f"{INTERNAL_RID_PREFIX}{uuid.uuid4().hex}",
            pending.tokens,
            SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        req.cache_salt = pending.cache_salt
        try:
            self.scheduler.add_request(req)
        except ValueError as e:
            return self._reply(pending.request_id, 400, f"cannot compute the prefix to pin: {e}")
        self._pending[req.rid] = pending
        return None

    def _pin_cached(self, pending: _PendingPin) -> PinsReply | None:
        """Pin tokens the tree holds; None if it no longer holds them all."""
        tree, bound = self._where(pending.tokens)
        try:
            info = tree.pin(pending.tokens, namespace=pending.cache_salt, ttl_seconds=pending.ttl_seconds)
        except ValueError:
            return None
        if tree.pinned_size > bound:
            pinned = tree.pinned_size
            tree.unpin(info.id)
            return self._reply(pending.request_id, 409, self._over_bound(len(pending.tokens), pinned, bound))
        logger.info(
            "pinned %d tokens as %s (cache_salt=%r, ttl=%s)",
            len(pending.tokens),
            info.id,
            pending.cache_salt,
            pending.ttl_seconds,
        )
        return self._reply(pending.request_id, 200, pins=[pin_entry(info)])

    def _where(self, tokens) -> tuple:
        """The tree that holds (or will hold) this prefix and its bound on pinned tokens: the host tier's for one the
        layer-wise offload path computes (its internal request, one token more, exceeds the device pool)."""
        if self.host_tree is not None and len(tokens) + 1 > self.scheduler.slot_allocator.num_total:
            return self.host_tree, self.max_host_pinned_tokens
        return self.tree, self.max_pinned_tokens

    def _trees(self) -> list:
        return [self.tree] if self.host_tree is None else [self.tree, self.host_tree]

    def _over_bound(self, num_tokens: int, pinned_after: int | None = None, bound: int | None = None) -> str:
        if self.max_pinned_tokens == 0:
            return "pinning is turned off on this server (--max-pinned-tokens 0)"
        after = f" would make {pinned_after} tokens pinned" if pinned_after is not None else ""
        limit = self.max_pinned_tokens if bound is None else bound
        return (
            f"pinning these {num_tokens} tokens{after}, more than this server's limit of "
            f"{limit} pinned tokens (--max-pinned-tokens); unpin something first"
        )

    def _reply(self, request_id: str, status: int, message: str = "", pins: list[PinEntry] = ()) -> PinsReply:
        return PinsReply(request_id, status, message, list(pins), sum(int(t.pinned_size) for t in self._trees()))

    # ------------------------------------------------------------------ the scheduler loop
    def take_outputs(self, outputs: list[StepOutput]) -> tuple[list[StepOutput], list[PinsReply]]:
        """Split a step's outputs: the front end's, and the replies to pins whose prefix just finished computing
        (pinned here, before the next step can evict anything)."""
        if not self._pending:
            return outputs, []
        kept, replies = [], []
        for out in outputs:
            pending = self._pending.get(out.req.rid)
            if pending is None:
                kept.append(out)
                continue
            if not out.finished:
                continue
            del self._pending[out.req.rid]
            if out.req.finish_reason in ("stop", "length"):
                # Its KV went into the tree as it finished. Memory pressure may have evicted part of it since (the
                # overlapped loop can schedule once between the finish and here): then compute the rest again.
                reply = self._pin_cached(pending)
                if reply is None:
                    reply = self._compute(pending)
                if reply is not None:
                    replies.append(reply)
            else:
                why = out.req.error or f"it ended with {out.req.finish_reason}"
                replies.append(self._reply(pending.request_id, 400, f"could not compute the prefix to pin: {why}"))
        return kept, replies

    def expire(self, now: float | None = None) -> list[str]:
        """Drop pins whose TTL has passed; cheap enough to call on every loop iteration."""
        now = time.time() if now is None else now
        expired = [p for tree in self._trees() for p in tree.expire_pins(now)]  # a look at a heap's top when none due
        if expired:
            logger.info("pins expired: %s", ", ".join(expired))
        return expired
