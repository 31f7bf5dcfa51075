"""Order of the waiting queue: longest cached prefix first (LPM) while the queue is short, plain FCFS when it is
long (matching every waiting prompt each step would cost more than it saves), and aged requests always first so
a cache miss cannot be starved by a stream of cache hits."""

from __future__ import annotations

from collections import deque

from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from scheduler_service.request import Req

LPM_MAX_QUEUE = 128


def order_waiting_queue(waiting: deque[Req], tree: RadixCache, args: ServerArgs, step: int) -> list[Req]:
    if args.schedule_policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or tree.disable:
        return list(waiting)
    aged = [r for r in waiting if step - r.arrival_step > args.max_wait_steps or r.retractions]
    if len(aged) == len(waiting):
        return aged
    aged_ids = {id(r) for r in aged}
    fresh = [r for r in waiting if id(r) not in aged_ids]
    # sorted() is stable, so requests with equally long cached prefixes keep their arrival order.
    fresh.sort(key=lambda r: -len(tree.match_prefix(r.fill_ids()[:-1]).slots))
    return aged + fresh
