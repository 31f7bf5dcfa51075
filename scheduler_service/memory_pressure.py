"""Memory pressure: making room in the KV cache. First evict unlocked cached prefixes (LRU); then retract running
requests (their KV is freed, they go back to the front of the queue and recompute later); a request that is alone
and still cannot get room can never finish in this cache and fails. Part of Scheduler (scheduler.py)."""

from __future__ import annotations

import logging

from scheduler_service.policy import order_waiting_queue
from scheduler_service.request import Req, ReqStatus

logger = logging.getLogger(__name__)


class MemoryPressureMixin:
    def _ensure_free_slots(self, n: int) -> bool:
        """Evict cached prefixes until n slots are free."""
        short = n - self.slot_allocator.num_free
        if short > 0:
            self.stats.evicted_tokens += self.tree.evict(short)
        return self.slot_allocator.num_free >= n

    def _make_room_for_decodes(self, decodes: list[Req]) -> list[Req]:
        """Every decode needs one new slot. Under pressure retract the requests with the least progress."""
        while decodes and not self._ensure_free_slots(len(decodes)):
            victim = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
            if not self._retract_or_fail(victim):
                return []
            decodes = [r for r in decodes if r is not victim]
        return decodes

    def _unblock(self) -> None:
        """Nothing could be scheduled although work exists: free room, or fail what can never fit."""
        if self.running:
            # Prefilling requests hold slots but none can take its next chunk: retract the least advanced.
            self._retract_or_fail(min(self.running, key=lambda r: (len(r.output_ids), r.kv_len)))
        elif self.waiting and not self.finishing:  # (finishing requests free their KV once their token is back)
            # Alone, admission always tries the first request in order; if even it cannot start, it never will.
            req = order_waiting_queue(self.waiting, self.tree, self.args, self.step_count)[0]
            if min(req.num_fill, self.chunked_prefill_size) > self.slot_allocator.num_free + self.tree.evictable_size:
                self.waiting.remove(req)
                self._fail(req, self._cannot_hold(req))

    def _retract_or_fail(self, victim: Req) -> bool:
        """Give the victim's KV back. Retracted if others run (True); failed if it runs alone (False): with the whole
        cache to itself it still has no room, so it can never finish here."""
        self.running.remove(victim)
        self._release(victim, insert=False)
        if not self.num_running:
            self._fail(victim, self._cannot_hold(victim, "so far"))
            return False
        victim.status = ReqStatus.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        self.stats.retractions += 1
        # Retraction means we were too optimistic about output lengths: reserve more from now on.
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, self.args.init_new_token_ratio) + 0.1)
        logger.info("retracted %s (out=%d); new_token_ratio=%.2f", victim.rid, len(victim.output_ids),
                    self.new_token_ratio)
        return True

    def _cannot_hold(self, req: Req, when: str = "") -> str:
        return (f"the KV cache ({self.slot_allocator.num_total} tokens) cannot hold this request "
                f"({req.num_fill} tokens{' ' + when if when else ''})")
