"""Every message of the serving path that crosses a socket, in one place (the processes' supervision messages, to
launch.py and between nodes' launchers, are in radixserve/runtime/supervision_messages.py). msgspec msgpack only (no
pickle: a socket must never execute what it reads). Token ids and slot indices travel as packed int32 bytes, decoded
with numpy.frombuffer."""

from __future__ import annotations

import msgspec
import numpy as np

from radixserve.sampling import SamplingParams


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


# ---------------------------------------------------------------- scheduler -> workers


class ReusedSlots(msgspec.Struct, array_like=True):
    """Tokens a request holds without computing them this step: req_to_token[req_pool_idx, start:start+len(slots)]
    = slots. A cached prefix at admission, or a range re-pointed at the radix tree's copy after another request
    inserted the same tokens first (the duplicates were freed). The worker applies these with the new tokens'
    slots (out_cache_loc), in the same single write of req_to_token. source >= 0: the same start and slots as the
    batch's reused_slots[source] (slots empty here): a burst of requests over one cached system prompt sends its
    slots once, not once per request, and the worker copies that row's range on the device (batch_writes)."""

    req_pool_idx: int
    start: int
    slots: bytes
    source: int = -1


class WorkerRequest(msgspec.Struct, array_like=True):
    """Sent the first time a request occupies a row: what the sampler needs to know about it."""

    req_pool_idx: int
    params: SamplingParams
    # Tokens that penalties look at: outputs so far (non-empty after a retraction), plus the prompt when a
    # repetition penalty is asked for.
    penalty_prompt_ids: bytes = b""
    output_ids: bytes = b""


class PrefixGroups(msgspec.Struct, array_like=True):
    """Decodes of the batch that read a shared prefix together (scheduler_service/prefix_groups.py): group g's
    members hold the same KV slots for positions [0, prefix_lens[g]), readable through req_to_token row
    prefix_rows[g]. Per request of the batch, its group or -1, and where its own positions start (its group's
    prefix length, or 0). Only decodes are ever grouped."""

    prefix_lens: bytes  # int32 [G]
    prefix_rows: bytes  # int32 [G]
    req_group: bytes  # int32 [B]
    req_suffix_start: bytes  # int32 [B]


class LongRequest(msgspec.Struct, array_like=True):
    """A request served by layer-wise offload, sent with its first long step: host_slots[p] is the host KV slot of
    position p, for every position it may ever hold (prompt + max_tokens)."""

    req_pool_idx: int
    host_slots: bytes  # int32


class LongWork(msgspec.Struct, array_like=True):
    """The part of a job of layer-wise offload (--enable-layerwise-offload; scheduler_service/long_context.py,
    radixserve/worker/layerwise_offload.py) that one step runs: units [first_unit, first_unit + num_units). A
    prefill job is one request's new prompt tokens, unit = (layer, chunk of chunk_size tokens), layer-major; a
    decode job is one token for each request of the batch, unit = a layer. The batch's arrays describe the whole
    job (its input ids only in its first step) and it samples in its last step only."""

    job: int
    prefill: bool
    first_unit: int
    num_units: int
    chunk_size: int = 0
    new_requests: list[LongRequest] = []


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
    reused_slots: list[ReusedSlots] = []
    # Overlapped scheduling: >= 0 keeps this step's sampled tokens on the worker, the i-th at ring index
    # (future_token_base + i) % future_token_ring_size(...); a later batch's input id -(index + 1) stands for it.
    future_token_base: int = -1
    prefix_groups: PrefixGroups | None = None  # None: no decode shares a prefix (or the feature is off)
    # Host KV tier (--hicache-size; radixserve/cache/host_tier.py): int32 slot pairs, run before the forward, saves
    # first (device slot -> host slot), then loads (host slot -> device slot). Empty when there is nothing to copy.
    host_save_device_slots: bytes = b""
    host_save_host_slots: bytes = b""
    host_load_host_slots: bytes = b""
    host_load_device_slots: bytes = b""
    long: LongWork | None = None  # a step of layer-wise offload instead of the device KV pool (LongWork says how)


def future_token_ring_size(max_running_requests: int) -> int:
    """Ring of sampled tokens kept on the worker for overlapped scheduling: a placeholder of step N is read only by
    step N+1, so two steps' samples (at most one per row each) must never share an index."""
    return 2 * max_running_requests + 2


