"""The scheduler process: requests in from the tokenizer, batches out to every worker rank, sampled tokens back
from rank 0, per-request outputs back to the tokenizer."""

from __future__ import annotations

import logging
import time

import zmq

from radixserve.config import ModelConfig, ServerArgs
from radixserve.ipc import Channel, Endpoints
from radixserve.protocol import (AbortRequest, BatchOutput, FlushCacheRequest, FlushCacheResult, ForwardBatch,
                                 SampledTokens, SchedulerLoad, ServerInfo, ServerInfoRequest, Shutdown,
                                 TokenizedRequest, TokenizerToScheduler, WorkerReady, WorkerToScheduler, unpack_i32)
from scheduler_service.request import Req
from scheduler_service.scheduler import KVInvariantError, Scheduler, StepOutput

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
INVARIANT_CHECK_INTERVAL_S = 5.0


class SchedulerProcess:
    def __init__(self, args: ServerArgs, model_dir: str, endpoints: Endpoints):
        self.args = args
        ctx = zmq.Context()
        self.from_tokenizer = Channel(ctx, zmq.PULL, endpoints.tokenizer_to_scheduler, bind=True,
                                      recv_type=TokenizerToScheduler)
        self.to_tokenizer = Channel(ctx, zmq.PUSH, endpoints.scheduler_to_tokenizer, bind=False)
        self.to_workers = [Channel(ctx, zmq.PUSH, endpoints.scheduler_to_worker(r), bind=True)
                           for r in range(args.tp_size)]
        self.from_workers = Channel(ctx, zmq.PULL, endpoints.workers_to_scheduler, bind=True,
                                    recv_type=WorkerToScheduler)
        ready = self._wait_for_workers()
        model_config = ModelConfig.from_dir(model_dir)
        self.scheduler = Scheduler(args, ready.num_kv_slots, ready.context_len, model_config.eos_token_ids,
                                   self._execute)
        self.last_invariant_check = 0.0
        self.invariant_ok = True

    def _wait_for_workers(self) -> WorkerReady:
        readies = []
        while len(readies) < self.args.tp_size:
            message = self.from_workers.recv()
            if isinstance(message, WorkerReady):
                readies.append(message)
        return min(readies, key=lambda r: r.num_kv_slots)

    def _execute(self, batch: ForwardBatch) -> SampledTokens:
        for channel in self.to_workers:
            channel.send(batch)
        while True:
            reply = self.from_workers.recv()
            if isinstance(reply, SampledTokens) and reply.step == batch.step:
                return reply
            logger.warning("unexpected message from workers: %r", reply)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while True:
            self._receive_requests(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self._send_outputs(self.scheduler.step())
            else:
                self._check_invariant_at_idle()

    def _receive_requests(self, block: bool) -> None:
        message = self.from_tokenizer.recv(IDLE_POLL_MS) if block else self.from_tokenizer.recv_nowait()
        while message is not None:
            self._handle(message)
            message = self.from_tokenizer.recv_nowait()

    def _handle(self, message) -> None:
        if isinstance(message, TokenizedRequest):
            req = Req(message.rid, unpack_i32(message.input_ids), message.params, message.arrival_time)
            try:
                self.scheduler.add_request(req)
            except ValueError as e:
                req.error, req.finish_reason = str(e), "error"
                self._send_outputs([StepOutput(req, [], finished=True)])
        elif isinstance(message, AbortRequest):
            self.scheduler.abort(message.rid)
        elif isinstance(message, FlushCacheRequest):
            ok = self.scheduler.flush_cache()
            self.to_tokenizer.send(FlushCacheResult(message.request_id, ok,
                                                    "" if ok else "requests are running; flush when idle"))
        elif isinstance(message, ServerInfoRequest):
            self.to_tokenizer.send(ServerInfo(message.request_id, self._server_info()))

    def _server_info(self) -> dict:
        s = self.scheduler
        try:
            s.check_invariant()
            invariant_ok = True
        except KVInvariantError:
            invariant_ok = False
        usage = s.kv_usage()
        return {"num_running": len(s.running), "num_waiting": len(s.waiting), "kv_invariant_ok": invariant_ok,
                **{f"kv_{k}": v for k, v in usage.items()}, "context_len": s.context_len,
                "steps": s.stats.steps, "prefill_tokens_computed": s.stats.prefill_tokens_computed,
                "cached_prompt_tokens": s.stats.cached_prompt_tokens, "retractions": s.stats.retractions,
                "tp_size": self.args.tp_size, "chunked_prefill_size": min(s.chunk_budget, 1 << 31),
                "radix_cache": not self.args.disable_radix_cache, "schedule_policy": self.args.schedule_policy}

    def _check_invariant_at_idle(self) -> None:
        now = time.monotonic()
        if now - self.last_invariant_check < INVARIANT_CHECK_INTERVAL_S:
            return
        self.last_invariant_check = now
        try:
            self.scheduler.check_invariant()
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
        load = SchedulerLoad(len(s.running), len(s.waiting), usage["protected"] + usage["owned"],
                             usage["evictable"], usage["total"])
        messages = [out.to_message() for out in outputs]
        self.to_tokenizer.send(BatchOutput(messages, load))

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
