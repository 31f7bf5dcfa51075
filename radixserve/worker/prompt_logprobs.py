"""Logprobs of prompt tokens (SamplingParams.prompt_logprobs: /v1/completions with echo and logprobs), computed during
prefill from the hidden states of every position of the chunk, which the forward already holds.

The logprob of prompt token t is read from the logits at position t - 1. Within one chunk [s, s + n) the positions
s .. s + n - 2 therefore give the tokens s + 1 .. s + n - 1; the last position predicts the first token of the next
chunk, which this step does not see. Its log-softmax row is kept in the request's sampling state (the carry) until
the next chunk arrives: chunks of one request reach the worker in order, and a re-registered request (retracted,
re-admitted) starts with an empty state and a prompt computed from position 0 again. The last chunk's last position
predicts the first output token instead: that one is sampled, and its logprob is the output's own.

Only the rows of such requests go through the LM head a second time, in slices, so the [tokens, vocab] matrix of a
long prompt is never whole in memory."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers.sampler import SamplingRequestState
from radixserve.protocol import PromptLogprobs, TokenLogprobs

ROWS_PER_SLICE = 256  # positions whose full-vocabulary logprobs exist at once


def wants_prompt_logprobs(state: SamplingRequestState) -> bool:
    # A request with outputs is past its prompt (recomputed after a retraction): its prompt logprobs were sent.
    return state.params.prompt_logprobs is not None and state.num_outputs == 0


def _entries(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    top_vals = top_vals[:, :k].cpu().numpy().astype(np.float32)
    top_ids = top_ids[:, :k].cpu().numpy().astype(np.int32)
    return [
        TokenLogprobs(logprob=chosen[j], top_ids=top_ids[j].tobytes(), top_logprobs=top_vals[j].tobytes())
        for j in range(len(chosen))
    ]


def prompt_logprobs(
    model,
    hidden: torch.Tensor,
    input_ids: np.ndarray,
    states: list[SamplingRequestState | None],
    prefix_lens: np.ndarray,
    extend_lens: np.ndarray,
    extend_start: np.ndarray,
    sample_mask: np.ndarray,
) -> list[PromptLogprobs]:
    """For every request of the batch's extend part whose state wants prompt logprobs (states[i] None: not one of
    them): the logprobs of the prompt tokens this step makes known. hidden: [tokens, hidden] of every position."""
    out = []
    device = hidden.device
    for i, state in enumerate(states):
        if state is None or not wants_prompt_logprobs(state):
            continue
        k = state.params.prompt_logprobs
        start, n, prefix = int(extend_start[i]), int(extend_lens[i]), int(prefix_lens[i])
        ids = torch.from_numpy(input_ids[start : start + n].astype(np.int64)).to(device)
        entries: list[TokenLogprobs] = []
        first_position = prefix + 1
        carry = state.prompt_logprob_carry
        state.prompt_logprob_carry = None
        if carry is not None and carry[0] == prefix:  # the previous chunk's last row predicts this chunk's first id
            entries += _entries(carry[1].unsqueeze(0), ids[:1], k)
            first_position = prefix
        last_chunk = bool(sample_mask[i])
        rows = n - 1 if last_chunk else n  # the last chunk's last row predicts an output token
        for lo in range(0, rows, ROWS_PER_SLICE):
            hi = min(rows, lo + ROWS_PER_SLICE)
            logprobs = torch.log_softmax(model.compute_logits(hidden[start + lo : start + hi]).float(), dim=-1)
            known = min(hi, n - 1) - lo  # rows whose next token is in this chunk
            if known > 0:
                entries += _entries(logprobs[:known], ids[lo + 1 : lo + 1 + known], k)
            if not last_chunk and hi == n:
                state.prompt_logprob_carry = (prefix + n, logprobs[-1].clone())
        if entries:
            out.append(PromptLogprobs(index=i, start=first_position, logprobs=entries))
    return out
