"""Admission: which prefill chunks run this step. Requests already prefilling (chunked) continue first; then waiting
requests start, in the policy's order (policy.py), while their first chunk plus a reserve for their outputs fits
in free + evictable KV slots (eviction itself is memory_pressure.py's)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from radixserve.cache.host_tier import HostTier
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tree_node import MatchResult, TreeNode
from radixserve.cache.slot_allocator import ReqPoolAllocator, TokenSlotAllocator
from radixserve.config import ServerArgs
from radixserve.protocol import ReusedSlots
from scheduler_service.memory_pressure import MemoryPressure, NewTokenRatio
from scheduler_service.policy import order_waiting_queue
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler_stats import SchedulerStats

# A waiting request is deferred while a prompt being computed shares at least this many tokens with it beyond what
# the tree holds for it: one step later they are in the tree. Shorter overlaps (a chat template's header, the first
# words of two questions after a cached system prompt) are not worth a step of latency.
IN_BATCH_PREFIX_MIN_TOKENS = 32


class Admission:
    """This step's prefill chunks, and the start of each waiting request that gets one: its cached prefix matched
    and locked, a req_to_token row, and its move from the waiting queue to the running batch."""

    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        tree: RadixCache,
        host_tier: HostTier | None,
        slot_allocator: TokenSlotAllocator,
        row_allocator: ReqPoolAllocator,
        waiting: deque[Req],
        running: list[Req],
        memory_pressure: MemoryPressure,
        new_token_ratio: NewTokenRatio,
        stats: SchedulerStats,
    ):
        """waiting and running are the Scheduler's (changed in place); memory_pressure evicts to make room;
        new_token_ratio is the share of outputs to reserve; stats counts the cached prompt tokens."""
        self.args = args
        self.context_len = context_len
        self.tree = tree
        self.host_tier = host_tier
        self.slot_allocator = slot_allocator
        self.row_allocator = row_allocator
        self.waiting = waiting
        self.running = running
        self.memory_pressure = memory_pressure
        self.new_token_ratio = new_token_ratio
        self.stats = stats

    def prefill_entries(
        self, budget: int, decodes: list[Req], reused: list[ReusedSlots], step: int
    ) -> list[tuple[Req, int]]:
        """(request, tokens to compute) for the next chunk of requests already prefilling, then for newly admitted
        requests, within budget tokens. decodes: this step's decodes, one slot each already promised; a new
        request's cached prefix is appended to reused (the worker points its row at those slots)."""
        entries = []
        committed = len(decodes)  # slots this step already promised
        for req in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            n = min(req.num_pending, budget)
            if self.memory_pressure.ensure_free_slots(committed + n):
                entries.append((req, n))
                budget -= n
                committed += n
        if budget > 0:
            entries += self._admit(budget, committed, reused, step)
        return entries

    def _admit(self, budget: int, committed: int, reused: list[ReusedSlots], step: int) -> list[tuple[Req, int]]:
        """Admit waiting requests while their first chunk plus a decode reserve fits in free + evictable slots."""
        if not self.waiting or self.row_allocator.num_free == 0:
            return []  # (no row, no admission: skip ordering the queue, which matches every prompt under LPM)
        lpm_matches: dict = {}  # what the LPM order matched: reused below while nothing has been evicted since
        ordered = order_waiting_queue(self.waiting, self.tree, self.args, step, lpm_matches)
        # Prompts being computed right now (not yet whole in the tree) that a waiting request could share.
        # (Only a tenant's own prompts: another cache_salt's can never be shared, and waiting on it would leak.)
        # Those admitted below are looked up by (salt, cached length, the token after it) instead: one that shares more
        # than its cached prefix with this one matched exactly as far (the tree only loses tokens during admission,
        # and what it matched is locked), so only those can. The others (running already, echoing prompt logprobs,
        # any with a host tier, whose loads add tokens) are each compared.
        admitted_fills = [(r.cache_salt, r.fill_ids()) for r in self.running if not r.is_decoding]
        ended_at: dict[tuple, list[np.ndarray]] = {}
        sent_at: dict[TreeNode, int] = {}  # a node -> the index in reused of the first cached prefix ending there
        # Slots that running requests will still need for their outputs, discounted by the observed ratio.
        ratio = self.new_token_ratio.value
        reserved = sum(min(r.remaining_new_tokens, self.context_len) for r in self.running) * ratio
        available = self.slot_allocator.num_free + self.tree.evictable_size - committed - reserved
        admitted: list[tuple[Req, int]] = []
        for req in ordered:
            if budget <= 0 or self.row_allocator.num_free == 0:
                break
            fill = req.fill_ids()
            # Prompt logprobs (echo) need the logits of every prompt position and a cached prefix has none: such a
            # request computes its whole prompt (as SGLang matches nothing below a request's logprob_start_len).
            matchable = 0 if req.prompt_logprobs is not None and not req.output_ids else len(fill) - 1
            # No hit yet: a request that waits is looked up again every step (its hit is counted on admission).
            match = self._match(req, fill, matchable, lpm_matches.get(id(req)))
            if self.host_tier is not None:  # more of the prompt kept in host memory comes back by a copy, not compute
                match = self.host_tier.load(fill[:matchable], match, req.cache_salt, req.priority, reserve=committed)
            prefix_len = len(match.slots)
            key = (req.cache_salt, prefix_len, int(fill[prefix_len]))
            if matchable and self._shares_prefix_with(
                fill,
                prefix_len,  # (nothing to share without a match)
                [f for s, f in admitted_fills if s == req.cache_salt] + ended_at.get(key, []),
            ):
                continue  # wait one step and reuse that request's prefix from the tree instead of recomputing it
            n = min(len(fill) - prefix_len, budget)
            need = n + req.remaining_new_tokens * ratio
            if need > available and (self.running or admitted):
                break  # FCFS within the chosen order: do not let small requests overtake forever
            self.tree.inc_lock_ref(match.last_node)
            if not self.memory_pressure.ensure_free_slots(committed + n):
                self.tree.dec_lock_ref(match.last_node)
                break
            self._start(req, match)
            if prefix_len:  # (prefixes that end at one node hold the same slots: sent once, see ReusedSlots)
                first = sent_at.setdefault(match.last_node, len(reused))
                row = req.req_pool_idx
                reused.append(
                    ReusedSlots(row, 0, match.slots.tobytes())
                    if first == len(reused)
                    else ReusedSlots(row, 0, b"", first)
                )
            admitted.append((req, n))
            if matchable and self.host_tier is None:
                ended_at.setdefault(key, []).append(fill)
            else:
                admitted_fills.append((req.cache_salt, fill))
            budget -= n
            committed += n
            available -= need
        return admitted

    def _match(self, req: Req, fill: np.ndarray, matchable: int, lpm_match) -> MatchResult:
        """The cached prefix of fill[:matchable]: the LPM order's match of the same tokens when it still holds (no
        eviction since; no priority to raise along the path; no host tier, whose loads grow the tree), else a new one.
        A burst of 128 cache hits matched each prompt twice: a quarter of admission's CPU
        (bench/results/admission-burst-cpu.md)."""
        if (
            lpm_match is not None
            and lpm_match[1] == self.tree.evicted_tokens
            and matchable == len(fill) - 1
            and req.priority == 0
            and self.host_tier is None
        ):
            return lpm_match[0]
        return self.tree.match_prefix(
            fill[:matchable], namespace=req.cache_salt, priority=req.priority, record_hit=False
        )

    def _start(self, req: Req, match) -> None:
        """The request runs from here: a row, its cached prefix (locked by the caller), its place in the batch."""
        self.tree.record_hit(match.last_node)
        prefix_len = len(match.slots)
        req.req_pool_idx = self.row_allocator.alloc()
        req.last_node = match.last_node
        req.slots[:prefix_len] = match.slots
        req.kv_len = req.tree_len = prefix_len
        req.status = ReqStatus.RUNNING
        req.needs_worker_registration = True
        if req.cached_tokens is None:
            req.cached_tokens = min(prefix_len, len(req.prompt_ids))
            req.admitted_time = time.time()
            self.stats.cached_prompt_tokens += req.cached_tokens
        self.waiting.remove(req)
        self.running.append(req)

    def _shares_prefix_with(self, fill: np.ndarray, cached_len: int, others: list[np.ndarray]) -> bool:
        """True when a prompt being computed this step shares a substantial prefix with this one, beyond what the
        tree already holds: one step later that prefix is in the tree and need not be computed twice."""
        if self.tree.disable:
            return False
        for other in others:
            n = min(len(fill), len(other)) - 1
            # Sharing more than the tree holds needs the token right after the cached part to match: an O(1) test
            # that skips almost every pair (a batch of one chat group shares exactly the cached system prompt).
            if n - cached_len < IN_BATCH_PREFIX_MIN_TOKENS or other[cached_len] != fill[cached_len]:
                continue
            # Only the uncached part counts: 128 chats over 8 cached system prompts whose questions began alike
            # ("[burst #12] ...", a few tokens) were admitted a few per step, ~7 steps of ~17 ms on the H100 host
            # where one or two would do (bench/results/ttft-under-load-h100.md, session 13).
            mismatch = np.flatnonzero(fill[:n] != other[:n])
            common = int(mismatch[0]) if len(mismatch) else n
            if common - cached_len >= IN_BATCH_PREFIX_MIN_TOKENS:
                return True
        return False
