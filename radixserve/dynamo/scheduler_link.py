"""The Dynamo worker's end of the scheduler's sockets: it takes the HTTP process's place (as Engine does), starts the
scheduler and workers through the launcher, and keeps them supervised.

One task reads everything the scheduler (or, with --dp-size > 1, the DP controller) sends: each RequestOutput goes
to its request's queue, replies to the control requests resolve their futures, KV block events go to the relay.
A thread runs the launcher's supervision; when a child dies or hangs, every request in flight ends with the reason
(EngineFailure) and on_failure is called, which shuts the Dynamo worker down: a worker without an engine must leave
discovery rather than take requests it cannot serve.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Callable

import zmq
import zmq.asyncio

from radixserve.config import ServerArgs
from radixserve.runtime.ipc import AsyncChannel
from radixserve.runtime.launcher import Launcher
from radixserve.protocol import (
    AbortRequest,
    BatchOutput,
    FlushCacheRequest,
    FlushCacheResult,
    KvBlockEvents,
    PinsReply,
    RequestOutput,
    SchedulerToTokenizer,
    ServerInfo,
    ServerInfoRequest,
    TokenizedRequest,
)

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 30.0


class EngineFailure:
    """Put on every open request's queue when the engine is gone."""

    def __init__(self, reason: str):
        self.reason = reason


class SchedulerLink:
    def __init__(self, args: ServerArgs):
        self.launcher = Launcher(args, serve_http=False)  # checks the flags and the model directory first
        self.on_kv_events: Callable[[KvBlockEvents], None] = lambda message: None
        self.on_failure: Callable[[str], None] = lambda reason: None
        self.ctx = zmq.asyncio.Context()
        endpoints = self.launcher.endpoints
        # Bound before the scheduler starts: its first messages must find us (a PUSH queues until then).
        self.from_scheduler = AsyncChannel(
            self.ctx, zmq.PULL, endpoints.scheduler_to_front_end(0), bind=True, recv_type=SchedulerToTokenizer
        )
        self.to_scheduler = AsyncChannel(self.ctx, zmq.PUSH, endpoints.tokenizer_to_scheduler, bind=False)
        self.streams: dict[str, asyncio.Queue] = {}
        self.replies: dict[str, asyncio.Future] = {}
        self.failure: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._supervisor: threading.Thread | None = None

    async def start(self) -> None:
        """Start the engine's processes and wait until every one is ready (minutes for a large model)."""
        self.loop = asyncio.get_running_loop()
        self._reader = asyncio.create_task(self._read())
        self.launcher.start()
        dead = await asyncio.to_thread(self.launcher.wait_until_ready)
        if dead is not None:
            raise RuntimeError(f"engine failed to start: {self.launcher.dead_child_message() or dead.name}")
        self._supervisor = threading.Thread(target=self._supervise, name="radixserve-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        dead = self.launcher.supervise()  # returns when a child died or hung, or when stop() asked it to
        if dead is not None:
            reason = f"the radixserve engine failed: {self.launcher.describe_death(dead)}"
            logger.error("%s", reason)
            self.loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        self.failure = reason
        for queue in self.streams.values():
            queue.put_nowait(EngineFailure(reason))
        for future in self.replies.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))
        self.on_failure(reason)

    async def _read(self) -> None:
        while True:
            message = await self.from_scheduler.recv_async()
            if isinstance(message, BatchOutput):
                for out in message.outputs:
                    queue = self.streams.get(out.rid)
                    if queue is not None:  # else aborted here already: late outputs are dropped
                        queue.put_nowait(out)
            elif isinstance(message, KvBlockEvents):
                self.on_kv_events(message)
            elif isinstance(message, (FlushCacheResult, ServerInfo, PinsReply)):
                future = self.replies.pop(message.request_id, None)
                if future is not None and not future.done():
                    future.set_result(message)

    # ------------------------------------------------------------------ requests
    def submit(self, request: TokenizedRequest) -> asyncio.Queue:
        """Queue a request; its RequestOutputs (or an EngineFailure) arrive on the returned queue."""
        queue: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        if self.failure is not None:
            queue.put_nowait(EngineFailure(self.failure))
            return queue
        self.streams[request.rid] = queue
        # Never blocks: no high-water mark on the PUSH (radixserve/runtime/ipc.py), so the future can be left alone.
        self.to_scheduler.send(request)
        return queue

    def finish(self, rid: str, abort: bool) -> None:
        """The request is over here; abort: it is not over in the scheduler (client gone), which frees its KV, and
        a generate() still waiting on its queue wakes to None."""
        queue = self.streams.pop(rid, None)
        if queue is not None and abort:
            queue.put_nowait(None)
            if self.failure is None:
                self.to_scheduler.send(AbortRequest(rid))

    async def ask(self, make_request: Callable[[str], object]):
        """Send a control request (flush, server info, pins) and wait for its reply."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        request_id = uuid.uuid4().hex
        future = self.loop.create_future()
        self.replies[request_id] = future
        self.to_scheduler.send(make_request(request_id))
        try:
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self.replies.pop(request_id, None)

    async def server_info(self) -> dict:
        return (await self.ask(ServerInfoRequest)).info

    async def flush_cache(self, keep_pins: bool = True) -> FlushCacheResult:
        return await self.ask(lambda request_id: FlushCacheRequest(request_id, keep_pins))

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        self.launcher.stop_requested = True  # ends supervise()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        if self._reader is not None:
            self._reader.cancel()
        self.from_scheduler.close()
        self.to_scheduler.close()
        self.launcher.stop()
        self.ctx.term()
