"""CPU micro-benchmark of admitting a burst of cache hits (issue 27 item 3), no model: G system prompts of L tokens
are cached, then N requests arrive at once, each one of those prompts plus a few new tokens, max_tokens=1. Timed,
per burst, through the overlapped loop's calls:

- schedule: Scheduler.schedule() (match, admit, build) and the batch encoded as the workers' message;
- worker: that message decoded and req_to_token's writes made ready as ModelRunner.prepare makes them
  (ReqToTokenPool.batch_writes, PinnedStaging.to_device_packed);
- table: ReqToTokenPool.write on the CPU device (on a GPU, kernels queued: the host's share is their launches);
- launch: Scheduler.cache_prompt_chunks() (the chunks just launched into the tree);
- results: Scheduler.process_results() of that step (every request ends, its KV into the tree).

    python -m bench.admission_burst_bench [--requests 128] [--prompts 8] [--prompt-len 1520] [--new-len 20]
                                          [--bursts 30] [--profile schedule|results|worker]

Prints the median and p90 of each part over the bursts (the first few, while the tree fills, are dropped)."""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

import msgspec
import numpy as np
import torch

from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, SampledTokens, unpack_i32
from radixserve.sampling import SamplingParams
from radixserve.worker.kv_cache import ReqToTokenPool
from radixserve.worker.pinned_staging import PinnedStaging
from scheduler_service.request import Req
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_loop import OverlapStepLoop

PARTS = ("schedule", "worker", "table", "launch", "results")


class TableWriter:
    """The worker's side of a batch, up to req_to_token written: the message decoded, the table's writes."""

    def __init__(self, max_running: int, context_len: int, rng: np.random.Generator):
        self.pool = ReqToTokenPool(max_running, context_len, "cpu")
        self.staging = PinnedStaging(torch.device("cpu"))
        self.write = self.pool.write
        self.decoder = msgspec.msgpack.Decoder(ForwardBatch)
        self.rng = rng
        self.message = b""
        self.sampled: list[SampledTokens] = []

    def launch(self, batch: ForwardBatch) -> None:
        self.message = msgspec.msgpack.encode(batch)  # (timed with schedule: what sending costs the scheduler)
        n = sum(batch.sample_mask)
        self.sampled.append(SampledTokens(batch.step, self.rng.integers(10, 1000, n, dtype=np.int32).tobytes()))

    def collect(self) -> SampledTokens:
        return self.sampled.pop(0)

    def write_table(self) -> None:
        batch = self.decoder.decode(self.message)
        rows, prefix_lens = unpack_i32(batch.req_pool_indices), unpack_i32(batch.prefix_lens)
        extend_lens, new_slots = unpack_i32(batch.extend_lens), unpack_i32(batch.out_cache_loc)
        writes = self.pool.batch_writes(batch.reused_slots, rows, prefix_lens, extend_lens, new_slots)
        (slots,), (index, copy_rows) = self.staging.to_device_packed([writes.slots], [writes.index, writes.copy_rows])
        self.write(index, slots, copy_rows, writes.copies)


class Timed:
    """Wraps a method so that each call's thread CPU time adds to a part's total for the current burst."""

    def __init__(self, totals: dict[str, float], part: str, fn, profilers: dict[str, cProfile.Profile]):
        self.totals, self.part, self.fn, self.profiler = totals, part, fn, profilers.get(part)

    def __call__(self, *args, **kwargs):
        if self.profiler:
            self.profiler.enable()
        t0 = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.part] += time.thread_time() - t0
            if self.profiler:
                self.profiler.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1520)
    parser.add_argument("--new-len", type=int, default=20)
    parser.add_argument("--bursts", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="bursts not counted")
    parser.add_argument("--profile", choices=PARTS, help="cProfile that part, print its top functions")
    ns = parser.parse_args()
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)
    context_len = ns.prompt_len + ns.new_len + 64
    args = ServerArgs(device="cpu", max_running_requests=256, chunked_prefill_size=8192)
    num_slots = ns.prompts * ns.prompt_len + ns.requests * (ns.new_len + 2) * (ns.bursts + ns.warmup + 2) + 4096
    scheduler = Scheduler(args, num_kv_slots=num_slots, context_len=context_len, eos_token_ids=[2])
    executor = TableWriter(args.max_running_requests, context_len, rng)
    loop = OverlapStepLoop(scheduler, executor)
    systems = [rng.integers(10, 1000, ns.prompt_len).tolist() for _ in range(ns.prompts)]
    one_token = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    for g, system in enumerate(systems):  # the system prompts cached
        scheduler.add_request(Req(f"warm{g}", system + rng.integers(10, 1000, ns.new_len).tolist(), one_token))
    while loop.has_work():
        loop.step()
        executor.write_table()

    totals = dict.fromkeys(PARTS, 0.0)
    profilers = {ns.profile: cProfile.Profile()} if ns.profile else {}
    scheduler.schedule = Timed(totals, "schedule", scheduler.schedule, profilers)
    scheduler.process_results = Timed(totals, "results", scheduler.process_results, profilers)
    scheduler.cache_prompt_chunks = Timed(totals, "launch", scheduler.cache_prompt_chunks, profilers)
    write_table = Timed(totals, "worker", executor.write_table, profilers)
    executor.write = Timed(totals, "table", executor.write, profilers)
    launch = executor.launch
    executor.launch = Timed(totals, "schedule", launch, {})
    per_burst: dict[str, list[float]] = {p: [] for p in PARTS}
    steps = []
    for burst in range(ns.warmup + ns.bursts):
        if burst == ns.warmup:
            for profiler in profilers.values():  # the warm-up bursts are not profiled either
                profiler.__init__()
        for k in totals:
            totals[k] = 0.0
        gc.collect()  # (then none during the burst: a collection would land in whichever part runs)
        gc.disable()
        for i in range(ns.requests):
            prompt = systems[i % ns.prompts] + rng.integers(10, 1000, ns.new_len).tolist()
            scheduler.add_request(Req(f"b{burst}-r{i}", prompt, one_token))
        n = 0
        while loop.has_work():
            loop.step()
            if executor.message:
                write_table()
                executor.message = b""
            n += 1
        gc.enable()
        assert scheduler.stats.cached_prompt_tokens > 0
        totals["worker"] -= totals["table"]  # (timed inside it)
        if burst >= ns.warmup:
            steps.append(n)
            for p in PARTS:
                per_burst[p].append(totals[p] * 1e3)
    scheduler.check_invariant(walk_tree=True)
    total = [sum(v) for v in zip(*per_burst.values())]
    print(
        f"burst of {ns.requests} cache hits over {ns.prompts} prompts of {ns.prompt_len} tokens + {ns.new_len} new, "
        f"max_tokens=1: {statistics.median(steps):.0f} loop steps; CPU ms per burst, median (p90) over {ns.bursts}:"
    )
    for p, v in [*per_burst.items(), ("total", total)]:
        print(f"  {p:9s} {statistics.median(v):7.2f} ({np.percentile(v, 90):.2f})")
    for profiler in profilers.values():
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
