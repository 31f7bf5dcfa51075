"""Result handling: the sampled tokens of a step go to their requests, and "finished" is decided here and nowhere
else (stop token, stop string, length). A finished request's KV goes into the radix tree at once, so nothing is
computed past its end. Computed prompt chunks are inserted as they complete, so that requests arriving meanwhile
share them. Part of Scheduler (scheduler.py)."""

from __future__ import annotations

import struct
import time
from array import array
from operator import attrgetter

import msgspec
import numpy as np

from radixserve.protocol import RequestOutput, ReusedSlots, SampledTokens, unpack_i32
from scheduler_service.request import Req, ReqStatus

_status = attrgetter("status")
_INT32 = struct.Struct("=i")


class StepOutput(msgspec.Struct, gc=False):
    """What one step produced for one request. (A msgspec Struct for its speed alone: a step makes one per running
    request, and this constructs in half the time of a slotted dataclass, untracked by the garbage collector as it
    can hold no cycle. It never goes on a socket.)"""
    req: Req
    new_token_ids: list[int]
    new_logprobs: list = []
    finished: bool = False
    num_outputs: int | None = None  # the request's outputs so far (None: all of output_ids; aborts, errors)
    message: RequestOutput | None = None  # built with the step's results (decode batches); stale once finished

    def to_message(self) -> RequestOutput:
        if self.message is not None and not self.finished:
            return self.message
        req = self.req
        num_outputs = self.num_outputs
        if num_outputs is None:  # not counting placeholders of steps still in flight (an abort mid-step)
            num_outputs = len(req.output_ids)
            while num_outputs and req.output_ids[num_outputs - 1] < 0:
                num_outputs -= 1
        first = num_outputs == len(self.new_token_ids)
        token_ids = self.new_token_ids
        # The same int32 bytes as protocol.pack_i32, without a numpy array per request (one token: one struct call).
        token_bytes = _INT32.pack(token_ids[0]) if len(token_ids) == 1 else array("i", token_ids).tobytes()
        # Positional, in RequestOutput's field order (fixed: it is array_like on the wire), and a third of the cost
        # of keywords: the server builds one of these per running request and step. Prompt logprobs ride on the
        # output with the first token only.
        message = RequestOutput(
            req.rid, token_bytes, self.new_logprobs, self.finished, req.finish_reason if self.finished else None,
            req.matched_stop, req.error, len(req.prompt_ids), num_outputs, req.cached_tokens or 0,
            (req.admitted_time - req.arrival_time) if first and req.admitted_time else None)
        if first and req.prompt_logprobs and token_ids:
            message.prompt_logprobs = req.prompt_logprobs[1:]
        return message


