"""Continuous batching over a radix prefix cache.

Each step builds one ForwardBatch: one token for every decoding request, plus prefill chunks (the unfinished
chunked request first, then newly admitted ones) up to the chunk budget. The model executor (in-process
ModelRunner or the worker processes) returns one sampled token per request that finished its prompt; the
scheduler appends it, checks finish conditions, and releases finished requests into the radix tree.

KV-slot accounting: every slot is free, cached in the tree (evictable or protected by a lock), or owned by a
running request (computed but not yet inserted). check_invariant() verifies free + cached + owned == total.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from radixserve.cache.memory_pool import ReqPoolAllocator, TokenSlotAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from radixserve.protocol import (ForwardBatch, RequestOutput, RowWrite, SampledTokens, WorkerRequest, pack_i32,
                                 unpack_i32)
from scheduler_service.policy import order_waiting_queue
from scheduler_service.request import Req, ReqStatus

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one request."""
    req: Req
    new_token_ids: list[int]
    new_logprobs: list = field(default_factory=list)
    finished: bool = False

    def to_message(self) -> RequestOutput:
        req = self.req
        first = len(req.output_ids) == len(self.new_token_ids)
        return RequestOutput(
            rid=req.rid, token_ids=pack_i32(self.new_token_ids), logprobs=self.new_logprobs,
            finished=self.finished, finish_reason=req.finish_reason if self.finished else None,
            matched_stop_token=req.matched_stop, error=req.error, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens or 0,
            queue_time=(req.admitted_time - req.arrival_time) if first and req.admitted_time else None)


@dataclass
class ScheduledBatch:
    batch: ForwardBatch
    reqs: list[Req]  # batch order
    samples: list[bool]  # per request: does it get a token this step
    prefills: list[bool]  # per request: did it compute prompt tokens (not a plain decode)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    retractions: int = 0
    evicted_tokens: int = 0


# A waiting request is deferred while a prompt being computed shares at least this many tokens with it (and more
# than the tree holds yet): one step later they are in the tree. Shorter overlaps (a chat template's header) are
# not worth a step of latency.
IN_BATCH_PREFIX_MIN_TOKENS = 32


class KVInvariantError(AssertionError):
    pass


