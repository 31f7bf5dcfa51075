"""Continuous batching over a radix prefix cache.

Each step builds one ForwardBatch: one token for every decoding request, plus prefill chunks (the unfinished
chunked request first, then newly admitted ones) up to chunked_prefill_size. An executor (the worker processes,
an in-process ModelRunner, or a fake in tests) returns one sampled token per request that finished its prompt;
process_results appends it, decides whether the request is finished (stop token, stop string, length), and
releases finished requests into the radix tree. The step loop itself is scheduler_service/step_loop.py.

The concerns live in their own files, mixed into this class: admission.py (who starts), memory_pressure.py
(eviction, retraction, failing what can never fit), results.py (sampled tokens in, finishes, outputs out).

KV-slot accounting: every slot is free, cached in the tree (evictable or protected by a lock), or owned by a
running request (computed but not yet inserted). check_invariant() verifies free + cached + owned == total.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from radixserve.cache.host_tier import HostTier
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import ReqPoolAllocator, TokenSlotAllocator
from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, PrefixGroups, ReusedSlots, WorkerRequest, pack_i32
from scheduler_service.admission import AdmissionMixin
from scheduler_service.decode_batch import DecodeBatch, DecodeStep
from scheduler_service.long_context import LongContext
from scheduler_service.memory_pressure import MemoryPressureMixin
from scheduler_service.prefix_groups import DecodeGrouper, group_tables
from scheduler_service.request import Req, ReqStatus
from scheduler_service.results import ResultsMixin, StepOutput
from scheduler_service.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)

NO_CHUNKING = 1 << 60
_kv_len, _tree_len = attrgetter("kv_len"), attrgetter("tree_len")


@dataclass
class ScheduledBatch:
    batch: ForwardBatch
    reqs: list[Req]  # batch order
    samples: list[bool]  # per request: does it get a token this step
    prefills: list[bool]  # per request: did it compute prompt tokens (not a plain decode)
    decodes: DecodeStep | None = None  # a batch of decodes alone, kept as arrays (decode_batch.py)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    retractions: int = 0
    evicted_tokens: int = 0
    grouped_decodes: int = 0  # decode tokens whose attention read a shared prefix together with others
    shared_prefix_tokens_saved: int = 0  # tokens of KV per layer that grouping kept from being read again
    incremental_decode_steps: int = 0  # steps built by advancing the last batch of decodes (decode_batch.py)


class KVInvariantError(AssertionError):
    pass


def _shared_once(reused: list[ReusedSlots]) -> list[ReusedSlots]:
    """The batch's reused ranges with each distinct (start, slots) sent once; the others refer to it by index."""
    first: dict[tuple[int, bytes], int] = {}
    out = []
    for i, r in enumerate(reused):
        source = first.setdefault((r.start, r.slots), i)
        out.append(r if source == i else ReusedSlots(r.req_pool_idx, r.start, b"", source))
    return out


