"""Result handling: the sampled tokens of a step go to their requests, and "finished" is decided here and nowhere
else (stop token, stop string, length). A finished request's KV goes into the radix tree at once, so nothing is
computed past its end. Computed prompt chunks are inserted as they complete, so that requests arriving meanwhile
share them."""

from __future__ import annotations

import time
from operator import attrgetter

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.protocol import RequestOutput, ReusedSlots, SampledTokens, unpack_i32
from scheduler_service.batch_builder import ScheduledBatch
from scheduler_service.decode_batch import DecodeBatch
from scheduler_service.endings import Endings
from scheduler_service.request import Req, ReqStatus
from scheduler_service.step_output import StepOutput

_status = attrgetter("status")


class ResultProcessor:
    """Applies each step's sampled tokens to its requests, ends those that finish, and keeps the computed prompt
    chunks in the tree."""

    def __init__(
        self,
        context_len: int,
        eos_token_ids: set[int],
        tree: RadixCache,
        decode_batch: DecodeBatch,
        endings: Endings,
        outputs: list[StepOutput],
    ):
        """decode_batch: the running decodes as arrays (their next inputs are this step's tokens); endings ends a
        finished request; outputs is the Scheduler's list of what requests got (appended to, never rebound)."""
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.tree = tree
        self.decode_batch = decode_batch
        self.endings = endings
        self.outputs = outputs
        # Reused-slot ranges decided after a step (chunk insertion), sent with the next batch.
        self._reused_slots: list[tuple[Req, ReusedSlots]] = []

    def take_reused_slots(self) -> list[ReusedSlots]:
        """The ranges re-pointed at the tree's slots since the last call, of requests still running."""
        reused = [r for req, r in self._reused_slots if req.status is ReqStatus.RUNNING]
        self._reused_slots = []
        return reused

    def decodes_alone(self, scheduled: ScheduledBatch, sampled: SampledTokens) -> bool:
        """A batch of decodes alone (decode_batch.py) whose requests all still run and that asked for no logprobs:
        its tokens can go through apply_decode_tokens."""
        return (
            scheduled.decodes is not None
            and not sampled.logprobs
            and not sampled.prompt_logprobs
            and list(map(_status, scheduled.reqs)).count(ReqStatus.RUNNING) == len(scheduled.reqs)
        )

    def apply(self, scheduled: ScheduledBatch, sampled: SampledTokens, output_index: list[int] | None) -> None:
        """Any step's tokens, request by request. output_index (overlapped loop): where each sampled token goes in
        its request's output_ids, over the placeholder put there at launch; a later placeholder (the step in flight
        now) may follow it. Without it (serial loop) each token is appended."""
        tokens = unpack_i32(sampled.token_ids).tolist()
        logprobs = sampled.logprobs
        for found in sampled.prompt_logprobs:  # params.prompt_logprobs: kept until the first token's output
            wanted = scheduled.reqs[found.index].prompt_logprobs
            if wanted is not None:
                end = min(len(wanted), found.start + len(found.logprobs))
                wanted[found.start : end] = found.logprobs[: max(0, end - found.start)]
        sample_index = 0
        now = time.time()
        running = ReqStatus.RUNNING
        outputs = self.outputs
        cache_chunks = output_index is None  # the overlapped loop caches them at launch (cache_prompt_chunks)
        for req, samples, prefill in zip(scheduled.reqs, scheduled.samples, scheduled.prefills):
            if not samples:
                if prefill and cache_chunks and req.status is running:
                    # Share computed prompt tokens at once: requests arriving meanwhile hit them in the tree.
                    self._cache_chunk(req)
                continue
            token = tokens[sample_index]
            logprob = logprobs[sample_index] if logprobs else None
            at = output_index[sample_index] if output_index is not None else None
            sample_index += 1
            if req.status is not running:
                # (The overlapped loop never retracts a request with a token in flight: it would be lost here.)
                assert at is None or req.status is ReqStatus.FINISHED, f"{req.rid} re-queued with a token in flight"
                if at is not None:
                    del req.output_ids[at:]  # aborted while in flight: its placeholders go, its token is dropped
                continue
            if at is None:
                req.output_ids.append(token)
            else:
                req.output_ids[at] = token
            if prefill and cache_chunks:
                self._cache_chunk(req)
            if logprob is not None:
                req.logprobs.append(logprob)
            if req.first_token_time is None:
                req.first_token_time = now
            num_outputs = len(req.output_ids) if at is None else at + 1
            out = StepOutput(req, [token], [logprob] if logprob is not None else [], False, num_outputs)
            p = req.params
            # Most tokens end nothing: test that cheaply before the full rules of finish_reason.
            reason = None
            if (
                num_outputs >= p.max_new_tokens
                or req.stop_matcher is not None
                or token in self.eos_token_ids
                or p.stop_token_ids
                or len(req.prompt_ids) + num_outputs >= self.context_len
            ):
                reason = self.finish_reason(req, token, num_outputs)
            if reason is not None:
                self.endings.end(req, reason, num_outputs)
                out.finished = True
            outputs.append(out)
        if output_index is None:
            self.decode_batch.sampled(scheduled.decodes, unpack_i32(sampled.token_ids))

    def apply_decode_tokens(self, scheduled: ScheduledBatch, sampled: SampledTokens, overlapped: bool) -> None:
        """apply() for a batch where decodes_alone(): what its loop does, with the finish rules only for the tokens
        that could end their request (DecodeBatch.may_finish), and each output's message built here from the run's
        lists."""
        decodes, reqs = scheduled.decodes, scheduled.reqs
        run = decodes.run
        tokens = unpack_i32(sampled.token_ids)
        token_list = tokens.tolist()
        num_outputs = decodes.num_outputs + 1  # each request's outputs with this token
        counts = num_outputs.tolist()
        if overlapped:  # over the placeholder put at launch (the place apply() gets as output_index)
            for req, n, token in zip(reqs, counts, token_list):
                req.output_ids[n - 1] = token
        else:
            for req, token in zip(reqs, token_list):
                req.output_ids.append(token)
            self.decode_batch.sampled(decodes, tokens)
        # What StepOutput.to_message would build for a request that goes on: not its first output (a decode has
        # one already), so no queue time and no prompt logprobs; no stop matched and no error while it runs. The
        # step's outputs share one empty logprobs list (none asked for any; nothing appends to a message's).
        first = len(self.outputs)
        no_logprobs = []
        self.outputs += [
            # RequestOutput's fields in order (positional: a third of the cost of keywords): rid, token_ids, logprobs,
            # finished, finish_reason, matched_stop, error, prompt_tokens, completion_tokens, cached_tokens, queue_time
            StepOutput(
                req,
                [token],
                no_logprobs,
                False,
                n,
                RequestOutput(rid, packed, no_logprobs, False, None, None, None, prompt_tokens, n, cached, None),
            )
            for req, token, n, packed, rid, prompt_tokens, cached in zip(
                reqs, token_list, counts, tokens.view("V4").tolist(), run.rids, run.prompt_tokens, run.cached_tokens
            )
        ]
        for i in self.decode_batch.may_finish(decodes, tokens, num_outputs).tolist():
            reason = self.finish_reason(reqs[i], token_list[i], counts[i])
            if reason is not None:
                self.endings.end(reqs[i], reason, counts[i])
                out = self.outputs[first + i]
                out.finished, out.message = True, None  # (to_message builds this one's message again)

    def finish_reason(self, req: Req, token: int, num_outputs: int) -> str | None:
        """Why the request ends with this token, its num_outputs-th output (sets matched_stop), or None. Stops are
        ignored below min_new_tokens; a stop wins over length when one token meets both."""
        p = req.params
        n = num_outputs
        out_of_length = n >= p.max_new_tokens or len(req.prompt_ids) + n >= self.context_len
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                req.matched_stop = token
                return "stop"
            if req.stop_matcher is not None:
                outputs = req.output_ids if n == len(req.output_ids) else req.output_ids[:n]
                matched = req.stop_matcher.find(outputs, final=out_of_length)
                if matched is not None:
                    req.matched_stop = matched
                    return "stop"
        return "length" if out_of_length else None

    def cache_prompt_chunks(self, scheduled: ScheduledBatch) -> None:
        """Overlapped loop: insert the prompt chunks of a step just launched, before its results exist. Safe because
        workers run steps in order: whoever reads these slots does so in a later step, after they are written."""
        if self.tree.disable or scheduled.decodes is not None:  # (decodes alone: no prompt chunk)
            return
        for req, prefill in zip(scheduled.reqs, scheduled.prefills):
            if prefill and req.status is ReqStatus.RUNNING:
                self._cache_chunk(req)

    def _cache_chunk(self, req: Req) -> None:
        """Insert the computed part of a prompt (all chunks so far) so other requests can share it already, then
        point the request at the tree's own slots (another request may have inserted the same tokens first)."""
        if self.tree.disable:
            return
        # What the tree holds already (slots[:tree_len], the path to last_node) is not walked again.
        start, end = req.tree_len, req.kv_len
        ours = req.slots[start:end]
        match = self.tree.insert_below(req.last_node, req.fill_ids()[start:end], ours, priority=req.priority)
        self.tree.inc_lock_ref(match.last_node)  # the request's lock moves down to the node it now ends at
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        changed = np.flatnonzero(match.slots != ours)
        if len(changed):
            lo, hi = int(changed[0]), int(changed[-1]) + 1
            ours[lo:hi] = match.slots[lo:hi]
            reused = ReusedSlots(req.req_pool_idx, start + lo, match.slots[lo:hi].tobytes())
            self._reused_slots.append((req, reused))
        req.tree_len = end