class Scheduler:
    def __init__(self, args: ServerArgs, num_kv_slots: int, context_len: int, eos_token_ids: list[int],
                 execute: Callable[[ForwardBatch], SampledTokens] | None = None):
        self.args = args
        self.context_len = context_len
        self.eos_token_ids = set(eos_token_ids)
        self.execute = execute
        self.slot_allocator = TokenSlotAllocator(num_kv_slots)
        self.row_allocator = ReqPoolAllocator(args.max_running_requests)
        self.tree = RadixCache(self.slot_allocator, disable=args.disable_radix_cache)
        self.chunk_budget = args.prefill_chunk_tokens
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # hold a row: decoding, or prefilling in chunks
        self.requests: dict[str, Req] = {}
        self.new_token_ratio = args.init_new_token_ratio
        self.step_count = 0
        self.stats = SchedulerStats()
        self.check_invariant_every_step = False  # tests turn this on
        # Outputs produced outside a step (aborts, errors found at admission), returned by the next step.
        self._pending_outputs: list[StepOutput] = []
        # req_to_token rewrites decided after a step (chunk insertion), sent with the next batch.
        self._pending_row_writes: list[tuple[Req, RowWrite]] = []

    # ------------------------------------------------------------------ public API
    def add_request(self, req: Req) -> None:
        """Queue a request. Raises ValueError for one that can never run (the front end returns it as a 400)."""
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if len(req.prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.context_len:
            raise ValueError(f"This model's maximum context length is {self.context_len} tokens. However, you "
                             f"requested {total} tokens ({len(req.prompt_ids)} in the prompt, "
                             f"{req.params.max_new_tokens} for the completion).")
        req.arrival_step = self.step_count
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Stop a request in any state and free its KV without inserting it. False if unknown or finished."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._release(req, insert=False)
        self._finish(req, "abort")
        self._pending_outputs.append(StepOutput(req, [], finished=True))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs)

    def step(self) -> list[StepOutput]:
        """Schedule one batch, run it, and return what each request got."""
        scheduled = self.schedule()
        outputs = []
        if scheduled is not None:
            outputs = self.process_results(scheduled, self.execute(scheduled.batch))
        outputs = self._pending_outputs + outputs
        self._pending_outputs = []
        if self.check_invariant_every_step:
            self.check_invariant()
        return outputs

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (nothing locked)."""
        if self.running or self.waiting:
            return False
        self.tree.reset()
        return True

    # ------------------------------------------------------------------ invariant
    def kv_usage(self) -> dict[str, int]:
        owned = sum(r.owned_slots for r in self.running)
        return {"total": self.slot_allocator.num_total, "free": self.slot_allocator.num_free,
                "evictable": self.tree.evictable_size, "protected": self.tree.protected_size, "owned": owned}

    def check_invariant(self) -> None:
        u = self.kv_usage()
        if u["free"] + u["evictable"] + u["protected"] + u["owned"] != u["total"]:
            raise KVInvariantError(f"KV slot leak: free {u['free']} + evictable {u['evictable']} + protected "
                                   f"{u['protected']} + owned by requests {u['owned']} != total {u['total']}")
        if not self.running and u["protected"]:
            raise KVInvariantError(f"{u['protected']} cached tokens still locked with no running request")
        if self.row_allocator.num_free + len(self.running) != self.row_allocator.num_total:
            raise KVInvariantError(f"req_to_token rows leaked: {self.row_allocator.num_free} free + "
                                   f"{len(self.running)} running != {self.row_allocator.num_total}")

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        self.step_count += 1
        row_writes = [w for req, w in self._pending_row_writes if req.status is ReqStatus.RUNNING]
        self._pending_row_writes = []
        entries: list[tuple[Req, int]] = []  # (request, tokens to compute this step)
        if self.args.disable_mixed_batch:
            # Unmixed: a step is either all prefill or all decode; prefill goes first when there is any.
            entries = self._prefill_entries(self.chunk_budget, [], row_writes)
        if not entries:
            decodes = self._make_room_for_decodes([r for r in self.running if r.is_decoding])
            if not self.args.disable_mixed_batch:
                entries = self._prefill_entries(self.chunk_budget, decodes, row_writes)
            entries += [(r, 1) for r in decodes]
        if not entries:
            self._unblock()
            return None
        return self._build_batch(entries, row_writes)

    def _prefill_entries(self, budget: int, decodes: list[Req], row_writes: list[RowWrite]) -> list[tuple[Req, int]]:
        """The next chunk of requests already prefilling, then newly admitted requests, within the chunk budget."""
        entries = []
        committed = len(decodes)  # slots this step already promised
        for req in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            n = min(req.num_pending, budget)
            if self._ensure_free_slots(committed + n):
                entries.append((req, n))
                budget -= n
                committed += n
        if budget > 0:
            entries += self._admit(budget, committed, row_writes)
        return entries

    def _unblock(self) -> None:
        """Nothing could be scheduled although work exists: free room, or fail what can never fit."""
        if self.running:
            # Prefilling requests hold slots but none can take its next chunk: retract the least advanced.
            victim = min(self.running, key=lambda r: (len(r.output_ids), r.kv_len))
            if len(self.running) == 1:
                self.running.remove(victim)
                self._release(victim, insert=False)
                self._fail(victim, f"the KV cache ({self.slot_allocator.num_total} tokens) cannot hold this "
                                   f"request ({victim.num_fill} tokens so far)")
            else:
                self._retract(victim)
        elif self.waiting:
            # Alone, admission always tries the first request in order; if even it cannot start, it never will.
            req = order_waiting_queue(self.waiting, self.tree, self.args, self.step_count)[0]
            if min(req.num_fill, self.chunk_budget) > self.slot_allocator.num_free + self.tree.evictable_size:
                self.waiting.remove(req)
                self._fail(req, f"the KV cache ({self.slot_allocator.num_total} tokens) cannot hold this request "
                                f"({req.num_fill} tokens)")

    def _admit(self, budget: int, committed: int, row_writes: list[RowWrite]) -> list[tuple[Req, int]]:
        """Admit waiting requests while their first chunk plus a decode reserve fits in free + evictable slots."""
        if not self.waiting:
            return []
        ordered = order_waiting_queue(self.waiting, self.tree, self.args, self.step_count)
        # Prompts being computed right now (not yet whole in the tree) that a waiting request could share.
        admitted_fills = [r.fill_ids() for r in self.running if not r.is_decoding]
        # Slots that running requests will still need for their outputs, discounted by the observed ratio.
        reserved = sum(min(r.remaining_new_tokens, self.context_len) for r in self.running) * self.new_token_ratio
        available = self.slot_allocator.num_free + self.tree.evictable_size - committed - reserved
        admitted: list[tuple[Req, int]] = []
        for req in ordered:
            if budget <= 0 or self.row_allocator.num_free == 0:
                break
            fill = req.fill_ids()
            match = self.tree.match_prefix(fill[:-1])
            prefix_len = len(match.slots)
            if self._shares_prefix_with(fill, prefix_len, admitted_fills):
                continue  # wait one step and reuse that request's prefix from the tree instead of recomputing it
            n = min(len(fill) - prefix_len, budget)
            need = n + req.remaining_new_tokens * self.new_token_ratio
            if need > available and (self.running or admitted):
                break  # FCFS within the chosen order: do not let small requests overtake forever
            self.tree.inc_lock_ref(match.last_node)
            if not self._ensure_free_slots(committed + n):
                self.tree.dec_lock_ref(match.last_node)
                break
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
            if prefix_len:
                row_writes.append(RowWrite(req.req_pool_idx, 0, match.slots.tobytes()))
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append((req, n))
            admitted_fills.append(fill)
            budget -= n
            committed += n
            available -= need
        return admitted

    def _shares_prefix_with(self, fill: np.ndarray, cached_len: int, others: list[np.ndarray]) -> bool:
        """True when a prompt being computed this step shares a substantial prefix with this one, beyond what the
        tree already holds: one step later that prefix is in the tree and need not be computed twice."""
        if self.tree.disable:
            return False
        for other in others:
            n = min(len(fill), len(other)) - 1
            # Sharing more than the tree holds needs the token right after the cached part to match: an O(1) test
            # that skips almost every pair (a batch of one chat group shares exactly the cached system prompt).
            if n < IN_BATCH_PREFIX_MIN_TOKENS or n <= cached_len or other[cached_len] != fill[cached_len]:
                continue
            mismatch = np.flatnonzero(fill[:n] != other[:n])
            common = int(mismatch[0]) if len(mismatch) else n
            if common >= IN_BATCH_PREFIX_MIN_TOKENS and common > cached_len:
                return True
        return False

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
            if len(self.running) == 1:
                # Alone and still out of room: it can never finish in this cache.
                self.running.remove(victim)
                self._release(victim, insert=False)
                self._fail(victim, f"the KV cache ({self.slot_allocator.num_total} tokens) cannot hold this "
                                   f"request ({victim.num_fill} tokens so far)")
                decodes = []
                break
            self._retract(victim)
            decodes = [r for r in decodes if r is not victim]
        return decodes

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req, insert=False)
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        # Retraction means we were too optimistic about output lengths: reserve more from now on.
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, self.args.init_new_token_ratio) + 0.1)
        logger.info("retracted %s (out=%d); new_token_ratio=%.2f", req.rid, len(req.output_ids), self.new_token_ratio)

    def _build_batch(self, entries, row_writes) -> ScheduledBatch:
        total = sum(n for _, n in entries)
        new_slots = self.slot_allocator.alloc(total)
        assert new_slots is not None, "slots were ensured before building the batch"
        rows, prefix_lens, extend_lens, input_ids, samples = [], [], [], [], []
        new_requests: list[WorkerRequest] = []
        offset = 0
        for req, n in entries:
            if req.needs_worker_registration:
                new_requests.append(self._worker_request(req))
                req.needs_worker_registration = False
            start = req.kv_len
            if n == 1 and start == req.num_fill - 1 and req.output_ids:
                tokens = [req.output_ids[-1]]  # a decode: skip building prompt + outputs
            else:
                tokens = req.fill_ids()[start:start + n]
            req.slots[start:start + n] = new_slots[offset:offset + n]
            offset += n
            rows.append(req.req_pool_idx)
            prefix_lens.append(start)
            extend_lens.append(n)
            input_ids.append(np.asarray(tokens, dtype=np.int32))
            req.kv_len = start + n
            samples.append(req.kv_len == req.num_fill)
        batch = ForwardBatch(
            step=self.step_count,
            req_pool_indices=pack_i32(rows), prefix_lens=pack_i32(prefix_lens), extend_lens=pack_i32(extend_lens),
            input_ids=np.concatenate(input_ids).tobytes(), out_cache_loc=new_slots.tobytes(),
            sample_mask=bytes(samples), new_requests=new_requests, row_writes=row_writes)
        self.stats.steps += 1
        decode_tokens = sum(1 for (r, n) in entries if n == 1 and r.output_ids)
        self.stats.decode_tokens += decode_tokens
        self.stats.prefill_tokens_computed += total - decode_tokens
        prefills = [not (n == 1 and r.output_ids) for r, n in entries]
        return ScheduledBatch(batch, [r for r, _ in entries], samples, prefills)

    def _worker_request(self, req: Req) -> WorkerRequest:
        p = req.params
        return WorkerRequest(
            req_pool_idx=req.req_pool_idx, params=p,
            penalty_prompt_ids=req.prompt_ids.tobytes() if p.repetition_penalty != 1.0 else b"",
            output_ids=pack_i32(req.output_ids) if req.output_ids else b"")

    # ------------------------------------------------------------------ results
    def process_results(self, scheduled: ScheduledBatch, sampled: SampledTokens) -> list[StepOutput]:
        tokens = unpack_i32(sampled.token_ids)
        outputs = []
        sample_index = 0
        now = time.time()
        for req, samples, prefill in zip(scheduled.reqs, scheduled.samples, scheduled.prefills):
            if req.status is not ReqStatus.RUNNING:
                continue  # aborted while the batch was in flight; its token is dropped
            if prefill:
                # Share computed prompt tokens at once: requests arriving meanwhile hit them in the tree.
                self._cache_chunk(req)
            if not samples:
                continue
            token = int(tokens[sample_index])
            logprob = sampled.logprobs[sample_index] if sampled.logprobs else None
            sample_index += 1
            req.output_ids.append(token)
            if logprob is not None:
                req.logprobs.append(logprob)
            if req.first_token_time is None:
                req.first_token_time = now
            req.token_times.append(now)
            out = StepOutput(req, [token], [logprob] if logprob is not None else [])
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self._release(req, insert=True)
                self._finish(req, reason)
                out.finished = True
            outputs.append(out)
        if self.new_token_ratio > self.args.min_new_token_ratio:
            self.new_token_ratio = max(self.args.min_new_token_ratio,
                                       self.new_token_ratio - self.args.new_token_ratio_decay)
        return outputs

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        n = len(req.output_ids)
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                req.matched_stop = token
                return "stop"
        if n >= p.max_new_tokens or req.num_fill >= self.context_len:
            return "length"
        return None

    def _cache_chunk(self, req: Req) -> None:
        """Insert the computed part of a prompt (all chunks so far) so other requests can share it already, then
        point the request at the tree's own slots (another request may have inserted the same tokens first)."""
        if self.tree.disable:
            return
        fill = req.fill_ids()[:req.kv_len]
        self.tree.insert(fill, req.slots[:req.kv_len])
        match = self.tree.match_prefix(fill)
        self._relock(req, match.last_node)
        changed = np.flatnonzero(match.slots != req.slots[:req.kv_len])
        if len(changed):
            lo, hi = int(changed[0]), int(changed[-1]) + 1
            req.slots[lo:hi] = match.slots[lo:hi]
            self._pending_row_writes.append((req, RowWrite(req.req_pool_idx, lo, match.slots[lo:hi].tobytes())))
        req.tree_len = req.kv_len

    def _relock(self, req: Req, node) -> None:
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = node

    # ------------------------------------------------------------------ endings
    def _release(self, req: Req, insert: bool) -> None:
        """Give back the request's row and KV: inserted into the tree (finished) or freed (aborted, retracted)."""
        if insert and not self.tree.disable:
            # The last sampled token has no KV yet; everything before it does.
            fill = req.fill_ids()[:req.kv_len]
            self.tree.insert(fill, req.slots[:req.kv_len])
        elif insert:
            self.slot_allocator.free(req.slots[:req.kv_len])
        else:
            self.slot_allocator.free(req.slots[req.tree_len:req.kv_len])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        self.row_allocator.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = req.tree_len = 0

    def _finish(self, req: Req, reason: str) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.rid, None)

    def _fail(self, req: Req, message: str) -> None:
        req.error = message
        self._finish(req, "error")
        self._pending_outputs.append(StepOutput(req, [], finished=True))
        logger.warning("request %s failed: %s", req.rid, message)