def future_token_placeholder(index: int) -> int:
    """The input id that stands for the token sampled into ring index `index` (negative: no real token is)."""
    return -(index + 1)


class Shutdown(msgspec.Struct, tag=True):
    reason: str = ""


# ---------------------------------------------------------------- worker rank 0 -> scheduler


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_ids: bytes  # int32 [k]
    top_logprobs: bytes  # float32 [k]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens computed in one step for one request that asked for them (params.prompt_logprobs):
    logprobs[j] is that of the token at prompt position start + j, given the tokens before it."""

    index: int  # the request's place in the step's batch
    start: int
    logprobs: list[TokenLogprobs]


class SampledTokens(msgspec.Struct, tag=True):
    step: int
    token_ids: bytes  # int32, one per request whose sample_mask was 1, in batch order
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    num_kv_slots: int
    context_len: int
    num_host_slots: int = 0  # host KV tier slots on this rank (--hicache-size), 0 when the tier is off


WorkerToScheduler = SampledTokens | WorkerReady
SchedulerToWorker = ForwardBatch | Shutdown


# ---------------------------------------------------------------- tokenizer <-> scheduler


class FromFrontEnd(msgspec.Struct, kw_only=True):
    """A message whose reply or outputs go back to the front end that sent it. With --api-server-count N the
    scheduler has one socket to each of the N HTTP processes (radixserve/runtime/ipc.py); front_end is the sender's
    index among them. Engine and the Dynamo worker are front end 0, the default. (Keyword-only, so that each
    message's own fields keep their positions.)"""

    front_end: int = 0


class TokenizedRequest(FromFrontEnd, tag=True):
    rid: str
    input_ids: bytes  # int32 prompt tokens
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # higher first, with --enable-priority-scheduling (scheduler_service/policy.py)
    cache_salt: str | None = None  # the tenant's cache namespace: prefixes are shared only within one salt
    dp_rank: int | None = None  # --dp-size > 1: the replica an outside router chose (Dynamo's), else the controller's


class TokenizedBatch(msgspec.Struct, tag=True):
    """Requests that arrive together (Engine.generate over a list of prompts) in one message: the scheduler takes
    them in one receive and can admit them into one step, where one message each reached it over ~12 ms for a burst
    of 128 (H100 host) and went out in three steps."""

    requests: list[TokenizedRequest]


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class FlushCacheRequest(FromFrontEnd, tag=True):
    request_id: str
    keep_pins: bool = True  # pinned prefixes survive a flush unless the caller asks to drop them


class ServerInfoRequest(FromFrontEnd, tag=True):
    request_id: str


class CacheStatsRequest(FromFrontEnd, tag=True):
    """The dashboard's question (GET /v1/cache/stats): answered with a CacheStats."""

    request_id: str


# Pinned prefixes (scheduler_service/cache_control.py; the routes are tokenizer_service/routes_cache.py).


class PinPrefixRequest(FromFrontEnd, tag=True):
    """Keep these tokens in the radix tree (computing them first if needed) until unpinned or ttl_seconds pass."""

    request_id: str
    input_ids: bytes  # int32
    cache_salt: str | None = None
    ttl_seconds: float | None = None


class UnpinPrefixRequest(FromFrontEnd, tag=True):
    request_id: str
    pin_id: str


class ListPinsRequest(FromFrontEnd, tag=True):
    request_id: str


TokenizerToScheduler = (
    TokenizedRequest
    | TokenizedBatch
    | AbortRequest
    | FlushCacheRequest
    | ServerInfoRequest
    | CacheStatsRequest
    | PinPrefixRequest
    | UnpinPrefixRequest
    | ListPinsRequest
)


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What one request got in one step: new tokens, and on its last output why it ended. (gc=False: the scheduler
    makes one per running request per step, and tracked they set off a young collection almost every step, ~30 us at
    256 running; none can be part of a cycle, as nothing it holds refers back to it.)"""

    rid: str
    token_ids: bytes  # int32 new tokens (usually one)
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    matched_stop: int | str | None  # the stop token id, or the stop string that matched
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time: float | None  # seconds from arrival to admission, on the first output only
    # params.prompt_logprobs: those of prompt positions 1.. (position 0 has none), on the output with the first token
    prompt_logprobs: list[TokenLogprobs | None] = []


class SchedulerLoad(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_slots_used: int  # owned by requests or locked in the tree
    kv_slots_cached: int  # evictable cache
    kv_slots_total: int


class BatchOutput(msgspec.Struct, tag=True):
    """One step's outputs for one front end: those of the requests it sent (one message per front end per step)."""

    outputs: list[RequestOutput]
    load: SchedulerLoad


class FlushCacheResult(msgspec.Struct, tag=True):
    request_id: str
    success: bool
    message: str = ""


class ServerInfo(msgspec.Struct, tag=True):
    request_id: str
    info: dict[str, int | float | str | bool | None]


class EngineFailed(msgspec.Struct, tag=True):
    """A child of launch.py died or hung: the tokenizer fails every request in flight with `reason` and answers
    /health with 503 from now on. Sent by the launcher to every front end on its scheduler_to_front_end socket (a
    PULL takes any number of PUSH peers), so it arrives in the loop that already ends requests."""

    reason: str


class CachedPrefix(msgspec.Struct, array_like=True):
    """One of the largest prefixes in the radix tree (RadixCache.largest_prefixes): the front end decodes
    first_tokens into the words the dashboard shows."""

    first_tokens: bytes  # int32, the prefix's first tokens (at most 32)
    num_tokens: int
    hits: int  # requests that matched or inserted it
    last_use: float  # wall clock, time.time()
    pinned: bool
    namespace: str | None  # the tenant's cache_salt; None for the shared cache


class CacheStats(msgspec.Struct, tag=True):
    """The scheduler's cache numbers (scheduler_service/cache_stats.py says what each is) and its largest
    prefixes, for /v1/cache/stats."""

    request_id: str
    numbers: dict[str, int | float | str | bool | None]
    largest_prefixes: list[CachedPrefix] = []


class PinEntry(msgspec.Struct, array_like=True):
    id: str
    cache_salt: str | None
    num_tokens: int
    created_at: float  # wall clock (time.time())
    expires_at: float | None
    replicas: list[int] = []  # --dp-size > 1: the replicas that hold it (scheduler_service/dp_pins.py)


class PinsReply(msgspec.Struct, tag=True):
    """The answer to any of the three pin requests. status is an HTTP status: 200, 404 (no such pin), 409 (over
    --max-pinned-tokens), 400 (a prompt that cannot be pinned). pins: the pin made, the one removed, or all."""

    request_id: str
    status: int
    message: str = ""
    pins: list[PinEntry] = []
    pinned_tokens: int = 0  # tokens held by pins after this request, each counted once


# ---------------------------------------------------------------- KV block events for Dynamo's router
# (scheduler_service/kv_events.py -> radixserve/dynamo/kv_publisher.py; only with --kv-events-block-size)


class KvBlocksStored(msgspec.Struct, array_like=True, tag=True):
    """Full blocks the radix tree now holds, in order: each the child of the one before it, the first the child of
    parent_hash (None: the first block of its namespace). A block's hash covers its namespace's salt and every token
    from the root to the block's end, so equal hashes mean equal prefixes."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: bytes  # int32, block_size tokens per block
    cache_salt: str | None


class KvBlocksRemoved(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]


class KvBlockEvents(msgspec.Struct, tag=True):
    """One scheduler's block events since its last report, in order (a flush is the removal of every block)."""

    dp_rank: int
    events: list[KvBlocksStored | KvBlocksRemoved]


SchedulerToTokenizer = (
    BatchOutput | FlushCacheResult | ServerInfo | EngineFailed | CacheStats | PinsReply | KvBlockEvents
)


# ---------------------------------------------------------------- data parallelism: scheduler -> dp controller
# (scheduler_service/cache_events.py, scheduler_service/dp_controller.py)


class CacheInserted(msgspec.Struct, tag=True):
    tokens: bytes  # int32: this sequence is now cached (every prefix of it too)


class CacheEvicted(msgspec.Struct, tag=True):
    path: bytes  # int32 tokens from the root to the evicted leaf's parent
    key: bytes  # int32 the leaf's own tokens, no longer cached


class CacheCleared(msgspec.Struct, tag=True):
    pass


class CacheEvents(msgspec.Struct, tag=True):
    """What one replica's radix tree gained and lost since its last report, in order: the DP controller replays
    them on its mirror of that tree, which so stays exact (only sent with --dp-size > 1)."""

    events: list[CacheInserted | CacheEvicted | CacheCleared]


ReplicaToController = BatchOutput | FlushCacheResult | ServerInfo | CacheEvents | CacheStats | PinsReply | KvBlockEvents