class Scheduler(AdmissionMixin, MemoryPressureMixin, ResultsMixin):
    def __init__(self, args: ServerArgs, num_kv_slots: int, context_len: int, eos_token_ids: list[int],
                 tokenizer=None, num_host_slots: int = 0, num_layers: int = 0):
        """tokenizer: a Hugging Face tokenizer, used only to match stop strings (requests with stop strings are
        refused without one). num_layers: the model's, for layer-wise offload's jobs."""
        self.args = args
        self.context_len = context_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.slot_allocator = TokenSlotAllocator(num_kv_slots)
        self.row_allocator = ReqPoolAllocator(args.max_running_requests)
        self.tree = RadixCache(self.slot_allocator, disable=args.disable_radix_cache,
                               eviction_policy=args.radix_eviction_policy)
        # The host KV tier (--hicache-size; num_host_slots from the workers): evicted prefixes kept in host memory.
        # Layer-wise offload keeps its long requests' KV there even without a radix cache (nothing stays then).
        self.host_tier = HostTier(self.tree, self.slot_allocator, num_host_slots, disable=args.disable_radix_cache) \
            if num_host_slots and (not args.disable_radix_cache or args.enable_layerwise_offload) else None
        # Requests longer than the device pool (--enable-layerwise-offload): their own queue and steps.
        self.long = LongContext(self, num_layers) if args.enable_layerwise_offload and self.host_tier else None
        # -1 (no chunking) becomes a budget no step reaches; config.py resolves the device default.
        self.chunked_prefill_size = args.chunked_prefill_size if args.chunked_prefill_size > 0 else NO_CHUNKING
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # hold a row: decoding, or prefilling in chunks
        # Overlapped loop: requests whose token in flight is certainly their last (length). They hold their row and
        # KV but take no further step; process_results ends them when that token arrives (set_aside_finishing).
        self.finishing: list[Req] = []
        self.requests: dict[str, Req] = {}
        self.new_token_ratio = args.init_new_token_ratio
        self.step_count = 0
        self.stats = SchedulerStats()
        self.check_invariant_every_step = False  # tests turn this on
        # What requests got since take_outputs() was last called: step results, aborts, admission errors.
        self._outputs: list[StepOutput] = []
        # Reused-slot ranges decided after a step (chunk insertion), sent with the next batch.
        self._pending_reused_slots: list[tuple[Req, ReusedSlots]] = []
        self.decode_grouper = None if args.disable_shared_prefix_attention or args.disable_radix_cache else \
            DecodeGrouper(args.shared_prefix_min_tokens)
        self._last_prefix_groups: tuple = (None, 0, None, 0, 0)  # (groups, first decode, message, grouped, saved)
        self.decode_batch = DecodeBatch(context_len, eos_token_ids, enabled=not args.disable_incremental_decode_batch)

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
        if self.long is not None and self.long.takes(req):
            self.long.check(req)
            req.offloaded = True
        if self.tree.pinned_size:
            # Pinned prefixes hold their slots for good: a request has the rest of the pool, plus what it shares of
            # them. Refused now rather than failed midway with a 500 once its KV no longer fits.
            room = self.slot_allocator.num_total - self.tree.pinned_size
            need = total - self.tree.pinned_prefix_len(req.prompt_ids, namespace=req.cache_salt)
            if need > room:
                raise ValueError(f"The KV cache holds {self.slot_allocator.num_total} tokens, of which "
                                 f"{self.tree.pinned_size} are pinned (POST /v1/cache/pin, --pin-prompts): this "
                                 f"request needs {need} more ({len(req.prompt_ids)} in the prompt, "
                                 f"{req.params.max_new_tokens} for the completion, less what it shares of the pinned "
                                 f"prefixes), above the {room} left.")
        if any(req.params.stop):
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer, and this scheduler was started without one")
            req.stop_matcher = StopStringMatcher(self.tokenizer, req.params.stop, req.params.skip_special_tokens)
        req.arrival_step = self.step_count
        self.requests[req.rid] = req
        (self.long.waiting if req.offloaded else self.waiting).append(req)

    def abort(self, rid: str) -> bool:
        """Stop a request in any state and free its KV without inserting it. False if unknown or finished."""
        req = self.requests.get(rid)
        if req is None:
            return False
        if req.status is ReqStatus.WAITING:
            (self.long.waiting if req.offloaded else self.waiting).remove(req)
        else:
            self._stop_running(req)
            self._release(req, insert=False)
        self._finish(req, "abort")
        self._outputs.append(StepOutput(req, [], finished=True))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finishing or self._outputs
                    or (self.long is not None and self.long.has_work()))

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.finishing) + (len(self.long.running) if self.long is not None else 0)

    def max_sequence_tokens(self) -> int:
        """The most tokens one sequence can hold here: the device pool's, or what layer-wise offload serves."""
        return self.long.max_tokens() if self.long is not None else self.slot_allocator.num_total

    def set_aside_finishing(self, reqs: list[Req]) -> None:
        """Overlapped loop: these requests' tokens in the step just launched end them by length whatever they are,
        so no later step computes for them (a max_tokens=1 request takes one forward, not two)."""
        if self.long is not None:
            reqs = self.long.set_aside(reqs)
        for req in reqs:
            req.finishing = True
        self.finishing += reqs
        self.running = [r for r in self.running if not r.finishing]

    def _stop_running(self, req: Req) -> None:
        if req.offloaded:
            return self.long.stop(req)
        (self.finishing if req.finishing else self.running).remove(req)
        req.finishing = False

    def take_outputs(self) -> list[StepOutput]:
        """Everything requests got since the last call, in order; the step loop calls it once per step."""
        outputs, self._outputs = self._outputs, []
        if self.check_invariant_every_step:
            self.check_invariant()
        return outputs

    def flush_cache(self, keep_pins: bool = True) -> bool:
        """Drop every cached prefix but the pinned ones (those too with keep_pins=False); only when idle."""
        if self.running or self.finishing or self.waiting or (self.long is not None and self.long.has_work()):
            return False
        self.tree.reset(keep_pins=keep_pins)
        if self.host_tier is not None:
            self.host_tier.reset(keep_pins=keep_pins)
        return True

    # ------------------------------------------------------------------ invariant
    def kv_usage(self) -> dict[str, int]:
        # Every step's load report asks this: two C-level sums instead of a property call per running request.
        owned = sum(map(_kv_len, self.running)) - sum(map(_tree_len, self.running))  # Req.owned_slots, summed
        if self.finishing:
            owned += sum(r.owned_slots for r in self.finishing)
        return {"total": self.slot_allocator.num_total, "free": self.slot_allocator.num_free,
                "evictable": self.tree.evictable_size, "protected": self.tree.protected_size, "owned": owned}

    def check_invariant(self, walk_tree: bool = False) -> None:
        """Slot and row accounting; walk_tree also audits every node of the radix tree (idle time and tests)."""
        u = self.kv_usage()
        if u["free"] + u["evictable"] + u["protected"] + u["owned"] != u["total"]:
            raise KVInvariantError(f"KV slot leak: free {u['free']} + evictable {u['evictable']} + protected "
                                   f"{u['protected']} + owned by requests {u['owned']} != total {u['total']}")
        if not self.num_running and self.tree.locked_size:  # (pinned tokens are protected too, and rightly so)
            raise KVInvariantError(f"{self.tree.locked_size} cached tokens still locked with no running request")
        if self.row_allocator.num_free + self.num_running != self.row_allocator.num_total:
            raise KVInvariantError(f"req_to_token rows leaked: {self.row_allocator.num_free} free + "
                                   f"{self.num_running} running != {self.row_allocator.num_total}")
        if walk_tree:
            try:
                self.tree.check_invariants()
            except AssertionError as e:
                raise KVInvariantError(f"radix tree bookkeeping: {e}") from e
        if self.host_tier is not None:  # host slots are a pool of their own: free + held on host == capacity
            try:
                long = self.long is not None and bool(self.long.running)
                self.host_tier.check_invariant(walk_tree, self.long.owned_host_slots() if long else 0, long)
            except AssertionError as e:
                raise KVInvariantError(f"host KV tier: {e}") from e

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, or None when nothing can run this step (then room is made or hopeless requests fail)."""
        self.step_count += 1
        if self.long is not None and self.long.turn(bool(self.running or self.waiting)):
            scheduled = self.long.schedule()  # a step of a request longer than the pool (long_context.py)
            if scheduled is not None:
                return scheduled
        reused = [r for req, r in self._pending_reused_slots if req.status is ReqStatus.RUNNING]
        self._pending_reused_slots = []
        if not reused and self._decodes_continue():
            return self._with_host_copies(self._build_decode_step())
        entries: list[tuple[Req, int]] = []  # (request, tokens to compute this step)
        if self.args.disable_mixed_batch:
            # Unmixed: a step is either all prefill or all decode; prefill goes first when there is any.
            entries = self._prefill_entries(self.chunked_prefill_size, [], reused)
        if not entries:
            decodes = self._make_room_for_decodes([r for r in self.running if r.is_decoding])
            if not self.args.disable_mixed_batch:
                entries = self._prefill_entries(self.chunked_prefill_size, decodes, reused)
            entries += [(r, 1) for r in decodes]
        if not entries:
            self.decode_batch.clear()
            self._unblock()
            return None
        return self._with_host_copies(self._build_batch(entries, reused))

    def _with_host_copies(self, scheduled: ScheduledBatch) -> ScheduledBatch:
        if self.host_tier is not None:
            self.host_tier.attach_copies(scheduled.batch)  # copies queued by this step's evictions and admissions
        return scheduled

    def _decodes_continue(self) -> bool:
        """The next step is the last batch of decodes one token on: the same requests running, none of them can
        need eviction or retraction, and no waiting request can start (no prefill either way)."""
        return (bool(self.running) and self.decode_batch.continues(self.running)
                and (not self.waiting or self.row_allocator.num_free == 0)
                and self.slot_allocator.num_free >= len(self.running))

    def _build_decode_step(self) -> ScheduledBatch:
        """The general path's batch for this step (_build_batch), built from the last one's arrays."""
        run = self.decode_batch.run
        new_slots = self.slot_allocator.alloc(len(run.reqs))
        prefix_lens, input_ids, decodes = self.decode_batch.advance(new_slots)
        batch = ForwardBatch(step=self.step_count, req_pool_indices=run.rows, prefix_lens=prefix_lens,
                             extend_lens=run.ones, input_ids=input_ids, out_cache_loc=new_slots.tobytes(),
                             sample_mask=run.sample_mask, prefix_groups=run.prefix_groups)
        self.stats.steps += 1
        self.stats.incremental_decode_steps += 1
        self.stats.decode_tokens += len(run.reqs)
        self.stats.grouped_decodes += run.grouped_decodes
        self.stats.shared_prefix_tokens_saved += run.shared_prefix_tokens_saved
        return ScheduledBatch(batch, run.reqs, run.samples, run.prefills, decodes)

    def _build_batch(self, entries: list[tuple[Req, int]], reused: list[ReusedSlots]) -> ScheduledBatch:
        total = sum(n for _, n in entries)
        new_slots = self.slot_allocator.alloc(total)
        assert new_slots is not None, "slots were ensured before building the batch"
        rows, prefix_lens, extend_lens, input_ids, samples = [], [], [], [], []
        decode_tokens: list[int] = []  # a run of decodes' tokens, packed into one array (not one per request)
        new_requests: list[WorkerRequest] = []
        offset = 0
        for req, n in entries:
            if req.needs_worker_registration:
                new_requests.append(self._worker_request(req))
                req.needs_worker_registration = False
            start = req.kv_len
            num_fill = req.num_fill
            if n == 1 and start == num_fill - 1 and req.output_ids:
                decode_tokens.append(req.output_ids[-1])  # a decode: skip building prompt + outputs
                req.slots[start] = new_slots[offset]
            else:
                if decode_tokens:
                    input_ids.append(np.asarray(decode_tokens, dtype=np.int32))
                    decode_tokens = []
                input_ids.append(np.asarray(req.fill_ids()[start:start + n], dtype=np.int32))
                req.slots[start:start + n] = new_slots[offset:offset + n]
            offset += n
            rows.append(req.req_pool_idx)
            prefix_lens.append(start)
            extend_lens.append(n)
            req.kv_len = start + n
            samples.append(req.kv_len == num_fill)
        if decode_tokens:
            input_ids.append(np.asarray(decode_tokens, dtype=np.int32))
        prefills = [not (n == 1 and r.output_ids) for r, n in entries]
        prefix_groups = self._prefix_groups(entries, prefills, rows)
        batch = ForwardBatch(
            step=self.step_count,
            req_pool_indices=pack_i32(rows), prefix_lens=pack_i32(prefix_lens), extend_lens=pack_i32(extend_lens),
            input_ids=np.concatenate(input_ids).tobytes(), out_cache_loc=new_slots.tobytes(),
            sample_mask=bytes(samples), new_requests=new_requests, reused_slots=_shared_once(reused),
            prefix_groups=prefix_groups)
        self.stats.steps += 1
        decode_tokens = prefills.count(False)
        self.stats.decode_tokens += decode_tokens
        self.stats.prefill_tokens_computed += total - decode_tokens
        reqs = [r for r, _ in entries]
        decodes = None
        if decode_tokens == len(entries) and all(samples):  # decodes alone: the next steps may advance them as arrays
            grouped, saved = self._last_prefix_groups[3:] if prefix_groups is not None else (0, 0)
            decodes = self.decode_batch.record(reqs, rows, [k + 1 for k in prefix_lens], prefix_groups, grouped, saved)
        else:
            self.decode_batch.clear()
        return ScheduledBatch(batch, reqs, samples, prefills, decodes)

    def _prefix_groups(self, entries, prefills: list[bool], rows: list[int]) -> PrefixGroups | None:
        """Which decodes read a shared prefix together this step (prefix_groups.py). Decodes come last in a batch.

        A group's prefix stays in the tree while the step runs without a lock of its own: each member's lock on
        its last_node holds every node above it, the group's node included (tests/test_shared_prefix_e2e.py)."""
        first_decode = len(prefills)
        while first_decode and not prefills[first_decode - 1]:  # where the worker's decode tail may start, or later
            first_decode -= 1
        if self.decode_grouper is None or len(prefills) - first_decode < 2:
            return None
        groups = self.decode_grouper.groups([req for req, _ in entries[first_decode:]])
        if not groups:
            return None
        last_groups, last_first, message, grouped, saved = self._last_prefix_groups
        if groups is not last_groups or first_decode != last_first:  # else the same decodes in the same rows
            shifted = [g._replace(members=tuple(first_decode + m for m in g.members)) for g in groups]
            tables = group_tables(shifted, rows)
            message = PrefixGroups(prefix_lens=tables.group_prefix_lens.tobytes(),
                                   prefix_rows=tables.group_prefix_rows.tobytes(), req_group=tables.req_group.tobytes(),
                                   req_suffix_start=tables.req_suffix_start.tobytes())
            grouped = len(tables.group_members)
            saved = sum((len(g.members) - 1) * g.prefix_len for g in groups)
            self._last_prefix_groups = (groups, first_decode, message, grouped, saved)
        self.stats.grouped_decodes += grouped
        self.stats.shared_prefix_tokens_saved += saved
        return message

    def _worker_request(self, req: Req) -> WorkerRequest:
        p = req.params
        return WorkerRequest(
            req_pool_idx=req.req_pool_idx, params=p,
            penalty_prompt_ids=req.prompt_ids.tobytes() if p.repetition_penalty != 1.0 else b"",
            output_ids=pack_i32(req.output_ids) if req.output_ids else b"")

    # ------------------------------------------------------------------ endings
    def _release(self, req: Req, insert: bool) -> None:
        """Give back the request's row and KV: inserted into the tree (finished) or freed (aborted, retracted)."""
        if req.offloaded:
            return self.long.release(req, insert)
        if insert and not self.tree.disable:
            # The last sampled token has no KV yet; everything before it does.
            fill = req.fill_ids()[:req.kv_len]
            self.tree.insert(fill, req.slots[:req.kv_len], namespace=req.cache_salt, priority=req.priority)
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
        self._outputs.append(StepOutput(req, [], finished=True))
        logger.warning("request %s failed: %s", req.rid, message)
