"""What the HTTP server's cache routes do, as Dynamo engine controls: `POST /engine/control/<name>` on the worker's
system server (--host:--port), a JSON object in and out. The system server has no API key: keep it on loopback or
a private network.

- flush_cache {"keep_pins": true}: empties the radix cache (when idle); the router hears every block removed.
- server_info {}: the scheduler's counters (running requests, KV slots, cached prompt tokens, kv_invariant_ok...).
- pin_prefix {"input_ids": [...], "cache_salt": null, "ttl_seconds": null}: keep a prefix cached (computed first
  if needed); unpin_prefix {"pin_id": ...}; list_pins {}. Dynamo is tokens-in, so a pin is token ids.
"""

from __future__ import annotations

import msgspec

from radixserve.protocol import ListPinsRequest, PinPrefixRequest, UnpinPrefixRequest, pack_i32

CONTROLS = ("flush_cache", "server_info", "pin_prefix", "unpin_prefix", "list_pins")


async def control(link, name: str, body: dict) -> dict:
    if name == "server_info":
        return await link.server_info()
    if name == "flush_cache":
        result = await link.flush_cache(keep_pins=bool(body.get("keep_pins", True)))
        return {"success": result.success, "message": result.message}
    if name == "pin_prefix":
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return {"status": 400, "message": "pin_prefix wants input_ids, a list of token ids"}
        reply = await link.ask(
            lambda request_id: PinPrefixRequest(
                request_id, pack_i32(ids), body.get("cache_salt"), body.get("ttl_seconds")
            )
        )
    elif name == "unpin_prefix":
        reply = await link.ask(lambda request_id: UnpinPrefixRequest(request_id, str(body.get("pin_id"))))
    elif name == "list_pins":
        reply = await link.ask(ListPinsRequest)
    else:
        return {"status": 404, "message": f"unknown control {name}"}
    return {
        "status": reply.status,
        "message": reply.message,
        "pinned_tokens": reply.pinned_tokens,
        "pins": [msgspec.structs.asdict(pin) for pin in reply.pins],
    }
