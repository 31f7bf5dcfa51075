"""Requests in flight between the HTTP handlers and the scheduler process.

One HTTP request becomes a RequestGroup of sequences (request_group.py): one per prompt and per choice (n), each a
separate scheduler request with rid f"{request_id}-{index}". A background task receives BatchOutputs from the
scheduler, turns each RequestOutput into text through the sequence's RequestPipeline (radixserve/request_pipeline.py,
the same code as Engine.generate) and puts the SequenceOutput into its group's queue, where the HTTP handler
(streaming or not) picks it up.

The scheduler decides when a sequence finishes (stop strings included). Only a client that disconnects, or an
engine that stops answering, ends a sequence here: it is finished for the client at once and an AbortRequest frees
it in the scheduler. Outputs that arrive for a sequence already finished here are dropped.

Sends never block: the PUSH socket has no high-water mark and is connected (ZeroMQ queues for a peer that is not up
yet), so a send on the zmq.asyncio socket completes immediately and the returned future can be ignored. That lets
abort() be a plain function, callable from disconnect callbacks and finally blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from radixserve.runtime.ipc import AsyncChannel, Endpoints
from radixserve.protocol import EngineFailed
from radixserve.protocol import CacheStats, CacheStatsRequest
from radixserve.protocol import ListPinsRequest, PinPrefixRequest, PinsReply, UnpinPrefixRequest
from radixserve.protocol import (
    AbortRequest,
    BatchOutput,
    FlushCacheRequest,
    FlushCacheResult,
    RequestOutput,
    SchedulerLoad,
    SchedulerToTokenizer,
    ServerInfo,
    ServerInfoRequest,
    TokenizedRequest,
    pack_i32,
)
from radixserve.request_pipeline import SequenceOutput
from radixserve.sampling import SamplingParams
from tokenizer_service.metrics import ServerMetrics
from tokenizer_service.request_group import RequestGroup, Sequence

logger = logging.getLogger(__name__)

# /health answers from memory when the scheduler spoke this recently, else it pings and waits this long.
HEALTH_FRESH_S = 1.0
HEALTH_TIMEOUT_S = 5.0
# With sequences in flight and the scheduler silent, ping it after STALL_PING_S; after ENGINE_DEAD_S without any
# message, fail every sequence in flight rather than let clients hang on an engine that is gone. A CPU step of a
# small model takes well under a second; the margin is for a long chunked prefill of a bigger model.
STALL_PING_S = 2.0
ENGINE_DEAD_S = 60.0


class EngineOverloaded(Exception):
    """More sequences in flight than --max-queued-requests allows (HTTP 503 + Retry-After)."""


class TooManySequences(Exception):
    """One request with more sequences than it could ever be given (HTTP 400: retrying cannot help)."""


class EngineUnavailable(Exception):
    """The server is shutting down or the engine stopped answering (HTTP 503)."""


class RequestManager:
    def __init__(
        self,
        tokenizer,
        endpoints: Endpoints,
        metrics: ServerMetrics,
        max_in_flight: int,
        engine_dead_s: float = ENGINE_DEAD_S,
        max_per_request: int | None = None,
        front_end: int = 0,
    ):
        """max_in_flight: --max-queued-requests; max_per_request: --max-sequences-per-request (None: no cap);
        front_end: this process's index among --api-server-count (every message says it, the scheduler answers on
        this front end's own socket)."""
        self.front_end = front_end
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._ttfts: list[float] = []  # per-token figures of the batch being handled (_on_batch)
        self._itls: list[float] = []
        self._tokens = 0
        self.max_in_flight = max_in_flight
        self.max_per_request = max_per_request
        self.engine_dead_s = engine_dead_s
        self._endpoints = endpoints
        self._sequences: dict[str, Sequence] = {}
        self._replies: dict[str, asyncio.Future] = {}  # request_id -> future of FlushCacheResult / ServerInfo
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.last_heard = time.monotonic()  # last message from the scheduler (or our start, for the watchdog)
        self.heard_from_scheduler = False
        self.latest_load: SchedulerLoad | None = None
        # The scheduler's total KV slots: a request longer than that is a 400 (request_validation.check_kv_pool).
        # None until the scheduler has answered; see _learn_kv_pool.
        self.kv_pool_tokens: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind and connect the scheduler sockets and start the receive loop (inside the running event loop)."""
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = AsyncChannel(self._ctx, zmq.PUSH, self._endpoints.tokenizer_to_scheduler, bind=False)
        self._from_scheduler = AsyncChannel(
            self._ctx,
            zmq.PULL,
            self._endpoints.scheduler_to_front_end(self.front_end),
            bind=True,
            recv_type=SchedulerToTokenizer,
        )
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="scheduler-receive"),
            asyncio.create_task(self._watchdog(), name="scheduler-watchdog"),
            asyncio.create_task(self._learn_kv_pool(), name="learn-kv-pool"),
        ]

    def begin_shutdown(self) -> None:
        """Refuse new requests and end the ones in flight with an error, so that no client waits on an engine
        that is about to go away (launch.py stops the tokenizer first)."""
        self._closing = True
        self.fail_all("The server is shutting down", status=503)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._to_scheduler.close()
        self._from_scheduler.close()
        self._ctx.term()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def num_in_flight(self) -> int:
        return len(self._sequences)

    # ------------------------------------------------------------------ submitting and aborting
    def submit(
        self,
        request_id: str,
        prompts: list[tuple[list[int], SamplingParams]],
        n: int = 1,
        arrival: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestGroup:
        """Send n sequences per prompt to the scheduler. With a seed, choice j samples with seed + j so that the
        n choices differ (one seed for all would give n identical samples)."""
        if self._closing:
            raise EngineUnavailable("The server is shutting down")
        wanted = len(prompts) * n
        # Limits one request can never meet are a 400; a full queue (503 + Retry-After) is only for a request that
        # would fit once others finish.
        if self.max_per_request is not None and wanted > self.max_per_request:
            raise TooManySequences(
                f"This request has {wanted} sequences ({len(prompts)} prompts x n={n}), more than the limit of "
                f"{self.max_per_request} per request (--max-sequences-per-request)."
            )
        if wanted > self.max_in_flight:
            raise TooManySequences(
                f"This request has {wanted} sequences ({len(prompts)} prompts x n={n}), more than this server ever "
                f"holds in flight ({self.max_in_flight}, --max-queued-requests)."
            )
        if self.num_in_flight + wanted > self.max_in_flight:
            raise EngineOverloaded(
                f"The server is overloaded: {self.num_in_flight} sequences in flight and this request adds "
                f"{wanted}, above the limit of {self.max_in_flight} (--max-queued-requests). Retry later."
            )
        self.metrics.api_server_requests.inc()
        arrival = time.monotonic() if arrival is None else arrival
        wall_arrival = time.time() - (time.monotonic() - arrival)
        group = RequestGroup(request_id, self)
        for prompt_index, (prompt_ids, params) in enumerate(prompts):
            for sample in range(n):
                if sample and params.seed is not None:
                    params_j = msgspec.structs.replace(params, seed=params.seed + sample)
                else:
                    params_j = params
                index = prompt_index * n + sample
                seq = Sequence(
                    f"{request_id}-{index}", index, prompt_index, prompt_ids, params_j, self.tokenizer, group, arrival
                )
                group.add(seq)
        for seq in group.sequences:
            self._sequences[seq.rid] = seq
            self._to_scheduler.send(
                TokenizedRequest(
                    seq.rid,
                    pack_i32(seq.prompt_ids),
                    seq.params,
                    wall_arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    front_end=self.front_end,
                )
            )
        self.metrics.num_requests_in_flight.set(self.num_in_flight)
        return group

    def abort_group(self, group: RequestGroup) -> None:
        for seq in group.sequences:
            if not seq.finished:
                self._end_locally(seq, seq.end("abort"))

    def fail_all(self, message: str, status: int = 503) -> None:
        for seq in list(self._sequences.values()):
            self._end_locally(seq, seq.end("error", message, status))

    def _end_locally(self, seq: Sequence, final: SequenceOutput) -> None:
        """Finish a sequence here and tell the scheduler to drop it (free its KV without caching it)."""
        self._to_scheduler.send(AbortRequest(seq.rid))
        self._finish(seq, final)

    def _finish(self, seq: Sequence, final: SequenceOutput) -> None:
        self._sequences.pop(seq.rid, None)
        self.metrics.num_requests_in_flight.set(self.num_in_flight)
        self.metrics.observe_finish(final.finish_reason or "unknown")
        if final.finish_reason in ("stop", "length"):
            self.metrics.e2e_latency.observe(time.monotonic() - seq.arrival)
        seq.group.deliver(final)

    # ------------------------------------------------------------------ scheduler replies
    async def _receive_loop(self) -> None:
        while True:
            message = await self._from_scheduler.recv_async()
            self.last_heard = time.monotonic()
            self.heard_from_scheduler = True
            try:
                if isinstance(message, BatchOutput):
                    self._on_batch(message)
                elif isinstance(message, (FlushCacheResult, ServerInfo, CacheStats, PinsReply)):
                    future = self._replies.pop(message.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, EngineFailed):  # from launch.py: a child died or hung
                    logger.error("%s", message.reason)
                    self._closing = True  # /health answers 503 and new requests are refused from now on
                    self.fail_all(message.reason, status=503)
            except Exception:  # noqa: BLE001 - one bad message must not stop every request's outputs
                logger.exception("failed to handle %s from the scheduler", type(message).__name__)

    def _on_batch(self, batch: BatchOutput) -> None:
        self.latest_load = batch.load
        self.metrics.update_load(batch.load)
        now = time.monotonic()
        # Per-token figures are gathered over the batch and recorded once (tokenizer_service/metrics.py).
        self._ttfts, self._itls, self._tokens = [], [], 0
        for out in batch.outputs:
            seq = self._sequences.get(out.rid)
            if seq is None:
                continue  # finished here already (disconnect, engine lost); the scheduler's late outputs are moot
            try:
                self._on_output(seq, out, now)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer failing on one sequence: fail just that one
                logger.exception("failed to process output of %s", out.rid)
                self._end_locally(seq, seq.end("error", f"internal error while detokenizing: {e}"))
        m = self.metrics
        m.time_to_first_token.observe_many(self._ttfts)
        m.inter_token_latency.observe_many(self._itls)
        if self._tokens:
            m.generation_tokens.inc(self._tokens)

    def _on_output(self, seq: Sequence, out: RequestOutput, now: float) -> None:
        m = self.metrics
        was_admitted = seq.admitted
        output = seq.process(out)
        if seq.admitted and not was_admitted:
            m.prompt_tokens.inc(len(seq.prompt_ids))
            m.cached_tokens.inc(seq.cached_tokens)
            if out.queue_time is not None:
                m.queue_time.observe(out.queue_time)
        if output.token_ids:
            if seq.last_token_at is None:
                self._ttfts.append(now - seq.arrival)
            else:
                self._itls.append(now - seq.last_token_at)
            seq.last_token_at = now
            self._tokens += len(output.token_ids)
        if output.finished:
            self._finish(seq, output)  # the scheduler has let go of it already
        else:
            seq.group.deliver(output)

    # ------------------------------------------------------------------ control requests
    async def _ask(self, message_type, timeout: float, **fields):
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._replies[request_id] = future
        try:
            self._to_scheduler.send(message_type(request_id, front_end=self.front_end, **fields))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._replies.pop(request_id, None)

    async def server_info(self, timeout: float = HEALTH_TIMEOUT_S) -> dict:
        """The scheduler's own numbers (num_running, num_waiting, kv_invariant_ok, kv_* ...). TimeoutError if
        it does not answer in time."""
        reply: ServerInfo = await self._ask(ServerInfoRequest, timeout)
        return dict(reply.info)

    async def _learn_kv_pool(self) -> None:
        """Ask the scheduler for its pool size once, at start. The question is the first message on the socket, so
        the scheduler answers it before any /health ping: by the time /health says 200 (and launch.py reports
        ready), requests are checked against the pool. A slow model load only means asking again."""
        while self.kv_pool_tokens is None and not self._closing:
            try:
                self.kv_pool_tokens = (await self.server_info()).get("kv_pool_tokens")
                return
            except asyncio.TimeoutError:
                continue

    async def flush_cache(self, timeout: float = HEALTH_TIMEOUT_S, keep_pins: bool = True) -> FlushCacheResult:
        return await self._ask(FlushCacheRequest, timeout, keep_pins=keep_pins)

    async def pin_prefix(
        self, input_ids: list[int], cache_salt: str | None, ttl_seconds: float | None, timeout: float
    ) -> PinsReply:
        """Pin a prefix (the scheduler computes it first if it is not cached: the reply can take a prefill)."""
        return await self._ask(
            PinPrefixRequest, timeout, input_ids=pack_i32(input_ids), cache_salt=cache_salt, ttl_seconds=ttl_seconds
        )

    async def unpin_prefix(self, pin_id: str, timeout: float = HEALTH_TIMEOUT_S) -> PinsReply:
        return await self._ask(UnpinPrefixRequest, timeout, pin_id=pin_id)

    async def list_pins(self, timeout: float = HEALTH_TIMEOUT_S) -> PinsReply:
        return await self._ask(ListPinsRequest, timeout)

    async def cache_stats(self, timeout: float = HEALTH_TIMEOUT_S) -> CacheStats:
        """The scheduler's cache numbers and largest prefixes (the dashboard's /v1/cache/stats)."""
        return await self._ask(CacheStatsRequest, timeout)

    async def is_healthy(self) -> bool:
        if self._closing:
            return False
        if self.heard_from_scheduler and time.monotonic() - self.last_heard < HEALTH_FRESH_S:
            return True
        try:
            await self.server_info(HEALTH_TIMEOUT_S)
            return True
        except (TimeoutError, asyncio.TimeoutError):
            return False

    async def _watchdog(self) -> None:
        """Ping a silent scheduler while sequences wait on it; fail them if it stays silent too long."""
        while True:
            await asyncio.sleep(min(1.0, STALL_PING_S / 2))
            if not self._sequences:
                continue
            silence = time.monotonic() - self.last_heard
            if silence > self.engine_dead_s:
                logger.error(
                    "no message from the scheduler for %.0f s; failing %d sequences", silence, len(self._sequences)
                )
                self.fail_all(f"The engine stopped responding (no message from the scheduler for {silence:.0f} s)")
            elif silence > STALL_PING_S:
                # Any reply counts as a sign of life (it updates last_heard); nobody waits on this one.
                self._to_scheduler.send(ServerInfoRequest(f"watchdog-{uuid.uuid4().hex}", front_end=self.front_end))
