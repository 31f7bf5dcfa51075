"""CPU micro-benchmark of the scheduler's own cost per step (no model): 256 running requests decoding, plus the
cost of admitting a wave of chat requests that share a system prompt.

    python bench/scheduler_bench.py [--running 256] [--steps 200]

Target (issue 3): one scheduling step with 256 running requests under 1 ms (schedule + process_results)."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/kernels.py would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import time

import numpy as np

from radixserve.config import ServerArgs
from radixserve.protocol import SampledTokens
from radixserve.sampling import SamplingParams
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler


def sampled_for(scheduled, rng) -> SampledTokens:
    """Stands in for the workers: one random token per request that samples this step."""
    n = sum(scheduled.samples)
    return SampledTokens(step=scheduled.batch.step, token_ids=rng.integers(10, 1000, n, dtype=np.int32).tobytes())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    ns = parser.parse_args()
    rng = np.random.default_rng(0)
    args = ServerArgs(device="cpu", max_running_requests=ns.running, chunked_prefill_size=1 << 20)
    scheduler = Scheduler(args, num_kv_slots=ns.running * (ns.prompt_len + ns.steps + 8) + 1024,
                          context_len=ns.prompt_len + ns.steps + 64, eos_token_ids=[2])
    system = rng.integers(10, 1000, ns.prompt_len - 64).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=ns.steps + 4, ignore_eos=True)
    for i in range(ns.running):
        scheduler.add_request(Req(f"r{i}", system + rng.integers(10, 1000, 64).tolist(), params))

    t0 = time.perf_counter()
    admitted_steps = 0
    while scheduler.waiting:
        scheduled = scheduler.schedule()
        scheduler.process_results(scheduled, sampled_for(scheduled, rng))
        admitted_steps += 1
    admit_ms = (time.perf_counter() - t0) * 1e3
    assert len(scheduler.running) == ns.running

    schedule_us, process_us = [], []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        scheduled = scheduler.schedule()
        t1 = time.perf_counter()
        scheduler.process_results(scheduled, sampled_for(scheduled, rng))
        t2 = time.perf_counter()
        assert len(scheduled.reqs) == ns.running
        schedule_us.append((t1 - t0) * 1e6)
        process_us.append((t2 - t1) * 1e6)
    scheduler.check_invariant()
    med_s, med_p = statistics.median(schedule_us), statistics.median(process_us)
    print(f"admission of {ns.running} requests ({ns.prompt_len}-token prompts sharing {ns.prompt_len - 64} tokens): "
          f"{admit_ms:.1f} ms in {admitted_steps} steps")
    print(f"decode step with {ns.running} running: schedule {med_s:.0f} us + process_results {med_p:.0f} us = "
          f"{med_s + med_p:.0f} us median over {ns.steps} steps (target < 1000 us)")


if __name__ == "__main__":
    main()
