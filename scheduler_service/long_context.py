"""Requests longer than the GPU KV pool (--enable-layerwise-offload), the scheduler's side. The worker's side, and
why a long request runs one layer at a time, is radixserve/worker/layerwise_offload.py.

A request whose prompt + max_tokens exceed the device pool goes to its own queue here instead of the ordinary one.
Its KV lives in the host pool of the host tier (--hicache-size, radixserve/cache/host_tier.py): at admission it
matches its prompt against the tier's tree (a follow-up turn finds the document there and computes only its new
tokens), locks what it found, and takes host slots for every other position it may hold, evicting the tier's least
recently used prefixes if it must. When it finishes, its prompt and output go into the tier's tree like any evicted
prefix: eviction, cache_salt namespaces and the LRU order apply to it as to any other.

Its work is cut into jobs, and jobs into units (protocol.LongWork): a prefill job runs the new prompt tokens chunk by
chunk through one layer after another; a decode job runs one token of every long request whose context fits one
ring buffer beside the others, layer by layer. How the GPU is shared with ordinary requests: while ordinary requests
run or wait, steps alternate, one long step after every ordinary step, and a long step runs at most
--layerwise-offload-units-per-step units (an ordinary decode waits at most one long step between two tokens); with
no ordinary work, long steps run back to back. Between long jobs, a prefill in progress gives way to a decode of the
others at each layer boundary, so that long requests already decoding are not stalled for a whole prefill."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.host_tier import HostTier
from radixserve.cache.slot_allocator import ReqPoolAllocator
from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, LongRequest, LongWork, pack_i32
from scheduler_service.batch_builder import ScheduledBatch, worker_request
from scheduler_service.request import Req, ReqStatus
from scheduler_service.scheduler_stats import SchedulerStats


@dataclass(eq=False)
class HostKV:
    """A long request's KV bookkeeping: the host slot of every position it may hold, the first prefix_len of them
    the tier tree's own (locked at `node`), the rest its own until it ends."""

    slots: np.ndarray  # int32
    prefix_len: int
    node: object  # the tier tree's node where the matched prefix ends (locked while the request runs)
    sent: bool = False  # the worker has its slots
    last_job: int = -1  # the last decode job it was in (the longest waiting go first when not all fit)


@dataclass(eq=False)
class Job:
    id: int
    prefill: bool
    reqs: list[Req]
    units_per_layer: int  # chunks of a prefill; 1 for a decode
    num_units: int
    rows: bytes
    prefix_lens: bytes
    extend_lens: bytes
    input_ids: bytes  # sent with the first step only
    chunk_size: int = 0
    next_unit: int = 0
    deferred_rows: list[int] = field(default_factory=list)  # rows of requests that ended while the job runs


