"""Logits and sampling on the CPU in memory that stays put from one step to the next.

glibc serves every allocation above its mmap threshold (32 MiB at most) with a mapping of its own and hands it back to
the system when it is freed. A CPU worker's logits are [rows, vocab] (48 MiB in fp32 at 256 rows of a 49k
vocabulary) and sampling makes several more tensors of that size, so without this the worker's RSS rose and fell by
~100 MiB every step and its pages were faulted in, zeroed, again each time (bench/results/soak-cpu.md). Here the
logits go into one buffer that lives as long as the worker, and sampling walks them in blocks of rows small enough
that their temporaries come from the heap and are reused there. The GPU needs none of this: its caching allocator
keeps freed blocks, and one launch per op over the whole batch is what it wants.

--cpu-logits-block-mib 0 turns it off (the whole batch at once, fresh tensors every step)."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers.sampler import Sampler, SamplingRequestState

SORT_BYTES_PER_ENTRY = 4 + 8


class CpuLogits:
    def __init__(self, vocab_size: int, max_rows: int, block_mib: int, dtype: torch.dtype):
        # The widest temporary per vocabulary entry is top-k/top-p's sort: fp32 values and their int64 order.
        self.rows_per_block = max(1, (block_mib << 20) // (vocab_size * SORT_BYTES_PER_ENTRY))
        # Only the rows a step writes become resident; a batch never has more rows than running requests.
        self._buffer = torch.empty(max_rows, vocab_size, dtype=dtype)

    def compute(self, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden) ([rows, vocab]) in the kept buffer: valid until the next call."""
        if hidden.shape[0] > self._buffer.shape[0] or hidden.dtype != self._buffer.dtype:
            return lm_head(hidden)
        out = self._buffer[: hidden.shape[0]]
        torch.mm(hidden, lm_head.weight.t(), out=out)  # what lm_head's F.linear computes, written in place
        return out

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        rows: np.ndarray,
        states: list[SamplingRequestState],
        positions: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampler over logits[rows], one block of rows at a time: the same tokens as one call over all of them
        (every change the sampler makes to a row looks only at that row's request)."""
        want_logprobs = any(s.params.logprobs is not None for s in states)
        tokens, logprobs = [], []
        for start in range(0, len(rows), self.rows_per_block):
            block = rows[start : start + self.rows_per_block]
            first, last = int(block[0]), int(block[-1])
            # A run of consecutive rows is a view (the sampler may change it in place: the buffer is rewritten next
            # step); rows with gaps (prefill chunks that do not sample) are gathered into a small copy.
            part = logits[first : last + 1] if last - first + 1 == len(block) else logits[torch.from_numpy(block)]
            end = start + len(block)
            block_tokens, block_logprobs = sampler(
                part, states[start:end], positions[start:end], want_logprobs=want_logprobs
            )
            tokens.append(block_tokens)
            logprobs.append(block_logprobs)
        if len(tokens) == 1:
            return tokens[0], logprobs[0]
        return torch.cat(tokens), torch.cat(logprobs) if want_logprobs else None
