"""The scheduler's step, top to bottom: schedule a batch, hand it to the executor, apply its sampled tokens.
SchedulerProcess (the server), InProcessEngine and the scheduler tests all run this same code.

SerialStepLoop waits for step N's tokens before it builds step N+1 (--disable-overlap-schedule). OverlapStepLoop
(the default, as in SGLang) builds and launches step N+1 first and applies step N's tokens while N+1 runs, so the
scheduler's CPU work and the socket hops hide behind the forward. Step N's tokens are not known when N+1 is built:
each request that samples in N gets a placeholder output id (protocol.future_token_placeholder), N+1 feeds that
placeholder as the request's next input, and the worker swaps in the real token, which never left the device.
process_results(N) then writes the real token over the placeholder. A request that ends with N's token by a stop
(EOS, a stop string) has one wasted decode in N+1 (its slot for that step is released with the rest of its KV, once,
when it finishes); one that ends by length is known to at launch, and is set aside (Scheduler.set_aside_finishing):
no later step computes for it.
Prompt chunks go into the radix tree as their step is launched, not when it returns: a request admitted into step
N+1 can share a prompt that step N computes (the workers run steps in order, so N has written that KV by then)."""

from __future__ import annotations

import numpy as np

from scheduler_service.batch_builder import ScheduledBatch
from scheduler_service.executor import Executor
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_output import StepOutput
from radixserve.protocol import future_token_placeholder, future_token_ring_size


class SerialStepLoop:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One step: what every request got (new tokens, finishes, and aborts or errors since the last step)."""
        scheduled = self.scheduler.schedule()
        if scheduled is not None:
            self.executor.launch(scheduled.batch)
            self.scheduler.process_results(scheduled, self.executor.collect())
        return self.scheduler.take_outputs()

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[StepOutput]:
        """Step until no request is left and nothing is in flight; every output, in order (tests, offline use)."""
        outputs = []
        for _ in range(max_steps):
            if not self.has_work():
                return outputs
            outputs += self.step()
        raise RuntimeError(f"the scheduler still has work after {max_steps} steps")


class OverlapStepLoop(SerialStepLoop):
    """At most one step in flight while the next is built: launch N+1, then collect and apply N."""

    def __init__(self, scheduler: Scheduler, executor: Executor):
        super().__init__(scheduler, executor)
        self.ring_size = future_token_ring_size(scheduler.args.max_running_requests)
        self.next_future = 0
        # placeholder_at[i]: the placeholder of ring index i % ring_size, twice over, so that any step's run of
        # placeholders (at most max_running_requests from any base) is one slice, not arrays made every step.
        self.placeholder_at = (-1 - np.arange(2 * self.ring_size) % self.ring_size).astype(np.int32)
        # The step launched and not yet applied, with where each of its samples sits in its request's output_ids.
        self.in_flight: tuple[ScheduledBatch, list[int]] | None = None

    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        s = self.scheduler
        if self.in_flight is not None and not s.room_for_every_running_request():
            # Scheduling now might retract a request whose token is still in flight (only retraction reads and
            # re-queues outputs that are still in flight): apply it first (serial step).
            self._apply_in_flight()
        scheduled = s.schedule()
        launched = None
        if scheduled is not None:
            launched = (scheduled, self._placeholders_for(scheduled))
            self.executor.launch(scheduled.batch)
            s.cache_prompt_chunks(scheduled)
        self._apply_in_flight()
        self.in_flight = launched
        return s.take_outputs()

    def _apply_in_flight(self) -> None:
        if self.in_flight is not None:
            scheduled, output_index = self.in_flight
            self.in_flight = None
            self.scheduler.process_results(scheduled, self.executor.collect(), output_index)

    def _placeholders_for(self, scheduled: ScheduledBatch) -> list[int]:
        """Append a placeholder output to every request that samples in this step, so that the next schedule()
        sees it as decoding one more token; the batch tells the worker where in the ring to keep the real ones."""
        base = self.next_future
        scheduled.batch.future_token_base = base
        s = self.scheduler
        if scheduled.decodes is not None:  # decodes alone, as arrays: the same placeholders without a loop
            n = len(scheduled.reqs)
            output_index = s.decode_batch.placeholders(scheduled.decodes, self.placeholder_at[base : base + n])
            if output_index is not None:
                self.next_future = (base + n) % self.ring_size
                last = np.flatnonzero(scheduled.decodes.num_outputs + 1 >= scheduled.decodes.run.limits)
                if len(last):
                    s.set_aside_finishing([scheduled.reqs[i] for i in last.tolist()])
                return output_index
        output_index, last = [], []
        i = base
        for req, samples in zip(scheduled.reqs, scheduled.samples):
            if samples:
                output_index.append(len(req.output_ids))
                req.output_ids.append(future_token_placeholder(i))
                i = i + 1 if i + 1 < self.ring_size else 0
                if len(req.output_ids) >= min(req.params.max_new_tokens, s.context_len - len(req.prompt_ids)):
                    last.append(req)
        self.next_future = i
        if last:
            s.set_aside_finishing(last)
        return output_index


def make_step_loop(scheduler: Scheduler, executor: Executor) -> SerialStepLoop:
    """The overlapped loop unless --disable-overlap-schedule."""
    if scheduler.args.disable_overlap_schedule:
        return SerialStepLoop(scheduler, executor)
    return OverlapStepLoop(scheduler, executor)
