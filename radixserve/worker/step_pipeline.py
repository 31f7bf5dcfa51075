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
grammars), so the device order is forward N, sample N, forward N+1, sample N+1.

The exception: two long host steps in a row (finish_before). A step that does not replay a decode CUDA graph (a
prefill, a mixed step: piecewise graphs or eager kernels) takes the host milliseconds to launch (16-20 ms for a 0.6B
step of a burst of chats on an H100 host), and the device runs its kernels as they come, so it finishes such a step
soon after its launch ends. Launching N+1 of that kind before reporting N keeps the scheduler waiting for N's tokens
all through N+1's launch; it builds N+2 only after, while the device idles (6-16 ms every other step of a burst's
prefill phase: bench/results/ttft-under-load-h100.md, session 14). So before such an N+1, when N was of that kind
too, the worker waits briefly for N's tokens and reports them first; the scheduler then builds N+2 while N+1 is
launched. Not before a decode-graph replay: there the device trails the host by a whole step, and waiting for N
would leave it idle (at batch 1 the replay takes the host well under a millisecond). The wait is bounded
(--read-back-wait-ms): past it, N+1 is launched first as usual."""

from __future__ import annotations

import time

from radixserve.protocol import ForwardBatch, SampledTokens


class StepPipeline:
    def __init__(self, runner, read_back_wait_s: float = 0.0):
        self.runner = runner  # a ModelRunner
        self.in_flight = None  # the SampledStep launched last and not yet read back
        self.in_flight_is_long = False  # whether that step's launch was a long host step (not a decode-graph replay)
        self.read_back_wait_s = read_back_wait_s  # how long finish_before waits for it (0: never)

    def finish_before(self, batch: ForwardBatch) -> SampledTokens | None:
        """The step in flight's tokens, read back now, if both it and the batch about to be launched are long host
        steps and its tokens reach the host within read_back_wait_s (the module's docstring says why); else None."""
        if self.in_flight is None or not self.in_flight_is_long or self.read_back_wait_s <= 0:
            return None
        if self.runner.replays_decode_graph(batch):
            return None
        deadline = time.perf_counter() + self.read_back_wait_s
        while not self.in_flight.ready():
            if time.perf_counter() > deadline:
                return None
        return self.finish()

    def launch(self, batch: ForwardBatch) -> SampledTokens | None:
        """Queue the batch's forward, read back the step before it (if any: returned), then sample the batch."""
        is_long = not self.runner.replays_decode_graph(batch)
        logits = self.runner.compute_logits(batch)
        done = self.finish()
        self.in_flight = self.runner.sample(batch, logits)
        self.in_flight_is_long = is_long
        return done

    def finish(self) -> SampledTokens | None:
        """The step in flight's tokens (waits for its copy to the host only), or None if there is none."""
        step, self.in_flight = self.in_flight, None
        return None if step is None else self.runner.finish_step(step)

    def ready(self) -> bool:
        """True when finish() would not wait: nothing in flight, or its tokens are on the host."""
        return self.in_flight is None or self.in_flight.ready()
