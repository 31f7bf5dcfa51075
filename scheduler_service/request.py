"""A request as the scheduler sees it: tokens, KV slots, its lock in the radix tree, and timestamps."""

from __future__ import annotations

import time
from enum import Enum

import numpy as np

from radixserve.sampling import SamplingParams


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds a req_to_token row; prefilling (in chunks) or decoding
    FINISHED = "finished"


class Req:
    def __init__(self, rid: str, prompt_ids, params: SamplingParams, arrival_time: float | None = None):
        self.rid = rid
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        self.params = params
        self.output_ids: list[int] = []
        self.status = ReqStatus.WAITING

        # KV bookkeeping. Token i of fill_ids (prompt + outputs) lives in slots[i] for i < kv_len.
        # slots[:tree_len] belong to the radix tree (protected by our lock on last_node); slots[tree_len:kv_len]
        # are this request's own and must be freed or inserted when it ends.
        capacity = len(self.prompt_ids) + params.max_new_tokens
        self.slots = np.zeros(capacity, dtype=np.int32)
        self.kv_len = 0
        self.tree_len = 0
        self.last_node = None
        self.req_pool_idx: int | None = None
        # True until the worker has been told this request's sampling params for its current row.
        self.needs_worker_registration = True
        # Overlapped loop: the token in flight is this request's last (Scheduler.set_aside_finishing).
        self.finishing = False
        # Longer than the device KV pool: served by layer-wise offload (long_context.py), its KV in host memory.
        self.offloaded = False
        self.host_kv = None  # long_context.HostKV while it runs
        # The tenant's namespace in the radix tree: its prefixes are matched and inserted there only (None: shared).
        self.cache_salt: str | None = None
        # Admission order under --enable-priority-scheduling: higher first, within the aging bound (policy.py).
        self.priority = 0
        # The front end that sent it (--api-server-count): its outputs go back to that one only.
        self.front_end = 0
        # params.prompt_logprobs: per prompt position, its TokenLogprobs once computed (position 0 has none).
        self.prompt_logprobs: list | None = (
            [None] * len(self.prompt_ids) if params.prompt_logprobs is not None else None
        )

        self.cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None  # the stop token, or the stop string
        self.stop_matcher = None  # a StopStringMatcher when the request has stop strings
        self.error: str | None = None
        self.retractions = 0
        self.logprobs: list = []

        self.arrival_time = arrival_time or time.time()
        self.arrival_step = 0
        self.admitted_time: float | None = None
        self.first_token_time: float | None = None

    # ------------------------------------------------------------------ derived
    @property
    def num_fill(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def fill_ids(self) -> np.ndarray:
        """Every token whose KV the request needs: prompt + outputs so far."""
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, np.asarray(self.output_ids, dtype=np.int32)])

    @property
    def num_pending(self) -> int:
        """Tokens still to be computed before the next sample."""
        return self.num_fill - self.kv_len

    @property
    def is_decoding(self) -> bool:
        # num_pending == 1 written out: every step asks this of every running request, twice.
        outputs = len(self.output_ids)
        return outputs > 0 and self.status is ReqStatus.RUNNING and len(self.prompt_ids) + outputs - self.kv_len == 1

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def owned_slots(self) -> int:
        return self.kv_len - self.tree_len

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.status.value}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"kv={self.kv_len}, tree={self.tree_len})"
        )
