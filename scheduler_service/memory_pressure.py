"""Memory pressure: making room in the KV cache. First evict unlocked cached prefixes (LRU); then retract running
requests (their KV is freed, they go back to the front of the queue and recompute later); a request that is alone
and still cannot get room can never finish in this cache and fails."""

from __future__ import annotations

import logging
from collections import deque

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.config import ServerArgs
from scheduler_service.endings import Endings
from scheduler_service.policy import order_waiting_queue
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)


class NewTokenRatio:
    """The share of its remaining max_new_tokens that admission keeps free for each running request's outputs. It
    starts at --init-new-token-ratio and shrinks a little every step (--new-token-ratio-decay, down to
    --min-new-token-ratio) as requests finish early; a retraction shows it was too optimistic and raises it."""

    def __init__(self, args: ServerArgs):
        self.value = self.init = args.init_new_token_ratio
        self.min = args.min_new_token_ratio
        self.decay_per_step = args.new_token_ratio_decay

    def decay(self) -> None:
        if self.value > self.min:
            self.value = max(self.min, self.value - self.decay_per_step)

    def raise_after_retraction(self) -> None:
        self.value = min(1.0, max(self.value, self.init) + 0.1)


class MemoryPressure:
    """Room in the KV pool for this step: eviction for admission's chunks, retraction for the running batch's
    decodes, and the end of a request that can never fit."""

    def __init__(
        self,
        args: ServerArgs,
        chunked_prefill_size: int,
        tree: RadixCache,
        slot_allocator: TokenSlotAllocator,
        waiting: deque[Req],
        running: list[Req],
        finishing: list[Req],
        endings: Endings,
        new_token_ratio: NewTokenRatio,
        stats: SchedulerStats,
    ):
        """waiting, running and finishing are the Scheduler's (changed in place); endings gives a victim's KV back;
        a retraction raises new_token_ratio; stats counts evictions and retractions."""
        self.args = args
        self.chunked_prefill_size = chunked_prefill_size
        self.tree = tree
        self.slot_allocator = slot_allocator
        self.waiting = waiting
        self.running = running
        self.finishing = finishing
        self.endings = endings
        self.new_token_ratio = new_token_ratio
        self.stats = stats

    def ensure_free_slots(self, n: int) -> bool:
        """Evict cached prefixes until n slots are free."""
        short = n - self.slot_allocator.num_free
        if short > 0:
            self.stats.evicted_tokens += self.tree.evict(short)
        return self.slot_allocator.num_free >= n

    def make_room_for_decodes(self, decodes: list[Req]) -> list[Req]:
        """Every decode needs one new slot. Under pressure retract the requests with the least progress; returns the
        decodes left."""
        while decodes and not self.ensure_free_slots(len(decodes)):
            victim = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
            if not self._retract_or_fail(victim):
                return []
            decodes = [r for r in decodes if r is not victim]
        return decodes

    def unblock(self, step: int) -> None:
        """Nothing could be scheduled although work exists: free room, or fail what can never fit."""
        if self.running:
            # Prefilling requests hold slots but none can take its next chunk: retract the least advanced.
            self._retract_or_fail(min(self.running, key=lambda r: (len(r.output_ids), r.kv_len)))
        elif self.waiting and not self.finishing:  # (finishing requests free their KV once their token is back)
            # Alone, admission always tries the first request in order; if even it cannot start, it never will.
            req = order_waiting_queue(self.waiting, self.tree, self.args, step)[0]
            if min(req.num_fill, self.chunked_prefill_size) > self.slot_allocator.num_free + self.tree.evictable_size:
                self.waiting.remove(req)
                self.endings.fail(req, self._cannot_hold(req))

    def _retract_or_fail(self, victim: Req) -> bool:
        """Give the victim's KV back. Retracted if others run (True); failed if it runs alone (False): with the whole
        cache to itself it still has no room, so it can never finish here."""
        self.running.remove(victim)
        self.endings.release(victim, insert=False)
        if not self.endings.num_running():
            self.endings.fail(victim, self._cannot_hold(victim, "so far"))
            return False
        victim.status = ReqStatus.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        self.stats.retractions += 1
        # Retraction means we were too optimistic about output lengths: reserve more from now on.
        self.new_token_ratio.raise_after_retraction()
        logger.info(
            "retracted %s (out=%d); new_token_ratio=%.2f",
            victim.rid,
            len(victim.output_ids),
            self.new_token_ratio.value,
        )
        return True

    def _cannot_hold(self, req: Req, when: str = "") -> str:
        return (
            f"the KV cache ({self.slot_allocator.num_total} tokens) cannot hold this request "
            f"({req.num_fill} tokens{' ' + when if when else ''})"
        )
