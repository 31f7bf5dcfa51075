"""Continuous batching over a radix prefix cache.

Each step builds one ForwardBatch: one token for every decoding request, plus prefill chunks (the unfinished
chunked request first, then newly admitted ones) up to chunked_prefill_size. An executor (the worker processes,
an in-process ModelRunner, or a fake in tests) returns one sampled token per request that finished its prompt;
process_results appends it, decides whether the request is finished (stop token, stop string, length), and
releases finished requests into the radix tree. The step loop itself is scheduler_service/step_loop.py.

The Scheduler owns the state (the radix tree and host tier, the KV slot and req_to_token row allocators, the waiting
queue, the running batch, the outputs not yet taken) and hands each component what it works on when it builds it:
  Admission (admission.py)            who starts this step, and with how many prompt tokens
  MemoryPressure (memory_pressure.py) room in the KV pool: eviction, retraction, failing what can never fit
  BatchBuilder (batch_builder.py)     the step's ForwardBatch from admission's and the decodes' entries
  ResultProcessor (results.py)        sampled tokens in, finishes decided, outputs out
  Endings (endings.py)                a request's row and KV given back, and its end
  LongContext (long_context.py)       requests longer than the KV pool (--enable-layerwise-offload)
The waiting queue, running batch and finishing list are shared with the components that move requests between them,
so they are changed in place and never rebound.

KV-slot accounting: every slot is free, cached in the tree (evictable or protected by a lock), or owned by a
running request (computed but not yet inserted). check_invariant() verifies free + cached + owned == total.
"""

from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter

from radixserve.cache.host_tier import HostTier
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import ReqPoolAllocator, TokenSlotAllocator
from radixserve.config import ServerArgs
from radixserve.protocol import SampledTokens
from scheduler_service.admission import Admission
from scheduler_service.batch_builder import BatchBuilder, ScheduledBatch
from scheduler_service.decode_batch import DecodeBatch
from scheduler_service.decode_grouper import DecodeGrouper
from scheduler_service.endings import Endings
from scheduler_service.long_context import LongContext
from scheduler_service.memory_pressure import MemoryPressure, NewTokenRatio
from scheduler_service.request import Req, ReqStatus
from scheduler_service.results import ResultProcessor
from scheduler_service.scheduler_stats import SchedulerStats
from scheduler_service.step_output import StepOutput
from scheduler_service.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)

NO_CHUNKING = 1 << 60
_kv_len, _tree_len = attrgetter("kv_len"), attrgetter("tree_len")


