"""Executors: what runs a ForwardBatch and returns its sampled tokens. launch() starts a step and collect() waits
for the oldest step launched, so a loop may keep more than one batch in flight (an overlapped loop launches step
N+1 before it collects step N); the serial loop (step_loop.py) launches and collects one at a time.

WorkerProcessesExecutor drives the worker processes over ZeroMQ (the server and Engine); InProcessExecutor runs a
ModelRunner in this process (InProcessEngine); fake_executor.py stands in for the model in scheduler tests."""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from radixserve.runtime.ipc import Channel
from radixserve.protocol import ForwardBatch, SampledTokens
from radixserve.worker.step_pipeline import StepPipeline

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def launch(self, batch: ForwardBatch) -> None:
        """Start computing one step."""

    def collect(self) -> SampledTokens:
        """The sampled tokens of the oldest step launched and not yet collected (blocks until they exist)."""


class InProcessExecutor:
    """A ModelRunner (one rank) in this process, pipelined as a worker process runs it (radixserve/worker/
    step_pipeline.py): a step's forward is queued when it is launched, before the previous step is read back."""

    def __init__(self, runner):
        self.pipeline = StepPipeline(runner)
        self._done: deque[SampledTokens] = deque()

    def launch(self, batch: ForwardBatch) -> None:
        done = self.pipeline.launch(batch)
        if done is not None:
            self._done.append(done)

    def collect(self) -> SampledTokens:
        if not self._done:
            self._done.append(self.pipeline.finish())
        return self._done.popleft()


class WorkerProcessesExecutor:
    """Every tensor-parallel rank gets the batch; rank 0 alone answers with the sampled tokens (all ranks hold the
    same logits, so their samplers agree)."""

    def __init__(self, to_workers: list[Channel], from_workers: Channel, spin_s: float = 0.0):
        self.to_workers = to_workers
        self.from_workers = from_workers
        self.spin_s = spin_s  # --spin-wait-ms: a step's tokens are polled for, not slept on, for up to this long
        self._in_flight: deque[int] = deque()  # step numbers, oldest first

    def launch(self, batch: ForwardBatch) -> None:
        for channel in self.to_workers:
            channel.send(batch)
        self._in_flight.append(batch.step)

    def collect(self) -> SampledTokens:
        step = self._in_flight.popleft()
        while True:
            reply = self.from_workers.recv(spin_s=self.spin_s)
            if isinstance(reply, SampledTokens) and reply.step == step:
                return reply
            logger.warning("unexpected message from workers while waiting for step %d: %r", step, reply)
