"""A stand-in for the model in scheduler tests and benchmarks: no weights, deterministic tokens, and yet it reads
every token of every request's context through its own KV cache and req_to_token table.

Each step it keeps what a worker keeps: the token stored in each KV slot (from out_cache_loc) and req_to_token
(from the batch, the way the worker derives its writes). The token it "samples" is a hash of the whole context
read back through the table. So greedy outputs do not depend on batching, chunking, caching or retraction, while
any slip in slot bookkeeping (a wrong reused range, a slot freed while still referenced and then overwritten)
changes the output: tests compare against a reference run to catch it."""

from __future__ import annotations

from collections import deque

import numpy as np

from radixserve.protocol import ForwardBatch, SampledTokens, future_token_ring_size, unpack_i32

FIRST_TOKEN = 10  # sampled ids stay clear of the small ids tests use as EOS


class FakeExecutor:
    def __init__(
        self, num_kv_slots: int, max_running_requests: int, context_len: int, vocab_size: int = 1000, seed: int = 0
    ):
        self.vocab_size = vocab_size
        self.kv_tokens = np.full(num_kv_slots + 1, -1, dtype=np.int64)  # token whose KV each slot holds
        self.req_to_token = np.zeros((max_running_requests + 1, context_len), dtype=np.int64)
        self.weights = np.random.default_rng(seed).integers(1, 1 << 20, context_len, dtype=np.int64)
        self.batches: list[ForwardBatch] = []  # every batch launched, for tests that look at them
        self._done: deque[SampledTokens] = deque()
        # Sampled tokens kept for the overlapped loop's placeholders, as a worker keeps them on its device.
        self.future_tokens = np.full(future_token_ring_size(max_running_requests), -1, dtype=np.int64)

    def launch(self, batch: ForwardBatch) -> None:
        self.batches.append(batch)
        rows, prefix_lens = unpack_i32(batch.req_pool_indices), unpack_i32(batch.prefix_lens)
        extend_lens = unpack_i32(batch.extend_lens)
        input_ids, new_slots = unpack_i32(batch.input_ids), unpack_i32(batch.out_cache_loc)
        placeholders = input_ids < 0
        if placeholders.any():
            input_ids = input_ids.astype(np.int64)
            input_ids[placeholders] = self.future_tokens[-input_ids[placeholders] - 1]
        if (input_ids < 0).any():
            raise AssertionError("a placeholder input id refers to no sampled token")
        self.kv_tokens[new_slots] = input_ids
        offset = 0
        for row, start, n in zip(rows, prefix_lens, extend_lens):
            self.req_to_token[row, start : start + n] = new_slots[offset : offset + n]
            offset += n
        reused_slots = []
        for reused in batch.reused_slots:
            slots = unpack_i32(reused.slots) if reused.source < 0 else reused_slots[reused.source]
            reused_slots.append(slots)
            self.req_to_token[reused.req_pool_idx, reused.start : reused.start + len(slots)] = slots
        sampled = []
        for row, seq_len, samples in zip(rows, prefix_lens + extend_lens, batch.sample_mask):
            if samples:
                context = self.kv_tokens[self.req_to_token[row, :seq_len]]
                if (context < 0).any():
                    raise AssertionError(f"row {row} reads a KV slot nothing was written to")
                h = int(context @ self.weights[:seq_len])
                sampled.append(FIRST_TOKEN + h % (self.vocab_size - FIRST_TOKEN))
        if batch.future_token_base >= 0:
            ring = (batch.future_token_base + np.arange(len(sampled))) % len(self.future_tokens)
            self.future_tokens[ring] = sampled
        self._done.append(SampledTokens(step=batch.step, token_ids=np.asarray(sampled, dtype=np.int32).tobytes()))

    def collect(self) -> SampledTokens:
        return self._done.popleft()