class ResultsMixin:
    def process_results(self, scheduled, sampled: SampledTokens, output_index: list[int] | None = None) -> None:
        """Apply one step's sampled tokens (a ScheduledBatch and what the executor returned for it). What each
        request got is collected for take_outputs().

        output_index (overlapped loop): where each sampled token goes in its request's output_ids, over the
        placeholder put there at launch; a later placeholder (the step in flight now) may follow it. Without it
        (serial loop) each token is appended."""
        if (scheduled.decodes is not None and not sampled.logprobs and not sampled.prompt_logprobs
                and list(map(_status, scheduled.reqs)).count(ReqStatus.RUNNING) == len(scheduled.reqs)):
            return self._apply_decode_tokens(scheduled, sampled, output_index is not None)
        tokens = unpack_i32(sampled.token_ids).tolist()
        logprobs = sampled.logprobs
        for found in sampled.prompt_logprobs:  # params.prompt_logprobs: kept until the first token's output
            wanted = scheduled.reqs[found.index].prompt_logprobs
            if wanted is not None:
                end = min(len(wanted), found.start + len(found.logprobs))
                wanted[found.start:end] = found.logprobs[:max(0, end - found.start)]
        sample_index = 0
        now = time.time()
        running = ReqStatus.RUNNING
        outputs = self._outputs
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
            # Most tokens end nothing: test that cheaply before the full rules of _finish_reason.
            reason = None
            if (num_outputs >= p.max_new_tokens or req.stop_matcher is not None or token in self.eos_token_ids
                    or p.stop_token_ids or len(req.prompt_ids) + num_outputs >= self.context_len):
                reason = self._finish_reason(req, token, num_outputs)
            if reason is not None:
                self._end(req, reason, num_outputs)
                out.finished = True
            outputs.append(out)
        if output_index is None:
            self.decode_batch.sampled(scheduled.decodes, unpack_i32(sampled.token_ids))
        self._decay_new_token_ratio()

    def _apply_decode_tokens(self, scheduled, sampled: SampledTokens, overlapped: bool) -> None:
        """process_results for a batch of decodes alone (decode_batch.py) whose requests all still run and that
        asked for no logprobs: what the loop above does, with the finish rules only for the tokens that could end
        their request (DecodeBatch.may_finish), and each output's message built here from the run's lists."""
        decodes, reqs = scheduled.decodes, scheduled.reqs
        run = decodes.run
        tokens = unpack_i32(sampled.token_ids)
        token_list = tokens.tolist()
        num_outputs = decodes.num_outputs + 1  # each request's outputs with this token
        counts = num_outputs.tolist()
        if overlapped:  # over the placeholder put at launch (the place the loop above gets as output_index)
            for req, n, token in zip(reqs, counts, token_list):
                req.output_ids[n - 1] = token
        else:
            for req, token in zip(reqs, token_list):
                req.output_ids.append(token)
            self.decode_batch.sampled(decodes, tokens)
        # What StepOutput.to_message would build for a request that goes on: not its first output (a decode has
        # one already), so no queue time and no prompt logprobs; no stop matched and no error while it runs. The
        # step's outputs share one empty logprobs list (none asked for any; nothing appends to a message's).
        first = len(self._outputs)
        no_logprobs = []
        self._outputs += [
            StepOutput(req, [token], no_logprobs, False, n, RequestOutput(
                rid, packed, no_logprobs, False, None, None, None, prompt_tokens, n, cached, None))
            for req, token, n, packed, rid, prompt_tokens, cached in zip(
                reqs, token_list, counts, tokens.view("V4").tolist(), run.rids, run.prompt_tokens, run.cached_tokens)]
        for i in self.decode_batch.may_finish(decodes, tokens, num_outputs).tolist():
            reason = self._finish_reason(reqs[i], token_list[i], counts[i])
            if reason is not None:
                self._end(reqs[i], reason, counts[i])
                self._outputs[first + i].finished = True  # (to_message builds this one's message again)
        self._decay_new_token_ratio()

    def _end(self, req: Req, reason: str, num_outputs: int) -> None:
        """A running request ends with its num_outputs-th output. The step in flight may hold its next decode: that
        placeholder goes, and the slot the decode writes is in kv_len, so it is released with the rest (once)."""
        del req.output_ids[num_outputs:]
        self._stop_running(req)
        self._release(req, insert=True)
        self._finish(req, reason)

    def _decay_new_token_ratio(self) -> None:
        if self.new_token_ratio > self.args.min_new_token_ratio:
            self.new_token_ratio = max(self.args.min_new_token_ratio,
                                       self.new_token_ratio - self.args.new_token_ratio_decay)

    def cache_prompt_chunks(self, scheduled) -> None:
        """Overlapped loop: insert the prompt chunks of a step just launched, before its results exist. Safe because
        workers run steps in order: whoever reads these slots does so in a later step, after they are written."""
        if self.tree.disable or scheduled.decodes is not None:  # (decodes alone: no prompt chunk)
            return
        for req, prefill in zip(scheduled.reqs, scheduled.prefills):
            if prefill and req.status is ReqStatus.RUNNING:
                self._cache_chunk(req)

    def _finish_reason(self, req: Req, token: int, num_outputs: int) -> str | None:
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

    def _cache_chunk(self, req: Req) -> None:
        """Insert the computed part of a prompt (all chunks so far) so other requests can share it already, then
        point the request at the tree's own slots (another request may have inserted the same tokens first)."""
        if self.tree.disable:
            return
        fill = req.fill_ids()[:req.kv_len]
        self.tree.insert(fill, req.slots[:req.kv_len], namespace=req.cache_salt, priority=req.priority)
        match = self.tree.match_prefix(fill, namespace=req.cache_salt, priority=req.priority, record_hit=False)
        self._relock(req, match.last_node)
        changed = np.flatnonzero(match.slots != req.slots[:req.kv_len])
        if len(changed):
            lo, hi = int(changed[0]), int(changed[-1]) + 1
            req.slots[lo:hi] = match.slots[lo:hi]
            self._pending_reused_slots.append((req, ReusedSlots(req.req_pool_idx, lo, match.slots[lo:hi].tobytes())))
        req.tree_len = req.kv_len

    def _relock(self, req: Req, node) -> None:
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = node
