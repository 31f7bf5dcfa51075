"""Every message that crosses a socket, in one place. msgspec msgpack only (no pickle: a socket must never execute
what it reads). Token ids and slot indices travel as packed int32 bytes, decoded with numpy.frombuffer."""

from __future__ import annotations

import msgspec
import numpy as np

from radixserve.sampling import SamplingParams


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


# ---------------------------------------------------------------- scheduler -> workers

class RowWrite(msgspec.Struct, array_like=True):
    """req_to_token[req_pool_idx, start:start+len(slots)] = slots (a cached prefix, or a rewrite after insertion)."""
    req_pool_idx: int
    start: int
    slots: bytes


class WorkerRequest(msgspec.Struct, array_like=True):
    """Sent the first time a request occupies a row: what the sampler needs to know about it."""
    req_pool_idx: int
    params: SamplingParams
    # Tokens that penalties look at: outputs so far (non-empty after a retraction), plus the prompt when a
    # repetition penalty is asked for.
    penalty_prompt_ids: bytes = b""
    output_ids: bytes = b""


class ForwardBatch(msgspec.Struct, tag=True):
    """One step's batch. Per request: its row, how many tokens are already cached, its new tokens and their slots."""
    step: int
    req_pool_indices: bytes  # int32 [B]
    prefix_lens: bytes  # int32 [B]
    extend_lens: bytes  # int32 [B]
    input_ids: bytes  # int32 [sum(extend_lens)]
    out_cache_loc: bytes  # int32 [sum(extend_lens)]
    sample_mask: bytes  # uint8 [B]: 0 for a prefill chunk that is not the prompt's last (nothing to sample)
    new_requests: list[WorkerRequest] = []
    row_writes: list[RowWrite] = []


class Shutdown(msgspec.Struct, tag=True):
    reason: str = ""


# ---------------------------------------------------------------- worker rank 0 -> scheduler

class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_ids: bytes  # int32 [k]
    top_logprobs: bytes  # float32 [k]


class SampledTokens(msgspec.Struct, tag=True):
    step: int
    token_ids: bytes  # int32, one per request whose sample_mask was 1, in batch order
    logprobs: list[TokenLogprobs | None] = []


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    num_kv_slots: int
    context_len: int
    max_running_requests: int


class WorkerError(msgspec.Struct, tag=True):
    rank: int
    message: str


WorkerToScheduler = SampledTokens | WorkerReady | WorkerError
SchedulerToWorker = ForwardBatch | Shutdown
