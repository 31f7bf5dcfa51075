"""CPU micro-benchmark of the radix prefix cache (not a test).

Workload: chat traffic with shared system prompts. The tree first receives --num-seqs sequences,
each one of --num-system-prompts system prompts (300-2000 tokens) followed by a unique suffix. Then
each timed query is a 4,096-token prompt doing what the scheduler does on admission and at finish:
    match_prefix(prompt[:-1])  ->  (allocate the rest, untimed)  ->  insert(prompt, slots)
Half the queries continue an existing conversation (hit = system prompt + old suffix), half start a
new one (hit = system prompt only). Eviction is timed separately as evict(4096) on the full tree.

    python -m bench.radix_cache_bench [--num-seqs 10000] [--reps 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from radixserve.cache.slot_allocator import TokenSlotAllocator
from radixserve.cache.radix_cache import RadixCache

VOCAB = 32000
PROMPT_LEN = 4096


def percentiles_us(samples: list[float]) -> str:
    us = np.array(samples) * 1e6
    return f"median {np.median(us):7.1f} us   p90 {np.percentile(us, 90):7.1f} us   p99 {np.percentile(us, 99):7.1f} us"


def build_tree(args, rng):
    system_prompts = [
        rng.integers(0, VOCAB, rng.integers(300, 2001), dtype=np.int32) for _ in range(args.num_system_prompts)
    ]
    sequences = []
    for _ in range(args.num_seqs):
        system = system_prompts[rng.integers(len(system_prompts))]
        suffix = rng.integers(0, VOCAB, rng.integers(20, 1001), dtype=np.int32)
        sequences.append(np.concatenate([system, suffix]))
    # Room for the tree, every query's new tokens, and slack.
    num_slots = sum(len(s) for s in sequences) + args.reps * PROMPT_LEN + PROMPT_LEN
    allocator = TokenSlotAllocator(num_slots)
    cache = RadixCache(allocator)
    start = time.perf_counter()
    for seq in sequences:
        hit = cache.match_prefix(seq).slots
        cache.insert(seq, np.concatenate([hit, allocator.alloc(len(seq) - len(hit))]))
    build_s = time.perf_counter() - start
    return allocator, cache, system_prompts, sequences, build_s


def make_queries(args, rng, system_prompts, sequences):
    queries = []
    for i in range(args.reps):
        if i % 2 == 0:  # next turn of an existing conversation
            head = sequences[rng.integers(len(sequences))]
        else:  # new conversation under a known system prompt
            head = system_prompts[rng.integers(len(system_prompts))]
        head = head[: PROMPT_LEN - 1]
        tail = rng.integers(0, VOCAB, PROMPT_LEN - len(head), dtype=np.int32)
        queries.append(np.concatenate([head, tail]))
    return queries


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=10_000)
    parser.add_argument("--num-system-prompts", type=int, default=50)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--evict-reps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    allocator, cache, system_prompts, sequences, build_s = build_tree(args, rng)
    print(f"tree: {args.num_seqs} sequences, {cache.total_size():,} cached tokens, built in {build_s:.2f} s")

    queries = make_queries(args, rng, system_prompts, sequences)
    match_t, insert_t, both_t, hits = [], [], [], []
    for prompt in queries:
        t0 = time.perf_counter()
        prefix = cache.match_prefix(prompt[:-1]).slots
        t1 = time.perf_counter()
        own = allocator.alloc(PROMPT_LEN - len(prefix))
        slots = np.concatenate([prefix, own])
        t2 = time.perf_counter()
        cache.insert(prompt, slots)
        t3 = time.perf_counter()
        match_t.append(t1 - t0)
        insert_t.append(t3 - t2)
        both_t.append((t1 - t0) + (t3 - t2))
        hits.append(len(prefix))
    print(f"queries: {args.reps} x {PROMPT_LEN}-token prompts, mean cached prefix {np.mean(hits):.0f} tokens")
    print(f"match_prefix          {percentiles_us(match_t)}")
    print(f"insert                {percentiles_us(insert_t)}")
    print(f"match_prefix + insert {percentiles_us(both_t)}   (target < 200 us)")

    evict_t, freed = [], 0
    for _ in range(args.evict_reps):
        t0 = time.perf_counter()
        freed += cache.evict(PROMPT_LEN)
        evict_t.append(time.perf_counter() - t0)
    print(
        f"evict({PROMPT_LEN})           {percentiles_us(evict_t)}   "
        f"({freed / args.evict_reps:.0f} slots freed per call)"
    )

    alloc_t = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        slots = allocator.alloc(PROMPT_LEN)
        allocator.free(slots)
        alloc_t.append(time.perf_counter() - t0)
    print(f"alloc+free({PROMPT_LEN})      {percentiles_us(alloc_t)}")
    cache.check_invariants()


if __name__ == "__main__":
    main()
