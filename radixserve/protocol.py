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


# ---------------------------------------------------------------- tokenizer <-> scheduler

class TokenizedRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: bytes  # int32 prompt tokens
    params: SamplingParams
    arrival_time: float


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class FlushCacheRequest(msgspec.Struct, tag=True):
    request_id: str


class ServerInfoRequest(msgspec.Struct, tag=True):
    request_id: str


TokenizerToScheduler = TokenizedRequest | AbortRequest | FlushCacheRequest | ServerInfoRequest


class RequestOutput(msgspec.Struct, array_like=True):
    """What one request got in one step: new tokens, and on its last output why it ended."""
    rid: str
    token_ids: bytes  # int32 new tokens (usually one)
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    matched_stop_token: int | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time: float | None  # seconds from arrival to admission, on the first output only


class SchedulerLoad(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_slots_used: int  # owned by requests or locked in the tree
    kv_slots_cached: int  # evictable cache
    kv_slots_total: int


class BatchOutput(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    load: SchedulerLoad


class FlushCacheResult(msgspec.Struct, tag=True):
    request_id: str
    success: bool
    message: str = ""


class ServerInfo(msgspec.Struct, tag=True):
    request_id: str
    info: dict[str, int | float | str | bool | None]


SchedulerToTokenizer = BatchOutput | FlushCacheResult | ServerInfo


# ---------------------------------------------------------------- every child -> launch.py

class ProcessReady(msgspec.Struct, tag=True):
    name: str  # "scheduler", "worker-0", "tokenizer"
    info: dict[str, int | float | str | bool | None] = {}


class ProcessFailed(msgspec.Struct, tag=True):
    name: str
    message: str


ChildToLauncher = ProcessReady | ProcessFailed
