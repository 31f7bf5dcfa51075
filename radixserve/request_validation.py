"""Request validation, once for every front end: the HTTP routes and Engine.generate both call check_request
before anything is queued, so a bad request fails the same way (the HTTP routes turn InvalidRequest into a 400
in OpenAI error format; Engine raises it, a ValueError, to the caller).

What is checked here is what the request alone decides: its prompt ids lie in the vocabulary, prompt plus
completion fit the model's context and the KV pool's total size (a request larger than the pool could only be
admitted, grow, retract others and fail), the sampling parameters are in range. Whether the pool has room *now*
is the scheduler's concern (it queues the request until it has).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from radixserve.sampling import SamplingParams


class InvalidRequest(ValueError):
    """A request that can never run; `param` names the offending request field where one does (OpenAI's
    error.param), else None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def check_prompt_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """The prompt as a list of ints, or InvalidRequest if it is empty or holds an id outside the vocabulary."""
    if len(ids) == 0:
        raise InvalidRequest(f"{param} must not be empty (it tokenizes to no tokens)", param)
    if type(ids) is list and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        # A list of Python ints (a tokenizer's, most callers'): checked in C, with no array made. It is on a first
        # token's path: a 1,152-token prompt took 58 us through the array below on the 2-core CI box, 35 here (and
        # 250 us under cProfile on the H100 machine's slower host).
        return list(ids)
    try:
        array = np.asarray(ids, dtype=np.int64)
        outside = np.flatnonzero((array < 0) | (array >= vocab_size)).tolist()
    except OverflowError:  # an id beyond int64 (JSON integers are unbounded)
        outside = [i for i, token in enumerate(ids) if not 0 <= token < vocab_size]
    if outside:
        raise InvalidRequest(
            f"{param} contains token id {ids[outside[0]]}, outside the vocabulary [0, {vocab_size})", param
        )
    return [int(t) for t in ids]


def default_max_new_tokens(prompt_len: int, context_len: int) -> int:
    """The completion budget of a request that set none: the rest of the context (as OpenAI and vLLM do)."""
    if prompt_len >= context_len:
        raise InvalidRequest(
            f"This model's maximum context length is {context_len} tokens. However, your request "
            f"has {prompt_len} input tokens. Please reduce the length of the input messages."
        )
    return context_len - prompt_len


def check_context_length(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    if prompt_len + max_new_tokens > context_len:
        raise InvalidRequest(
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the messages, {max_new_tokens} "
            f"in the completion). Please reduce the length of the messages or completion."
        )


def check_kv_pool(prompt_len: int, max_new_tokens: int, kv_pool_tokens: int) -> None:
    """One sequence holds one KV slot per token; more tokens than the pool has slots can never be held at once."""
    if prompt_len + max_new_tokens > kv_pool_tokens:
        raise InvalidRequest(
            f"This server's KV cache holds at most {kv_pool_tokens} tokens per sequence (its KV pool, "
            f"or with --enable-layerwise-offload its host KV pool of --hicache-size). However, "
            f"you requested {prompt_len + max_new_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_new_tokens} in the completion). Please reduce the length of the prompt or "
            f"max_tokens.",
            "max_tokens",
        )


def check_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    context_len: int,
    param: str = "prompt",
    kv_pool_tokens: int | None = None,
) -> list[int]:
    """Everything a request must satisfy before it is queued; returns the prompt ids as a list of ints.
    kv_pool_tokens: the scheduler's total KV slots, once known (None skips that check)."""
    ids = check_prompt_ids(prompt_ids, vocab_size, param)
    check_params_and_length(ids, params, vocab_size, context_len, kv_pool_tokens)
    return ids


def check_params_and_length(
    ids: list[int], params: SamplingParams, vocab_size: int, context_len: int, kv_pool_tokens: int | None = None
) -> None:
    """check_request's checks after the prompt ids' own: for a front end that has checked the ids already."""
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    check_context_length(len(ids), params.max_new_tokens, context_len)
    if kv_pool_tokens is not None:
        check_kv_pool(len(ids), params.max_new_tokens, kv_pool_tokens)
