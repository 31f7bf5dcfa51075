"""Pipelined steps on one rank: the next batch's forward is queued on the device before the step in flight is read
back, and reading it back waits for that step's own tokens only. One implementation for the worker process
(worker.py) and the in-process executor (scheduler_service/executor.py).

Why this order. The overlapped scheduler sends step N+1 before it waits for step N's tokens, so a worker holding
N+1 queues its forward at once: the device then runs N+1 while the host reads N back, reports it, and the scheduler
builds N+2. Reading N back must not wait for N+1: ModelRunner.sample copies N's tokens to pinned host memory right
after sampling them (non-blocking, on the same stream, before N+1's forward is queued) and records an event after
the copy, and finish_step waits on that event alone. (It once read them with .tolist(), a copy queued behind N+1's
forward: the host waited for the whole forward, then the device idled while the host did its chain, every other
step.) Sampling N+1 comes after N is read back because it needs N's tokens in the sampling states (penalties,
grammars), so the device order is forward N, sample N, forward N+1, sample N+1."""

from __future__ import annotations

from radixserve.protocol import ForwardBatch, SampledTokens


class StepPipeline:
    def __init__(self, runner):
        self.runner = runner  # a ModelRunner
        self.in_flight = None  # the SampledStep launched last and not yet read back

    def launch(self, batch: ForwardBatch) -> SampledTokens | None:
        """Queue the batch's forward, read back the step before it (if any: returned), then sample the batch."""
        logits = self.runner.compute_logits(batch)
        done = self.finish()
        self.in_flight = self.runner.sample(batch, logits)
        return done

    def finish(self) -> SampledTokens | None:
        """The step in flight's tokens (waits for its copy to the host only), or None if there is none."""
        step, self.in_flight = self.in_flight, None
        return None if step is None else self.runner.finish_step(step)

    def ready(self) -> bool:
        """True when finish() would not wait: nothing in flight, or its tokens are on the host."""
        return self.in_flight is None or self.in_flight.ready()
