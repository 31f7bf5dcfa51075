"""The scheduler process: requests in from the tokenizer, batches out to every worker rank, sampled tokens back
from rank 0, per-request outputs back to the tokenizer. Its tokenizer is used only to decide stop strings.

With --api-server-count N there are N tokenizer processes (front ends): they all send on one socket, and each has
its own socket back. A request's outputs, and the reply to a control message, go to the front end that sent it
(FromFrontEnd.front_end): one BatchOutput per front end per step."""

from __future__ import annotations

import logging
import time

import zmq

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.runtime.heartbeat import progress
from radixserve.runtime.ipc import Channel, Endpoints
from radixserve.protocol import (
    AbortRequest,
    BatchOutput,
    CacheStatsRequest,
    FlushCacheRequest,
    FlushCacheResult,
    SchedulerLoad,
    ServerInfo,
    ServerInfoRequest,
    Shutdown,
    TokenizedBatch,
    TokenizedRequest,
    TokenizerToScheduler,
    WorkerReady,
    WorkerToScheduler,
    unpack_i32,
)
from radixserve.protocol import ListPinsRequest, PinPrefixRequest, PinsReply, UnpinPrefixRequest
from radixserve.tokenizer_loading import load_tokenizer
from scheduler_service.cache_control import CacheControl
from scheduler_service.cache_events import CacheEventLog
from scheduler_service.cache_stats import cache_numbers, cache_stats
from scheduler_service.kv_events import KvBlockLog, Listeners
from scheduler_service.executor import WorkerProcessesExecutor
from scheduler_service.request import Req
from scheduler_service.scheduler import KVInvariantError, Scheduler
from scheduler_service.step_loop import make_step_loop
from scheduler_service.step_output import StepOutput, per_front_end

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
INVARIANT_CHECK_INTERVAL_S = 5.0


