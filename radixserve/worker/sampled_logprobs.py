"""Logprobs of the sampled tokens (SamplingParams.logprobs): picked on the device right after sampling (pick), then,
once the step's copy to the host has landed, cut to each request's k as messages (entries).

Apart from model_runner.py because they are the two ends of one step's read-back (ModelRunner.sample ->
ModelRunner.finish_step) and functions of tensors and sampling states alone; prompt logprobs, computed from the
forward's hidden states instead, are radixserve/worker/prompt_logprobs.py's."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers.sampler import SamplingRequestState
from radixserve.protocol import TokenLogprobs


def pick(
    logprobs: torch.Tensor | None, tokens: torch.Tensor, states: list[SamplingRequestState]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """On the device: each row's logprob of its token and the top-k (k the largest any row asks for), or None."""
    if logprobs is None:
        return None
    k_max = max(s.params.logprobs or 0 for s in states)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logprobs.topk(max(k_max, 1), dim=-1)
    return chosen, top_vals.float(), top_ids.int()


def entries(logprobs: tuple | None, states: list[SamplingRequestState]) -> list[TokenLogprobs | None]:
    """pick's tensors, on the host now, as one entry a row: None for a row that asked for no logprobs."""
    if logprobs is None:
        return []
    chosen, top_vals, top_ids = (t.numpy() for t in logprobs)
    chosen = chosen.tolist()
    out = []
    for i, s in enumerate(states):
        k = s.params.logprobs
        if k is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                logprob=chosen[i],
                top_ids=top_ids[i, :k].tobytes(),
                top_logprobs=top_vals[i, :k].astype(np.float32).tobytes(),
            )
        )
    return out
