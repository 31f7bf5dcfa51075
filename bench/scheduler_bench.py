"""CPU micro-benchmark of the scheduler's own cost per step (no model): 256 running requests decoding through the
real step loop (overlapped unless --disable-overlap-schedule), plus the cost of admitting a wave of chat requests
that share a system prompt, and of choosing the shared-prefix groups of that many requests.

    python -m bench.scheduler_bench [--running 256] [--steps 200] [--disable-overlap-schedule]
                                    [--disable-incremental-decode-batch] [--profile]
    python -m bench.scheduler_bench --churn     # requests coming and going over shared prompts, grouping on/off

A stand-in executor returns random tokens at once, so what is timed is the scheduler alone: schedule() (batch
built and encoded as the message the workers get), the placeholders of the overlapped loop, process_results()
and the per-request output messages the tokenizer gets. Target (issue 11): <= 0.3 ms per step with 256 running."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import deque

import msgspec
import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.config import ServerArgs
from radixserve.protocol import BatchOutput, ForwardBatch, SampledTokens, SchedulerLoad
from radixserve.sampling import SamplingParams
from scheduler_service.decode_grouper import DecodeGrouper
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import make_step_loop
from scheduler_service.step_output import messages


class RandomTokens:
    """Stands in for the workers: one random token per request that samples, available at once."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.done: deque[SampledTokens] = deque()
        self.encoder = msgspec.msgpack.Encoder()

    def launch(self, batch: ForwardBatch) -> None:
        self.encoder.encode(batch)  # what sending it to a worker costs the scheduler (before the socket)
        n = sum(batch.sample_mask)
        self.done.append(SampledTokens(batch.step, self.rng.integers(10, 1000, n, dtype=np.int32).tobytes()))

    def collect(self) -> SampledTokens:
        return self.done.popleft()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument(
        "--disable-incremental-decode-batch",
        action="store_true",
        help="rebuild every decode batch from its requests (scheduler_service/decode_batch.py off)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps, print the top functions")
    parser.add_argument(
        "--churn",
        action="store_true",
        help="instead: a new request every 2 steps over 8 shared 2,048-token prompts, shared-prefix grouping on/off",
    )
    ns = parser.parse_args()
    if ns.churn:
        for shared in (False, True, False, True):
            print(churn_step_us(shared))
        return
    rng = np.random.default_rng(0)
    args = ServerArgs(
        device="cpu",
        max_running_requests=ns.running,
        chunked_prefill_size=1 << 20,
        disable_overlap_schedule=ns.disable_overlap_schedule,
        disable_incremental_decode_batch=ns.disable_incremental_decode_batch,
    )
    scheduler = Scheduler(
        args,
        num_kv_slots=ns.running * (ns.prompt_len + 2 * ns.steps + 16) + 1024,
        context_len=ns.prompt_len + 2 * ns.steps + 64,
        eos_token_ids=[2],
    )
    loop = make_step_loop(scheduler, RandomTokens())
    encoder = msgspec.msgpack.Encoder()
    system = rng.integers(10, 1000, ns.prompt_len - 64).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=ns.steps * 2 + 8, ignore_eos=True)
    for i in range(ns.running):
        scheduler.add_request(Req(f"r{i}", system + rng.integers(10, 1000, 64).tolist(), params))

    def step() -> float:
        """One step; returns the CPU seconds spent on the output messages."""
        outputs = loop.step()
        t0 = time.thread_time()
        # What SchedulerProcess._send_outputs does with them (load figures aside).
        encoder.encode(BatchOutput(messages(outputs), SchedulerLoad(0, 0, 0, 0, 0)))
        return time.thread_time() - t0

    t0 = time.perf_counter()
    admitted_steps = 0
    while scheduler.waiting or admitted_steps < 3:
        step()
        admitted_steps += 1
    admit_ms = (time.perf_counter() - t0) * 1e3
    assert len(scheduler.running) == ns.running

    profiler = cProfile.Profile() if ns.profile else None
    step_us, output_us = [], []
    for _ in range(ns.steps):
        if profiler:
            profiler.enable()
        t0 = time.thread_time()  # CPU time of this thread: other processes on a busy machine do not count
        output_us.append(step() * 1e6)
        step_us.append((time.thread_time() - t0) * 1e6)
        if profiler:
            profiler.disable()
    assert len(scheduler.running) == ns.running
    scheduler.check_invariant()
    med, med_out = statistics.median(step_us), statistics.median(output_us)
    print(
        f"admission of {ns.running} requests ({ns.prompt_len}-token prompts sharing {ns.prompt_len - 64} tokens): "
        f"{admit_ms:.1f} ms in {admitted_steps} steps"
    )
    print(
        f"decode step with {ns.running} running ({'serial' if ns.disable_overlap_schedule else 'overlapped'} "
        f"loop): {med:.0f} us of CPU time median over {ns.steps} steps, p10 {np.percentile(step_us, 10):.0f} us, "
        f"p90 {np.percentile(step_us, 90):.0f} us (target <= 300 us); of which output messages {med_out:.0f} us"
    )
    groups_ms = group_choice_ms(ns.running)
    print(f"prefix groups of {ns.running} running requests over 16 system prompts: {groups_ms:.1f} ms")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def churn_step_us(shared: bool, steps: int = 800, every: int = 2) -> str:
    """The scheduler's CPU time per step while requests come and go, as at a fixed arrival rate (bench.serving_bench
    --request-rate): one new request every `every` steps, each one of 8 cached 2,048-token system prompts + 64 new
    tokens and 128 out (~64 running), with shared-prefix grouping on or off; the last 500 steps."""
    rng = np.random.default_rng(0)
    args = ServerArgs(
        device="cpu", max_running_requests=256, chunked_prefill_size=8192, disable_shared_prefix_attention=not shared
    )
    scheduler = Scheduler(args, num_kv_slots=400_000, context_len=4096, eos_token_ids=[2])
    loop = make_step_loop(scheduler, RandomTokens())
    encoder = msgspec.msgpack.Encoder()
    systems = [rng.integers(10, 1000, 2048).tolist() for _ in range(8)]
    warm = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    for i, system in enumerate(systems):  # cached before the clock starts
        scheduler.add_request(Req(f"w{i}", system + [7], warm))
    for _ in range(5):
        loop.step()
    params = SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True)
    times = []
    for s in range(steps):
        if s % every == 0:
            scheduler.add_request(Req(f"r{s}", systems[s % 8] + rng.integers(10, 1000, 64).tolist(), params))
        t0 = time.thread_time()
        encoder.encode(BatchOutput(messages(loop.step()), SchedulerLoad(0, 0, 0, 0, 0)))
        if s >= steps - 500:
            times.append((time.thread_time() - t0) * 1e6)
    return (
        f"churn, shared-prefix grouping {'on' if shared else 'off'}: {len(scheduler.running)} running, step CPU median "
        f"{statistics.median(times):.0f} us, p90 {np.percentile(times, 90):.0f} us"
    )