class LongContext:
    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        device_pool_tokens: int,
        host_tier: HostTier,
        row_allocator: ReqPoolAllocator,
        stats: SchedulerStats,
        num_layers: int,
    ):
        """device_pool_tokens: the GPU KV pool's size (longer requests come here); host_tier holds their KV;
        row_allocator: the req_to_token rows they share with ordinary requests; stats counts their tokens."""
        self.context_len = context_len
        self.device_pool_tokens = device_pool_tokens
        self.tier = host_tier
        self.row_allocator = row_allocator
        self.stats = stats
        self.num_layers = num_layers
        self.chunk = args.layerwise_offload_chunk_size
        self.units_per_step = args.layerwise_offload_units_per_step
        self.buffer_tokens = args.layerwise_offload_buffer_tokens or context_len
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted and not ended (prefilling, decoding or finishing)
        self.prefill: Job | None = None
        self.decode: Job | None = None
        self._job_ids = itertools.count()
        self._last_step_long = False
        self._last_job_prefill = False
        self.jobs = self.steps = self.max_decode_batch = 0

    # ------------------------------------------------------------------ requests
    def takes(self, req: Req) -> bool:
        return len(req.prompt_ids) + req.params.max_new_tokens > self.device_pool_tokens

    def max_tokens(self) -> int:
        """The most tokens one sequence can hold on this server."""
        return min(self.context_len, self.buffer_tokens, self.tier.capacity_tokens - self.tier.tree.pinned_size)

    def check(self, req: Req) -> None:
        """ValueError (a 400) for a long request that can never run, naming the limit."""
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if req.prompt_logprobs is not None:
            raise ValueError(
                f"prompt logprobs (echo) are not served for requests longer than the KV pool "
                f"({self.device_pool_tokens} tokens): their prompt runs one layer at a time"
            )
        if total > self.buffer_tokens:
            raise ValueError(
                f"this request holds up to {total} tokens, more than a layer-wise offload buffer holds "
                f"({self.buffer_tokens} tokens, --layerwise-offload-buffer-tokens)"
            )
        room = self.tier.capacity_tokens - self.tier.tree.pinned_size
        if total > room:
            pinned = f", {self.tier.tree.pinned_size} of them pinned" if self.tier.tree.pinned_size else ""
            raise ValueError(
                f"this request needs host KV for {total} tokens, but the host KV pool holds "
                f"{self.tier.capacity_tokens} tokens{pinned} (--hicache-size)"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def set_aside(self, reqs: list[Req]) -> list[Req]:
        """Overlapped loop: long requests whose token in flight is their last take no further job (marked here);
        the ordinary ones are returned for Scheduler.set_aside_finishing."""
        for req in reqs:
            if req.offloaded:
                req.finishing = True
        return [r for r in reqs if not r.offloaded]

    def stop(self, req: Req) -> None:
        self.running.remove(req)
        req.finishing = False
        if self.prefill is not None and self.prefill.reqs[0] is req:
            self.prefill = None  # its remaining steps are never sent; the worker drops the job with the next one

    def release(self, req: Req, insert: bool) -> None:
        """The request ended: its prompt and output into the tier's tree (insert) or its own host slots freed."""
        h, tier = req.host_kv, self.tier
        if insert and not tier.tree.disable:
            n = req.kv_len
            tier.tree.insert(req.fill_ids()[:n], h.slots[:n], namespace=req.cache_salt, priority=req.priority)
            tier.allocator.free(h.slots[n:])
        else:
            tier.allocator.free(h.slots[h.prefix_len :])
        tier.tree.dec_lock_ref(h.node)
        job = self.decode
        if job is not None and req in job.reqs:
            # Its row stays taken until the job's last step is built: that step samples every row of the job, and
            # a new request registered in this row before then would receive this one's token.
            job.deferred_rows.append(req.req_pool_idx)
        else:
            self.row_allocator.free(req.req_pool_idx)
        req.req_pool_idx, req.host_kv = None, None
        req.kv_len = req.tree_len = 0

    def owned_host_slots(self) -> int:
        return sum(len(r.host_kv.slots) - r.host_kv.prefix_len for r in self.running)

    # ------------------------------------------------------------------ scheduling
    def turn(self, ordinary_work: bool) -> bool:
        """Is this step a long one: long work exists, and the step before was an ordinary one or there is none."""
        if not (self.waiting or self.running):
            return False
        if ordinary_work and self._last_step_long:
            self._last_step_long = False
            return False
        return True

    def schedule(self, step: int) -> ScheduledBatch | None:
        """This step's batch of long work, or None if none can run now."""
        job = self._job()
        if job is None:
            self._last_step_long = False
            return None
        n = job.num_units - job.next_unit
        if self.units_per_step:
            n = min(n, self.units_per_step)
        if job.prefill:  # a step never crosses a layer boundary: decodes may take their turn there
            n = min(n, job.units_per_layer - job.next_unit % job.units_per_layer)
        first = job.next_unit
        job.next_unit += n
        last = job.next_unit == job.num_units
        self._last_step_long, self._last_job_prefill = True, job.prefill
        self.steps += 1
        return self._scheduled(step, job, first, n, last)

    def _job(self) -> Job | None:
        if self.decode is not None:  # a decode job runs to its end
            return self.decode
        p = self.prefill
        if p is not None and p.next_unit % p.units_per_layer:
            return p  # within a layer: its K/V of the prompt so far is in a ring buffer
        decoders = self._decoders()
        if decoders and self._last_job_prefill:
            return self._start_decode(decoders)
        job = p or self._admit()
        if job is None and decoders:
            return self._start_decode(decoders)
        return job

    def _decoders(self) -> list[Req]:
        """Long requests ready for their next token: every position but the last output's has KV (or is being
        computed), and the token in flight is not their last."""
        return [r for r in self.running if r.output_ids and not r.finishing and r.kv_len == r.num_fill - 1]

    def _start_decode(self, decoders: list[Req]) -> Job:
        """One token for as many of them as fit one ring buffer side by side, longest waiting first."""
        decoders.sort(key=lambda r: r.host_kv.last_job)
        chosen, room = [], self.buffer_tokens
        for req in decoders:
            if req.kv_len + 1 <= room:
                chosen.append(req)
                room -= req.kv_len + 1
        ctx = [r.kv_len for r in chosen]
        ids = [r.output_ids[-1] for r in chosen]
        self.decode = self._new_job(False, chosen, 1, ctx, [1] * len(chosen), ids)
        for req in chosen:
            req.kv_len += 1
            req.host_kv.last_job = self.decode.id
        self.stats.decode_tokens += len(chosen)
        self.max_decode_batch = max(self.max_decode_batch, len(chosen))
        return self.decode

    def _admit(self) -> Job | None:
        """Start the first waiting long request: its cached prefix from the tier's tree, host slots for the rest."""
        tier = self.tier
        if not self.waiting or self.row_allocator.num_free == 0:
            return None
        req = self.waiting[0]
        fill = req.fill_ids()
        match = tier.tree.match_prefix(fill[: len(fill) - 1], namespace=req.cache_salt, priority=req.priority)
        prefix = len(match.slots)
        need = len(req.prompt_ids) + req.params.max_new_tokens - prefix
        tier.tree.inc_lock_ref(match.last_node)
        short = need - tier.allocator.num_free
        if short > 0:
            tier.tree.evict(short)  # least recently used prefixes of the tier (never the one just locked)
        if tier.allocator.num_free < need:
            tier.tree.dec_lock_ref(match.last_node)
            return None  # what holds the rest is a running long request or a load in flight: both end
        req.host_kv = HostKV(np.concatenate([match.slots, tier.allocator.alloc(need)]), prefix, match.last_node)
        req.req_pool_idx = self.row_allocator.alloc()
        req.status = ReqStatus.RUNNING
        req.needs_worker_registration = True
        req.tree_len = prefix
        req.kv_len = len(fill)
        if req.cached_tokens is None:
            req.cached_tokens = prefix
            req.admitted_time = time.time()
            self.stats.cached_prompt_tokens += prefix
        self.stats.prefill_tokens_computed += len(fill) - prefix
        self.waiting.popleft()
        self.running.append(req)
        chunks = math.ceil((len(fill) - prefix) / self.chunk)
        self.prefill = self._new_job(True, [req], chunks, [prefix], [len(fill) - prefix], fill[prefix:])
        return self.prefill

    def _new_job(self, prefill: bool, reqs: list[Req], units_per_layer: int, prefix_lens, extend_lens, ids) -> Job:
        self.jobs += 1
        return Job(
            next(self._job_ids),
            prefill,
            reqs,
            units_per_layer,
            units_per_layer * self.num_layers,
            pack_i32([r.req_pool_idx for r in reqs]),
            pack_i32(prefix_lens),
            pack_i32(extend_lens),
            pack_i32(ids),
            self.chunk if prefill else 0,
        )

    def _scheduled(self, step: int, job: Job, first: int, n: int, last: bool) -> ScheduledBatch:
        new_requests, new_long = [], []
        if first == 0:
            for req in job.reqs:
                if req.needs_worker_registration:
                    new_requests.append(worker_request(req))
                    req.needs_worker_registration = False
                if not req.host_kv.sent:
                    new_long.append(LongRequest(req.req_pool_idx, req.host_kv.slots.tobytes()))
                    req.host_kv.sent = True
        b = len(job.reqs)
        batch = ForwardBatch(
            step=step,
            req_pool_indices=job.rows,
            prefix_lens=job.prefix_lens,
            extend_lens=job.extend_lens,
            input_ids=job.input_ids if first == 0 else b"",
            out_cache_loc=b"",
            sample_mask=bytes([last]) * b,
            new_requests=new_requests,
            long=LongWork(job.id, job.prefill, first, n, job.chunk_size, new_long),
        )
        self.stats.steps += 1
        if last:
            if job is self.decode:
                self.decode = None
            else:
                self.prefill = None
            for row in job.deferred_rows:
                self.row_allocator.free(row)
        return ScheduledBatch(batch, list(job.reqs), [last] * b, [False] * b)

    # ------------------------------------------------------------------ reports
    def info(self) -> dict:
        return {
            "long_running": len(self.running),
            "long_waiting": len(self.waiting),
            "long_jobs": self.jobs,
            "long_steps": self.steps,
            "long_max_decode_batch": self.max_decode_batch,
            "long_max_tokens": self.max_tokens(),
            "host_kv_owned": self.owned_host_slots(),
        }
