"""A GPU (or CPU) worker process: one tensor-parallel rank. Receives ForwardBatches from the scheduler, runs them,
and (rank 0 only) returns the sampled tokens; every rank holds the same logits after the LM head's all-gather."""

from __future__ import annotations

import logging

import torch
import zmq

from radixserve.config import ServerArgs
from radixserve.distributed import destroy_tensor_parallel, init_tensor_parallel
from radixserve.heartbeat import progress
from radixserve.ipc import Channel, Endpoints
from radixserve.protocol import ForwardBatch, SchedulerToWorker, Shutdown, WorkerReady
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.profiler import StepProfiler

logger = logging.getLogger(__name__)


def run_worker(args: ServerArgs, model_dir: str, endpoints: Endpoints, on_ready, rank: str,
               dist_init_method: str) -> None:
    rank = int(rank)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_tensor_parallel(rank, args.tp_size, dist_init_method, args.device)
    runner = ModelRunner(args, model_dir)
    ctx = zmq.Context()
    from_scheduler = Channel(ctx, zmq.PULL, endpoints.scheduler_to_worker(rank), bind=False,
                             recv_type=SchedulerToWorker)
    to_scheduler = Channel(ctx, zmq.PUSH, endpoints.workers_to_scheduler, bind=False)
    to_scheduler.send(WorkerReady(rank=rank, num_kv_slots=runner.num_kv_slots, context_len=runner.context_len,
                                  num_host_slots=runner.num_host_slots))
    on_ready({"num_kv_slots": runner.num_kv_slots, "device": str(runner.device)})
    logger.info("rank %d ready: %d KV slots, context %d", rank, runner.num_kv_slots, runner.context_len)
    profiler = StepProfiler(rank)
    # Pipelined steps: the next batch's forward is queued on the device before this step's tokens are read back,
    # so the device does not idle while the host waits for them, reports them and prepares the next batch (the
    # overlapped scheduler sends step N+1 before it waits for step N). Sampling N+1 waits for N's tokens to reach
    # the sampling states (penalties, grammars), so the order on the device is forward N+1, then sample N+1.
    in_flight = None  # a SampledStep not yet reported
    while True:
        message = from_scheduler.recv() if in_flight is None else _next_batch_while_busy(from_scheduler, in_flight)
        if message is None:  # nothing else queued: report the step in flight
            _report(runner.finish_step(in_flight), rank, to_scheduler)
            in_flight = None
            continue
        if isinstance(message, Shutdown):
            break
        assert isinstance(message, ForwardBatch)
        progress.begin()  # launch.py's watchdog times each batch (radixserve/heartbeat.py)
        logits = runner.compute_logits(message)
        if in_flight is not None:
            _report(runner.finish_step(in_flight), rank, to_scheduler)
        in_flight = runner.sample(message, logits)
        progress.end()
        profiler.step()
    destroy_tensor_parallel()


def _next_batch_while_busy(from_scheduler: Channel, in_flight):
    """The next batch if one arrives before the step in flight has its tokens (then it is worth launching first),
    else None."""
    while True:
        message = from_scheduler.recv_nowait()
        if message is not None or in_flight.ready():
            return message


def _report(sampled, rank: int, to_scheduler: Channel) -> None:
    if rank == 0:  # every rank holds the same logits and samples the same tokens; one answers
        to_scheduler.send(sampled)
