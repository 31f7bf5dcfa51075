"""A GPU (or CPU) worker process: one tensor-parallel rank. Receives ForwardBatches from the scheduler, runs them,
and (rank 0 only) returns the sampled tokens; every rank holds the same logits after the LM head's all-gather."""

from __future__ import annotations

import logging

import torch
import zmq

from radixserve.config import ServerArgs
from radixserve.distributed import destroy_tensor_parallel, init_tensor_parallel
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
                                  max_running_requests=args.max_running_requests))
    on_ready({"num_kv_slots": runner.num_kv_slots, "device": str(runner.device)})
    logger.info("rank %d ready: %d KV slots, context %d", rank, runner.num_kv_slots, runner.context_len)
    profiler = StepProfiler(rank)
    while True:
        message = from_scheduler.recv()
        if isinstance(message, Shutdown):
            break
        assert isinstance(message, ForwardBatch)
        sampled = runner.forward(message)
        if rank == 0:
            to_scheduler.send(sampled)
        profiler.step()
    destroy_tensor_parallel()
