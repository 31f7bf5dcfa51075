"""Pinned prefixes with --dp-size > 1: the DP controller's side (scheduler_service/dp_controller.py).

Each replica has its own radix tree, and any replica may get a request that starts with a pinned system prompt
(cache_aware routing prefers one that holds it, round_robin and shortest_queue do not look), so a pin is made on
every replica. The controller sends each pin message to all of them and answers the front end once all have
answered:
- a pin succeeds only when every replica pinned: the front end gets one id of the controller's, which stands for
  the replicas' own ids (each tree names its pins itself). If any replica refuses (409 over --max-pinned-tokens, a
  prompt it cannot compute), the replicas that pinned are told to unpin and the front end gets the first refusal;
- a list asks every replica and shows each pin once, with the replicas that still hold it. A pin that no replica
  holds any more (its TTL ran out on each, or /flush_cache?drop_pins=true) leaves the controller's table then;
- an unpin goes to every replica with that replica's id: 200 if any replica still held it, else 404.
TTLs run out on each replica by itself, as without DP. Nothing here touches sockets: the controller sends what the
methods return, which keeps this logic testable on its own (tests/e2e/test_cache_pins_dp.py).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from radixserve.protocol import ListPinsRequest, PinEntry, PinPrefixRequest, PinsReply, UnpinPrefixRequest

UNDO_PREFIX = "undo-pin-"  # request ids of the controller's own unpins; their replies go nowhere
# A pin with a TTL leaves the table this long after its last replica's expiry even if nobody lists the pins.
FORGET_EXPIRED_AFTER_S = 60.0

Send = tuple[int, object]  # (replica index, message for it)


@dataclass
class _Fanout:
    kind: type  # the front end's request: PinPrefixRequest, ListPinsRequest or UnpinPrefixRequest
    pin_id: str | None = None  # an unpin's controller id
    replies: dict[int, PinsReply] = field(default_factory=dict)


@dataclass
class _ReplicatedPin:
    replica_ids: list[str]  # the pin's id on replica i
    expires_at: float | None  # the latest of the replicas' expiries


class ReplicatedPins:
    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.pins: dict[str, _ReplicatedPin] = {}  # controller id -> the replicas' pins
        self._fanouts: dict[str, _Fanout] = {}  # front end request_id -> replies so far

    def from_front(self, message) -> tuple[list[Send], PinsReply | None]:
        """What to send to the replicas for a pin message of the front end, or the answer if none is needed."""
        if isinstance(message, UnpinPrefixRequest):
            pin = self.pins.get(message.pin_id)
            if pin is None:
                return [], PinsReply(message.request_id, 404, f"no pin with id {message.pin_id!r}")
            self._fanouts[message.request_id] = _Fanout(UnpinPrefixRequest, message.pin_id)
            # The asker's front end travels on: each replica answers on its socket to that front end.
            front_end = message.front_end
            return [
                (i, UnpinPrefixRequest(message.request_id, rid, front_end=front_end))
                for i, rid in enumerate(pin.replica_ids)
            ], None
        if not isinstance(message, (PinPrefixRequest, ListPinsRequest)):
            raise TypeError(f"not a pin message: {type(message).__name__}")
        self._fanouts[message.request_id] = _Fanout(type(message))
        return [(i, message) for i in range(self.dp_size)], None

    def from_replica(self, i: int, reply: PinsReply) -> tuple[list[Send], PinsReply | None]:
        """Take replica i's answer; once every replica answered, what to send to them (undos) and the front end's
        answer."""
        fanout = self._fanouts.get(reply.request_id)
        if fanout is None:  # the answer to an undo
            return [], None
        fanout.replies[i] = reply
        if len(fanout.replies) < self.dp_size:
            return [], None
        del self._fanouts[reply.request_id]
        replies = [fanout.replies[k] for k in range(self.dp_size)]
        if fanout.kind is PinPrefixRequest:
            return self._pinned(reply.request_id, replies)
        if fanout.kind is ListPinsRequest:
            return [], self._listed(reply.request_id, replies)
        return [], self._unpinned(reply.request_id, fanout.pin_id, replies)

    # ------------------------------------------------------------------ the merged answers
    def _pinned(self, request_id: str, replies: list[PinsReply]) -> tuple[list[Send], PinsReply]:
        refused = [(k, r) for k, r in enumerate(replies) if r.status != 200]
        if refused:
            # All or nothing: a pin on some replicas only would be a pin that most requests miss.
            undo = [
                (k, UnpinPrefixRequest(f"{UNDO_PREFIX}{request_id}-{k}", r.pins[0].id))
                for k, r in enumerate(replies)
                if r.status == 200 and r.pins
            ]
            k, first = refused[0]
            return undo, PinsReply(
                request_id, first.status, f"replica {k}: {first.message}", [], max(r.pinned_tokens for r in replies)
            )
        self._forget_expired()
        pin_id = f"pin-{secrets.token_hex(8)}"  # unguessable, like the replicas' own (radixserve/cache/pins.py)
        entries = [r.pins[0] for r in replies]
        merged = _merged(pin_id, list(enumerate(entries)))
        self.pins[pin_id] = _ReplicatedPin([e.id for e in entries], merged.expires_at)
        return [], PinsReply(request_id, 200, "", [merged], max(r.pinned_tokens for r in replies))

    def _listed(self, request_id: str, replies: list[PinsReply]) -> PinsReply:
        held = [{e.id: e for e in r.pins} for r in replies]
        listed = []
        for pin_id, pin in list(self.pins.items()):
            entries = [(k, held[k][rid]) for k, rid in enumerate(pin.replica_ids) if rid in held[k]]
            if entries:
                listed.append(_merged(pin_id, entries))
            else:
                del self.pins[pin_id]  # expired on every replica, or dropped by a flush
        # A replica pin the table does not know is one being made or undone right now: not a pin yet, or no more.
        listed.sort(key=lambda e: (e.created_at, e.id))
        return PinsReply(request_id, 200, "", listed, max(r.pinned_tokens for r in replies))

    def _unpinned(self, request_id: str, pin_id: str, replies: list[PinsReply]) -> PinsReply:
        self.pins.pop(pin_id, None)
        entries = [(k, r.pins[0]) for k, r in enumerate(replies) if r.status == 200 and r.pins]
        pinned_tokens = max(r.pinned_tokens for r in replies)
        if not entries:  # its TTL ran out on every replica meanwhile
            return PinsReply(request_id, 404, f"no pin with id {pin_id!r}", [], pinned_tokens)
        return PinsReply(request_id, 200, "", [_merged(pin_id, entries)], pinned_tokens)

    def _forget_expired(self) -> None:
        horizon = time.time() - FORGET_EXPIRED_AFTER_S
        for pin_id in [p for p, pin in self.pins.items() if pin.expires_at is not None and pin.expires_at < horizon]:
            del self.pins[pin_id]


def _merged(pin_id: str, entries: list[tuple[int, PinEntry]]) -> PinEntry:
    """One pin from its replicas' entries: in place since the last replica pinned it, until the last expiry."""
    first = entries[0][1]
    expiries = [e.expires_at for _, e in entries]
    return PinEntry(
        pin_id,
        first.cache_salt,
        first.num_tokens,
        max(e.created_at for _, e in entries),
        None if None in expiries else max(expiries),
        [k for k, _ in entries],
    )
