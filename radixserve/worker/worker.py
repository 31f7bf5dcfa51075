"""A GPU (or CPU) worker process: one tensor-parallel rank. Receives ForwardBatches from the scheduler, runs them,
and (rank 0 only) returns the sampled tokens; every rank holds the same logits after the LM head's all-gather."""

from __future__ import annotations

import logging

import torch
import zmq

from radixserve.config import ServerArgs
from radixserve.runtime.distributed import destroy_tensor_parallel, init_tensor_parallel
from radixserve.runtime.heartbeat import progress
from radixserve.runtime.ipc import Channel, Endpoints
from radixserve.protocol import ForwardBatch, SchedulerToWorker, Shutdown, WorkerReady
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.profiler import StepProfiler
from radixserve.worker.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)


def run_worker(
    args: ServerArgs, model_dir: str, endpoints: Endpoints, on_ready, rank: str, dist_init_method: str
) -> None:
    rank = int(rank)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_tensor_parallel(rank, args.tp_size, dist_init_method, args.device)
    runner = ModelRunner(args, model_dir)
    ctx = zmq.Context()
    from_scheduler = Channel(
        ctx, zmq.PULL, endpoints.scheduler_to_worker(rank), bind=False, recv_type=SchedulerToWorker
    )
    to_scheduler = Channel(ctx, zmq.PUSH, endpoints.workers_to_scheduler, bind=False)
    to_scheduler.send(
        WorkerReady(
            rank=rank,
            num_kv_slots=runner.num_kv_slots,
            context_len=runner.context_len,
            num_host_slots=runner.num_host_slots,
        )
    )
    on_ready({"num_kv_slots": runner.num_kv_slots, "device": str(runner.device)})
    logger.info("rank %d ready: %d KV slots, context %d", rank, runner.num_kv_slots, runner.context_len)
    profiler = StepProfiler(rank)
    # (Why the next forward is queued before this step is read back, and when not: there.)
    pipeline = StepPipeline(runner, read_back_wait_s=args.read_back_wait_ms / 1e3)
    spin_s = args.spin_wait_ms / 1e3  # the next batch is polled for, not slept on, for up to this long
    while True:
        message = (
            from_scheduler.recv(spin_s=spin_s)
            if pipeline.in_flight is None
            else _next_batch_while_busy(from_scheduler, pipeline)
        )
        if message is None:  # nothing else queued: report the step in flight
            _report(pipeline.finish(), rank, to_scheduler)
            continue
        if isinstance(message, Shutdown):
            break
        assert isinstance(message, ForwardBatch)
        progress.begin()  # launch.py's watchdog times each batch (radixserve/runtime/heartbeat.py)
        early = pipeline.finish_before(message)
        if early is not None:
            _report(early, rank, to_scheduler)
        done = pipeline.launch(message)
        if done is not None:
            _report(done, rank, to_scheduler)
        progress.end()
        profiler.step()
    destroy_tensor_parallel()


def _next_batch_while_busy(from_scheduler: Channel, pipeline: StepPipeline):
    """The next batch if one arrives before the step in flight has its tokens on the host (then it is worth
    launching first), else None."""
    while True:
        message = from_scheduler.recv_nowait()
        if message is not None or pipeline.ready():
            return message


def _report(sampled, rank: int, to_scheduler: Channel) -> None:
    if rank == 0:  # every rank holds the same logits and samples the same tokens; one answers
        to_scheduler.send(sampled)
