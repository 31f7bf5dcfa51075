"""The running decodes as arrays, carried from one step to the next (--disable-incremental-decode-batch turns it off).

Most steps of a busy server are the same requests each decoding one more token. Building that batch from every Req
(its row, kv_len and last output, each read and packed on its own) and applying its tokens with the full finish
rules one request at a time is per-request Python that grows with the batch: at 256 running it was most of the
scheduler's CPU time per step. So once a batch of decodes alone has been built the usual way, its numbers are kept as
arrays: rows, kv_lens, the next input ids, outputs so far, the length limits. While the running set is exactly those
requests, in the same order, the next batch is those arrays advanced by one with numpy, its tokens go to their
requests in one short loop, and one vectorised test picks the few tokens that could end their request; only those
meet the full finish rules (results.py, ResultProcessor.finish_reason). Any other step (an admission, a finish, an
abort, a retraction, reused slots to send) takes the general path (batch_builder.py), which records the arrays again
when it builds a batch of decodes alone.

The Req objects stay the truth: kv_len, slots and output_ids are written every step, so nothing else (aborts,
retraction, release into the tree, the general builder) needs to know this exists.

Why "the same requests in the same order" is enough: a request decoding in step N that is still running in step N+1
decodes again, because step N gave it exactly one more output (a placeholder under the overlapped loop, the real
token under the serial one); it stops running only through a finish, an abort or a retraction, and each of those
removes it from the running list, which the next step compares with the recorded requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.protocol import PrefixGroups


@dataclass(eq=False)
class DecodeRun:
    """What does not change while the running set stays the same: the requests, in batch order, and per request
    its row and which token counts or ids could end it."""

    reqs: list  # Req, batch order == scheduler.running
    rows: bytes  # int32 req_pool_indices
    ones: bytes  # int32 extend_lens
    sample_mask: bytes
    samples: list[bool]  # ScheduledBatch's lists: all True, all False (read only)
    prefills: list[bool]
    limits: np.ndarray  # int64: a request is out of length when its outputs reach this
    always_check: np.ndarray  # bool: stop strings or stop token ids; every token goes through the full rules
    prefix_groups: PrefixGroups | None
    grouped_decodes: int
    shared_prefix_tokens_saved: int
    # Per request, what its output messages repeat (results.py builds them without reading every request).
    rids: list[str]
    prompt_tokens: list[int]
    cached_tokens: list[int]


@dataclass(eq=False)
class DecodeStep:
    """One batch of decodes alone, as its results need it: the run, and each request's outputs before its sample."""

    run: DecodeRun
    num_outputs: np.ndarray  # int64


class DecodeBatch:
    def __init__(self, context_len: int, eos_token_ids, enabled: bool = True):
        self.enabled = enabled
        self.context_len = context_len
        # is_eos[token] for tokens up to the largest EOS id; the last entry (False) stands for every larger token.
        eos = list(eos_token_ids)
        self.is_eos = np.zeros(max(eos, default=-1) + 2, dtype=bool)
        self.is_eos[eos] = True
        self.run: DecodeRun | None = None
        self.step: DecodeStep | None = None  # the last batch built, while it is a batch of decodes alone
        self.kv_lens = np.empty(0, dtype=np.int32)  # after the last batch: the next batch's prefix_lens
        self.num_outputs = np.empty(0, dtype=np.int64)  # before the last batch's sample
        # The next batch's input ids: the last batch's placeholders (overlapped) or sampled tokens (serial), once known.
        self.next_input_ids: np.ndarray | None = None

    def clear(self) -> None:
        self.run = self.step = self.next_input_ids = None

    def continues(self, running: list) -> bool:
        """True when the next batch is one more token for each request of the last batch, and nothing else."""
        return self.next_input_ids is not None and self.run.reqs == running

    def record(
        self,
        reqs: list,
        rows: list[int],
        kv_lens: list[int],
        prefix_groups: PrefixGroups | None,
        grouped: int,
        saved: int,
    ) -> DecodeStep | None:
        """Keep a batch of decodes alone that the general path just built (kv_lens: after it)."""
        if not self.enabled or not reqs:
            self.clear()
            return None
        n = len(reqs)
        prompt_tokens = [len(req.prompt_ids) for req in reqs]
        self.run = DecodeRun(
            reqs=list(reqs),
            rows=np.asarray(rows, dtype=np.int32).tobytes(),
            ones=np.ones(n, dtype=np.int32).tobytes(),
            sample_mask=bytes([1]) * n,
            samples=[True] * n,
            prefills=[False] * n,
            limits=np.minimum([r.params.max_new_tokens for r in reqs], self.context_len - np.asarray(prompt_tokens)),
            always_check=np.asarray([req.stop_matcher is not None or bool(req.params.stop_token_ids) for req in reqs]),
            prefix_groups=prefix_groups,
            grouped_decodes=grouped,
            shared_prefix_tokens_saved=saved,
            rids=[req.rid for req in reqs],
            prompt_tokens=prompt_tokens,
            cached_tokens=[req.cached_tokens or 0 for req in reqs],
        )
        self.kv_lens = np.asarray(kv_lens, dtype=np.int32)
        self.num_outputs = np.asarray([len(req.output_ids) for req in reqs], dtype=np.int64)
        self.next_input_ids = None
        self.step = DecodeStep(self.run, self.num_outputs)
        return self.step

    def advance(self, new_slots: np.ndarray) -> tuple[bytes, bytes, DecodeStep]:
        """The next batch's prefix_lens and input ids (bytes) for continues() == True, its new slots written to the
        requests; the arrays move on by one token."""
        prefix_lens = self.kv_lens
        for req, slot, kv_len in zip(self.run.reqs, new_slots.tolist(), prefix_lens.tolist()):
            req.slots[kv_len] = slot
            req.kv_len = kv_len + 1
        input_ids = self.next_input_ids.astype(np.int32, copy=False).tobytes()
        self.next_input_ids = None
        self.kv_lens = prefix_lens + 1
        self.num_outputs = self.num_outputs + 1
        self.step = DecodeStep(self.run, self.num_outputs)
        return prefix_lens.tobytes(), input_ids, self.step

    def placeholders(self, step: DecodeStep, placeholders: np.ndarray) -> list[int] | None:
        """Overlapped loop: give each request of this step (the last built) its placeholder output. Returns where
        each sample goes in its request's output_ids; None when `step` is not a recorded batch of decodes."""
        if step is None or step is not self.step:
            return None
        for req, placeholder in zip(step.run.reqs, placeholders.tolist()):
            req.output_ids.append(placeholder)
        self.next_input_ids = placeholders
        return step.num_outputs.tolist()

    def sampled(self, step: DecodeStep, tokens: np.ndarray) -> None:
        """Serial loop: this step's tokens are the next step's inputs."""
        if step is not None and step is self.step:
            self.next_input_ids = tokens

    def may_finish(self, step: DecodeStep, tokens: np.ndarray, num_outputs: np.ndarray) -> np.ndarray:
        """Indices of the tokens that could end their request (num_outputs: each one's outputs with it); every other
        token ends nothing, whatever the full rules say (ResultProcessor.finish_reason)."""
        run = step.run
        maybe = (num_outputs >= run.limits) | run.always_check
        maybe |= self.is_eos[np.minimum(tokens, len(self.is_eos) - 1)]  # (np.isin costs more than all of this)
        return np.flatnonzero(maybe)