class SchedulerProcess:
    def __init__(self, args: ServerArgs, model_dir: str, endpoints: Endpoints):
        self.args = args
        ctx = zmq.Context()
        self.from_tokenizer = Channel(
            ctx, zmq.PULL, endpoints.tokenizer_to_scheduler, bind=True, recv_type=TokenizerToScheduler
        )
        self.to_front_ends = [
            Channel(ctx, zmq.PUSH, endpoints.scheduler_to_front_end(i), bind=False)
            for i in range(args.api_server_count)
        ]
        self.to_workers = [
            Channel(ctx, zmq.PUSH, endpoints.scheduler_to_worker(r), bind=True) for r in range(args.tp_size)
        ]
        self.from_workers = Channel(
            ctx, zmq.PULL, endpoints.workers_to_scheduler, bind=True, recv_type=WorkerToScheduler
        )
        # Loaded while the workers load their weights, so it adds nothing to start-up.
        tokenizer = load_tokenizer(args.tokenizer or model_dir)
        ready = self._wait_for_workers()
        model_config = ModelConfig.from_dir(model_dir)
        self.scheduler = Scheduler(
            args,
            ready.num_kv_slots,
            ready.context_len,
            model_config.eos_token_ids,
            tokenizer,
            num_host_slots=ready.num_host_slots,
            num_layers=model_config.num_layers,
        )
        # Overlapped unless --disable-overlap-schedule: step N+1 goes out before step N's tokens are applied.
        spin_s = args.spin_wait_ms / 1e3
        executor = WorkerProcessesExecutor(self.to_workers, self.from_workers, spin_s)
        self.loop = make_step_loop(self.scheduler, executor)
        # --spin-wait-ms: the first wait for requests after a step polls without sleeping for up to spin_s (a
        # request that follows a finished one is taken at once); an idle scheduler sleeps in the poll.
        self.spin_s = spin_s
        self.spin_next_wait = False
        self.cache_control = CacheControl(self.scheduler, args.max_pinned_tokens)  # pinned prefixes
        self.pin_askers: dict[str, int] = {}  # request_id -> front end, of pins whose prefix is being computed
        self.last_invariant_check = 0.0
        self.invariant_ok = True
        # --dp-size > 1: the DP controller mirrors this tree from its insert/evict events.
        self.cache_events = CacheEventLog() if args.dp_size > 1 else None
        # --kv-events-block-size: the tree as KV block events for Dynamo's router (the DP controller sets dp_rank).
        self.kv_events = KvBlockLog(args.kv_events_block_size, 0) if args.kv_events_block_size else None
        listeners = [log for log in (self.cache_events, self.kv_events) if log is not None]
        self.scheduler.tree.listener = Listeners(*listeners) if len(listeners) > 1 else next(iter(listeners), None)

    def _wait_for_workers(self) -> WorkerReady:
        readies = []
        while len(readies) < self.args.tp_size:
            message = self.from_workers.recv()
            if isinstance(message, WorkerReady):
                readies.append(message)
        return min(readies, key=lambda r: r.num_kv_slots)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while True:
            self._receive_requests(block=not self.loop.has_work())
            if self.loop.has_work():
                # schedule -> batch to every rank -> (overlapped: the previous step's) tokens -> process_results
                progress.begin()  # launch.py's watchdog times each step (radixserve/runtime/heartbeat.py)
                outputs = self.loop.step()
                # Prefixes computed for a pin are pinned here; their requests' outputs are not the front end's.
                outputs, pin_replies = self.cache_control.take_outputs(outputs)
                self._send_pin_replies(pin_replies)
                self._report_cache_events()  # before the outputs: a request's end must not precede its prefix
                self._send_outputs(outputs)
                progress.end()
                self.spin_next_wait = True
            else:
                self._check_invariant_at_idle()
            self.cache_control.expire()  # pins past their TTL

    def _receive_requests(self, block: bool) -> None:
        if block:
            spin_s, self.spin_next_wait = (self.spin_s if self.spin_next_wait else 0.0), False
            message = self.from_tokenizer.recv(IDLE_POLL_MS, spin_s)
        else:
            message = self.from_tokenizer.recv_nowait()
        while message is not None:
            self._handle(message)
            message = self.from_tokenizer.recv_nowait()

    def _handle(self, message) -> None:
        if isinstance(message, TokenizedRequest):
            req = Req(message.rid, unpack_i32(message.input_ids), message.params, message.arrival_time)
            req.cache_salt = message.cache_salt
            req.priority = message.priority
            req.front_end = message.front_end
            try:
                self.scheduler.add_request(req)
            except ValueError as e:
                req.error, req.finish_reason = str(e), "error"
                self._send_outputs([StepOutput(req, [], finished=True)])
        elif isinstance(message, TokenizedBatch):
            for request in message.requests:
                self._handle(request)
        elif isinstance(message, AbortRequest):
            self.scheduler.abort(message.rid)
        elif isinstance(message, FlushCacheRequest):
            ok = self.scheduler.flush_cache(keep_pins=message.keep_pins)
            self._report_cache_events()
            self.to_front_ends[message.front_end].send(
                FlushCacheResult(message.request_id, ok, "" if ok else "requests are running; flush when idle")
            )
        elif isinstance(message, (PinPrefixRequest, UnpinPrefixRequest, ListPinsRequest)):
            self.pin_askers[message.request_id] = message.front_end
            self._send_pin_replies([self.cache_control.handle(message)])
        elif isinstance(message, ServerInfoRequest):
            self.to_front_ends[message.front_end].send(ServerInfo(message.request_id, self._server_info()))
        elif isinstance(message, CacheStatsRequest):
            self.to_front_ends[message.front_end].send(cache_stats(self.scheduler, message.request_id))

    def _server_info(self) -> dict:
        s = self.scheduler
        try:
            s.check_invariant(walk_tree=not s.num_running)  # the whole tree only at idle, where it costs no step
            invariant_ok = True
        except KVInvariantError:
            invariant_ok = False
        usage = s.kv_usage()
        return {
            "num_running": s.num_running,
            "num_waiting": len(s.waiting),
            "kv_invariant_ok": invariant_ok,
            **{f"kv_{k}": v for k, v in usage.items()},
            "context_len": s.context_len,
            # The most tokens one sequence can ever hold: the front ends refuse larger requests with a 400.
            "kv_pool_tokens": s.max_sequence_tokens(),
            "steps": s.stats.steps,
            "prefill_tokens_computed": s.stats.prefill_tokens_computed,
            "cached_prompt_tokens": s.stats.cached_prompt_tokens,
            "retractions": s.stats.retractions,
            "grouped_decodes": s.stats.grouped_decodes,
            "shared_prefix_tokens_saved": s.stats.shared_prefix_tokens_saved,
            "tp_size": self.args.tp_size,
            "chunked_prefill_size": min(s.chunked_prefill_size, 1 << 31),
            "radix_cache": not self.args.disable_radix_cache,
            "schedule_policy": self.args.schedule_policy,
            **cache_numbers(s),  # the cache metrics of /metrics (cache_stats.py)
            **(s.long.info() if s.long is not None else {}),
        }  # layer-wise offload (long_context.py)

    def _send_pin_replies(self, replies: list[PinsReply | None]) -> None:
        for reply in replies:
            if reply is not None:  # None: the prefix is being computed; the reply follows when it is
                self.to_front_ends[self.pin_askers.pop(reply.request_id, 0)].send(reply)

    def _report_cache_events(self) -> None:
        for log in (self.cache_events, self.kv_events):
            message = log.take() if log is not None else None
            if message is not None:  # the DP controller's or Dynamo's, both on front end 0's socket
                self.to_front_ends[0].send(message)

    def _check_invariant_at_idle(self) -> None:
        now = time.monotonic()
        if now - self.last_invariant_check < INVARIANT_CHECK_INTERVAL_S:
            return
        self.last_invariant_check = now
        try:
            self.scheduler.check_invariant(walk_tree=True)
            self.invariant_ok = True
        except KVInvariantError as e:
            if self.invariant_ok:
                logger.error("KV INVARIANT BROKEN AT IDLE: %s", e)
            self.invariant_ok = False

    def _send_outputs(self, outputs: list[StepOutput]) -> None:
        if not outputs:
            return
        s = self.scheduler
        usage = s.kv_usage()
        load = SchedulerLoad(
            s.num_running, len(s.waiting), usage["protected"] + usage["owned"], usage["evictable"], usage["total"]
        )
        for i, batch in per_front_end(outputs, len(self.to_front_ends)):
            self.to_front_ends[i].send(BatchOutput(batch, load))

    def shutdown(self) -> None:
        for channel in self.to_workers:
            channel.send(Shutdown("scheduler stopping"))


def run_scheduler(args: ServerArgs, model_dir: str, endpoints: Endpoints, on_ready) -> None:
    process = SchedulerProcess(args, model_dir, endpoints)
    on_ready({"num_kv_slots": process.scheduler.slot_allocator.num_total})
    try:
        process.run()
    finally:
        process.shutdown()