class _Decode:
    """What DecodeGrouper reads of a request (hashed by identity, as a Req is)."""

    def __init__(self, last_node, tree_len: int):
        self.last_node, self.tree_len = last_node, tree_len


def group_choice_ms(running: int) -> float:
    """CPU time of one search from scratch of shared-prefix decode attention's groups (a new DecodeGrouper's first
    groups(); a kept one updates what changed) for `running` requests whose 200-token system prompts are 16 distinct
    ones; median of 5."""
    rng = np.random.default_rng(2)
    systems = [rng.integers(1000, 2000, size=200).tolist() for _ in range(16)]
    tree = RadixCache(TokenSlotAllocator(running * 240 + 1024))
    prompts = [systems[i % 16] + [5000 + i] + rng.integers(1, 999, size=30).tolist() for i in range(running)]
    for prompt in prompts:
        tree.insert(prompt, tree.allocator.alloc(len(prompt)))
    decodes = []
    for prompt in prompts:
        match = tree.match_prefix(prompt)
        tree.inc_lock_ref(match.last_node)
        decodes.append(_Decode(match.last_node, len(prompt)))
    times = []
    for _ in range(5):
        grouper = DecodeGrouper(min_tokens=64)  # a new one searches from scratch
        t0 = time.thread_time()
        groups = grouper.groups(decodes)
        times.append((time.thread_time() - t0) * 1e3)
    assert len(groups) == 16
    return statistics.median(times)


if __name__ == "__main__":
    main()
