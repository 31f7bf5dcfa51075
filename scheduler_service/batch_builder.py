"""A step's ForwardBatch, built from the (request, tokens to compute) entries that admission and the running
decodes gave it: new KV slots for those tokens, requests new to their row registered with the workers, cached
prefixes' slots to point rows at, and the decodes that read a shared prefix together (prefix_groups.py). A step of
the same decodes as the last one is that batch advanced as arrays instead (decode_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.protocol import ForwardBatch, PrefixGroups, ReusedSlots, WorkerRequest, pack_i32
from scheduler_service.decode_batch import DecodeBatch, DecodeStep
from scheduler_service.decode_grouper import DecodeGrouper
from scheduler_service.prefix_groups import PrefixGroup, group_tables
from scheduler_service.request import Req
from scheduler_service.scheduler_stats import SchedulerStats


@dataclass
class ScheduledBatch:
    batch: ForwardBatch
    reqs: list[Req]  # batch order
    samples: list[bool]  # per request: does it get a token this step
    prefills: list[bool]  # per request: did it compute prompt tokens (not a plain decode)
    decodes: DecodeStep | None = None  # a batch of decodes alone, kept as arrays (decode_batch.py)


class SentPrefixGroups(NamedTuple):
    """The decode groups of the last step that had any, and the message sent for them: while the same decodes sit
    in the same places of the batch, the next step sends the same message without building it again."""

    groups: list[PrefixGroup] | None  # DecodeGrouper.groups()'s list (the same object while nothing changed)
    first_decode: int  # the batch index of the first decode (group members are counted from there)
    message: PrefixGroups | None
    grouped_decodes: int  # decodes in a group
    tokens_saved: int  # tokens of KV per layer that grouping keeps from being read again


NO_GROUPS_SENT = SentPrefixGroups(None, 0, None, 0, 0)


def worker_request(req: Req) -> WorkerRequest:
    """What the workers need to sample for a request in its row: sent with its first batch there."""
    p = req.params
    return WorkerRequest(
        req_pool_idx=req.req_pool_idx,
        params=p,
        penalty_prompt_ids=req.prompt_ids.tobytes() if p.repetition_penalty != 1.0 else b"",
        output_ids=pack_i32(req.output_ids) if req.output_ids else b"",
    )


def shared_once(reused: list[ReusedSlots]) -> list[ReusedSlots]:
    """The batch's reused ranges with each distinct (start, slots) sent once; the others refer to it by index (the
    range it names sent with its slots: admission refers to a prefix it sent already, and stays so)."""
    first: dict[tuple[int, bytes], int] = {}
    out = []
    for i, r in enumerate(reused):
        if r.source >= 0:
            out.append(
                r if out[r.source].source < 0 else ReusedSlots(r.req_pool_idx, r.start, b"", out[r.source].source)
            )
            continue
        source = first.setdefault((r.start, r.slots), i)
        out.append(r if source == i else ReusedSlots(r.req_pool_idx, r.start, b"", source))
    return out


class BatchBuilder:
    def __init__(
        self,
        slot_allocator: TokenSlotAllocator,
        decode_batch: DecodeBatch,
        decode_grouper: DecodeGrouper | None,
        stats: SchedulerStats,
    ):
        """decode_batch: the running decodes as arrays, recorded here and advanced by advance_decodes();
        decode_grouper: None when decodes are never grouped; stats counts steps and tokens."""
        self.slot_allocator = slot_allocator
        self.decode_batch = decode_batch
        self.decode_grouper = decode_grouper
        self.stats = stats
        self._sent_groups = NO_GROUPS_SENT

    def advance_decodes(self, step: int) -> ScheduledBatch:
        """The batch build() would make for the last batch of decodes one token on, from that batch's arrays
        (for when DecodeBatch.continues())."""
        run = self.decode_batch.run
        new_slots = self.slot_allocator.alloc(len(run.reqs))
        prefix_lens, input_ids, decodes = self.decode_batch.advance(new_slots)
        batch = ForwardBatch(
            step=step,
            req_pool_indices=run.rows,
            prefix_lens=prefix_lens,
            extend_lens=run.ones,
            input_ids=input_ids,
            out_cache_loc=new_slots.tobytes(),
            sample_mask=run.sample_mask,
            prefix_groups=run.prefix_groups,
        )
        self.stats.steps += 1
        self.stats.incremental_decode_steps += 1
        self.stats.decode_tokens += len(run.reqs)
        self.stats.grouped_decodes += run.grouped_decodes
        self.stats.shared_prefix_tokens_saved += run.shared_prefix_tokens_saved
        return ScheduledBatch(batch, run.reqs, run.samples, run.prefills, decodes)

    def build(self, step: int, entries: list[tuple[Req, int]], reused: list[ReusedSlots]) -> ScheduledBatch:
        """entries: (request, tokens to compute), prefill chunks first, decodes last; the slots they need are free
        (admission and memory pressure made sure). reused: cached prefixes' slots for rows to point at."""
        total = sum(n for _, n in entries)
        new_slots = self.slot_allocator.alloc(total)
        assert new_slots is not None, "slots were ensured before building the batch"
        rows, prefix_lens, extend_lens, input_ids, samples = [], [], [], [], []
        decode_tokens: list[int] = []  # a run of decodes' tokens, packed into one array (not one per request)
        new_requests: list[WorkerRequest] = []
        offset = 0
        for req, n in entries:
            if req.needs_worker_registration:
                new_requests.append(worker_request(req))
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
                input_ids.append(np.asarray(req.fill_ids()[start : start + n], dtype=np.int32))
                req.slots[start : start + n] = new_slots[offset : offset + n]
            offset += n
            rows.append(req.req_pool_idx)
            prefix_lens.append(start)
            extend_lens.append(n)
            req.kv_len = start + n
            samples.append(req.kv_len == num_fill)
        if decode_tokens:
            input_ids.append(np.asarray(decode_tokens, dtype=np.int32))
        prefills = [not (n == 1 and r.output_ids) for r, n in entries]
        groups = self._prefix_groups(entries, prefills, rows)
        batch = ForwardBatch(
            step=step,
            req_pool_indices=pack_i32(rows),
            prefix_lens=pack_i32(prefix_lens),
            extend_lens=pack_i32(extend_lens),
            input_ids=np.concatenate(input_ids).tobytes(),
            out_cache_loc=new_slots.tobytes(),
            sample_mask=bytes(samples),
            new_requests=new_requests,
            reused_slots=shared_once(reused),
            prefix_groups=groups.message,
        )
        self.stats.steps += 1
        decode_tokens = prefills.count(False)
        self.stats.decode_tokens += decode_tokens
        self.stats.prefill_tokens_computed += total - decode_tokens
        reqs = [r for r, _ in entries]
        decodes = None
        if decode_tokens == len(entries) and all(samples):  # decodes alone: the next steps may advance them as arrays
            decodes = self.decode_batch.record(
                reqs, rows, [k + 1 for k in prefix_lens], groups.message, groups.grouped_decodes, groups.tokens_saved
            )
        else:
            self.decode_batch.clear()
        return ScheduledBatch(batch, reqs, samples, prefills, decodes)

    def _prefix_groups(self, entries, prefills: list[bool], rows: list[int]) -> SentPrefixGroups:
        """Which decodes read a shared prefix together this step (prefix_groups.py); NO_GROUPS_SENT for none.
        Decodes come last in a batch.

        A group's prefix stays in the tree while the step runs without a lock of its own: each member's lock on
        its last_node holds every node above it, the group's node included
        (tests/worker/test_shared_prefix_attention_exact.py)."""
        first_decode = len(prefills)
        while first_decode and not prefills[first_decode - 1]:  # where the worker's decode tail may start, or later
            first_decode -= 1
        if self.decode_grouper is None or len(prefills) - first_decode < 2:
            return NO_GROUPS_SENT
        groups = self.decode_grouper.groups([req for req, _ in entries[first_decode:]])
        if not groups:
            return NO_GROUPS_SENT
        sent = self._sent_groups
        if groups is not sent.groups or first_decode != sent.first_decode:  # else the same decodes in the same rows
            shifted = [g._replace(members=tuple(first_decode + m for m in g.members)) for g in groups]
            tables = group_tables(shifted, rows)
            message = PrefixGroups(
                prefix_lens=tables.group_prefix_lens.tobytes(),
                prefix_rows=tables.group_prefix_rows.tobytes(),
                req_group=tables.req_group.tobytes(),
                req_suffix_start=tables.req_suffix_start.tobytes(),
            )
            saved = sum((len(g.members) - 1) * g.prefix_len for g in groups)
            sent = self._sent_groups = SentPrefixGroups(groups, first_decode, message, len(tables.group_members), saved)
        self.stats.grouped_decodes += sent.grouped_decodes
        self.stats.shared_prefix_tokens_saved += sent.tokens_saved
        return sent