class KVInvariantError(AssertionError):
    pass


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        num_kv_slots: int,
        context_len: int,
        eos_token_ids: list[int],
        tokenizer=None,
        num_host_slots: int = 0,
        num_layers: int = 0,
    ):
        """tokenizer: a Hugging Face tokenizer, used only to match stop strings (requests with stop strings are
        refused without one). num_layers: the model's, for layer-wise offload's jobs."""
        self.args = args
        self.context_len = context_len
        self.tokenizer = tokenizer
        self.slot_allocator = TokenSlotAllocator(num_kv_slots)
        self.row_allocator = ReqPoolAllocator(args.max_running_requests)
        self.tree = RadixCache(
            self.slot_allocator, disable=args.disable_radix_cache, eviction_policy=args.radix_eviction_policy
        )
        # The host KV tier (--hicache-size; num_host_slots from the workers): evicted prefixes kept in host memory.
        # Layer-wise offload keeps its long requests' KV there even without a radix cache (nothing stays then).
        self.host_tier = (
            HostTier(self.tree, self.slot_allocator, num_host_slots, disable=args.disable_radix_cache)
            if num_host_slots and (not args.disable_radix_cache or args.enable_layerwise_offload)
            else None
        )
        # -1 (no chunking) becomes a budget no step reaches; config.py resolves the device default.
        self.chunked_prefill_size = args.chunked_prefill_size if args.chunked_prefill_size > 0 else NO_CHUNKING
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # hold a row: decoding, or prefilling in chunks
        # Overlapped loop: requests whose token in flight is certainly their last (length). They hold their row and
        # KV but take no further step; process_results ends them when that token arrives (set_aside_finishing).
        self.finishing: list[Req] = []
        self.requests: dict[str, Req] = {}  # every request not finished, by rid
        # What requests got since take_outputs() was last called: step results, aborts, admission errors.
        self.outputs: list[StepOutput] = []
        self.step_count = 0
        self.stats = SchedulerStats()
        self.check_invariant_every_step = False  # tests turn this on
        self.new_token_ratio = NewTokenRatio(args)
        self.decode_batch = DecodeBatch(context_len, eos_token_ids, enabled=not args.disable_incremental_decode_batch)
        # Requests longer than the device pool (--enable-layerwise-offload): their own queue and steps.
        self.long = (
            LongContext(args, context_len, num_kv_slots, self.host_tier, self.row_allocator, self.stats, num_layers)
            if args.enable_layerwise_offload and self.host_tier
            else None
        )

        self.endings = Endings(
            self.tree,
            self.slot_allocator,
            self.row_allocator,
            self.long,
            self.running,
            self.finishing,
            self.requests,
            self.outputs,
        )
        self.memory_pressure = MemoryPressure(
            args,
            self.chunked_prefill_size,
            self.tree,
            self.slot_allocator,
            self.waiting,
            self.running,
            self.finishing,
            self.endings,
            self.new_token_ratio,
            self.stats,
        )
        self.admission = Admission(
            args,
            context_len,
            self.tree,
            self.host_tier,
            self.slot_allocator,
            self.row_allocator,
            self.waiting,
            self.running,
            self.memory_pressure,
            self.new_token_ratio,
            self.stats,
        )
        grouper = (
            None
            if args.disable_shared_prefix_attention or args.disable_radix_cache
            else DecodeGrouper(args.shared_prefix_min_tokens)
        )
        self.batch_builder = BatchBuilder(self.slot_allocator, self.decode_batch, grouper, self.stats)
        self.result_processor = ResultProcessor(
            context_len, set(eos_token_ids), self.tree, self.decode_batch, self.endings, self.outputs
        )

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, or None when nothing can run this step (then room is made or hopeless requests fail)."""
        self.step_count += 1
        if self.long is not None and self.long.turn(bool(self.running or self.waiting)):
            scheduled = self.long.schedule(self.step_count)  # a step of a request longer than the pool
            if scheduled is not None:
                return scheduled
        reused = self.result_processor.take_reused_slots()  # rows re-pointed at the tree's slots: sent with this batch
        if not reused and self._decodes_continue():
            return self._with_host_copies(self.batch_builder.advance_decodes(self.step_count))
        entries: list[tuple[Req, int]] = []  # (request, tokens to compute this step)
        if self.args.disable_mixed_batch:
            # Unmixed: a step is either all prefill or all decode; prefill goes first when there is any.
            entries = self.admission.prefill_entries(self.chunked_prefill_size, [], reused, self.step_count)
        if not entries:
            decodes = self.memory_pressure.make_room_for_decodes([r for r in self.running if r.is_decoding])
            if not self.args.disable_mixed_batch:
                entries = self.admission.prefill_entries(self.chunked_prefill_size, decodes, reused, self.step_count)
            entries += [(r, 1) for r in decodes]
        if not entries:
            self.decode_batch.clear()
            self.memory_pressure.unblock(self.step_count)
            return None
        return self._with_host_copies(self.batch_builder.build(self.step_count, entries, reused))

    def process_results(
        self, scheduled: ScheduledBatch, sampled: SampledTokens, output_index: list[int] | None = None
    ) -> None:
        """Apply one step's sampled tokens (what the executor returned for `scheduled`); what each request got is
        collected for take_outputs(). output_index (overlapped loop): where each token goes in its request's
        output_ids, over the placeholder put there at launch; without it (serial loop) each token is appended."""
        if self.result_processor.decodes_alone(scheduled, sampled):
            self.result_processor.apply_decode_tokens(scheduled, sampled, overlapped=output_index is not None)
        else:
            self.result_processor.apply(scheduled, sampled, output_index)
        self.new_token_ratio.decay()

    def cache_prompt_chunks(self, scheduled: ScheduledBatch) -> None:
        """Overlapped loop: the prompt chunks of a step just launched go into the tree before its results exist."""
        self.result_processor.cache_prompt_chunks(scheduled)

    def room_for_every_running_request(self) -> bool:
        """True when free + evictable slots cover every running request's next tokens: then schedule() can neither
        retract nor fail a request (the overlapped loop asks before scheduling with a step in flight)."""
        room = self.slot_allocator.num_free + self.tree.evictable_size
        if room >= len(self.running) + self.chunked_prefill_size:
            return True  # the cheap common case: decodes need one slot each, prefills at most a chunk in all
        if self.decode_batch.continues(self.running):
            return room >= len(self.running)  # every running request decodes: one slot each, nothing to retract
        return room >= sum(r.num_pending for r in self.running)

    def _with_host_copies(self, scheduled: ScheduledBatch) -> ScheduledBatch:
        if self.host_tier is not None:
            self.host_tier.attach_copies(scheduled.batch)  # copies queued by this step's evictions and admissions
        return scheduled

    def _decodes_continue(self) -> bool:
        """The next step is the last batch of decodes one token on: the same requests running, none of them can
        need eviction or retraction, and no waiting request can start (no prefill either way)."""
        return (
            bool(self.running)
            and self.decode_batch.continues(self.running)
            and (not self.waiting or self.row_allocator.num_free == 0)
            and self.slot_allocator.num_free >= len(self.running)
        )

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Req) -> None:
        """Queue a request. Raises ValueError for one that can never run (the front end returns it as a 400)."""
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if len(req.prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"This model's maximum context length is {self.context_len} tokens. However, you "
                f"requested {total} tokens ({len(req.prompt_ids)} in the prompt, "
                f"{req.params.max_new_tokens} for the completion)."
            )
        if self.long is not None and self.long.takes(req):
            self.long.check(req)
            req.offloaded = True
        if self.tree.pinned_size:
            # Pinned prefixes hold their slots for good: a request has the rest of the pool, plus what it shares of
            # them. Refused now rather than failed midway with a 500 once its KV no longer fits.
            room = self.slot_allocator.num_total - self.tree.pinned_size
            need = total - self.tree.pinned_prefix_len(req.prompt_ids, namespace=req.cache_salt)
            if need > room:
                raise ValueError(
                    f"The KV cache holds {self.slot_allocator.num_total} tokens, of which "
                    f"{self.tree.pinned_size} are pinned (POST /v1/cache/pin, --pin-prompts): this "
                    f"request needs {need} more ({len(req.prompt_ids)} in the prompt, "
                    f"{req.params.max_new_tokens} for the completion, less what it shares of the pinned "
                    f"prefixes), above the {room} left."
                )
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
            self.endings.stop_running(req)
            self.endings.release(req, insert=False)
        self.endings.finish(req, "abort")
        self.outputs.append(StepOutput(req, [], finished=True))
        return True

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.finishing
            or self.outputs
            or (self.long is not None and self.long.has_work())
        )

    @property
    def num_running(self) -> int:
        return self.endings.num_running()

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
        self.running[:] = [r for r in self.running if not r.finishing]  # (in place: the components hold this list)

    def take_outputs(self) -> list[StepOutput]:
        """Everything requests got since the last call, in order; the step loop calls it once per step."""
        outputs = self.outputs.copy()  # (emptied in place: the components append to this list)
        self.outputs.clear()
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
        return {
            "total": self.slot_allocator.num_total,
            "free": self.slot_allocator.num_free,
            "evictable": self.tree.evictable_size,
            "protected": self.tree.protected_size,
            "owned": owned,
        }

    def check_invariant(self, walk_tree: bool = False) -> None:
        """Slot and row accounting; walk_tree also audits every node of the radix tree (idle time and tests)."""
        u = self.kv_usage()
        if u["free"] + u["evictable"] + u["protected"] + u["owned"] != u["total"]:
            raise KVInvariantError(
                f"KV slot leak: free {u['free']} + evictable {u['evictable']} + protected "
                f"{u['protected']} + owned by requests {u['owned']} != total {u['total']}"
            )
        if not self.num_running and self.tree.locked_size:  # (pinned tokens are protected too, and rightly so)
            raise KVInvariantError(f"{self.tree.locked_size} cached tokens still locked with no running request")
        if self.row_allocator.num_free + self.num_running != self.row_allocator.num_total:
            raise KVInvariantError(
                f"req_to_token rows leaked: {self.row_allocator.num_free} free + "
                f"{self.num_running} running != {self.row_allocator.num_total}"
            )
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
