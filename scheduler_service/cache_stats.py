"""What the scheduler tells the cache dashboard (GET /v1/cache/stats) and the Prometheus cache metrics.

Two shapes of the same numbers: `cache_numbers` is flat (it also goes into /server_info, from where /metrics reads
it, so that every scrape costs one round trip and --dp-size > 1 merges it like the other counters), and
`cache_stats` adds the largest prefixes of the tree, which the front end decodes into words.

KV slots are split the way an operator thinks of them, each slot in exactly one part:
- in use: owned by running requests (computed, not inserted yet) or cached and locked by one;
- pinned: cached under a pin and not locked (a pinned node that a running request also locks counts as in use);
- cached: every other cached slot, evictable;
- free.
kv_in_use + kv_pinned + kv_cached + kv_free == kv_total is the scheduler's KV-slot invariant.
The host tier (--hicache-size) is memory beside the pool, reported as its own numbers.
"""

from __future__ import annotations

from radixserve.protocol import CachedPrefix, CacheStats, pack_i32

LARGEST_PREFIXES = 10


def cache_numbers(scheduler) -> dict[str, int | float | str | bool | None]:
    s = scheduler
    tree = s.tree
    usage = s.kv_usage()
    # The tree's protected tokens are locked, pinned or both; a locked one counts as in use.
    pinned = usage["protected"] - tree.locked_size
    computed, hit = s.stats.prefill_tokens_computed, s.stats.cached_prompt_tokens
    host = s.host_tier  # None without --hicache-size
    return {
        "kv_total": usage["total"],
        "kv_free": usage["free"],
        "kv_cached": usage["evictable"],
        "kv_in_use": usage["owned"] + tree.locked_size,
        "kv_pinned": pinned,
        "num_pins": len(tree.list_pins()),
        "prompt_tokens_computed": computed,
        "prompt_tokens_cached": hit,
        # Of every prompt token the scheduler needed, the share it found in the cache (since start).
        "cache_hit_rate": hit / (computed + hit) if computed + hit else 0.0,
        "decode_tokens": s.stats.decode_tokens,
        "steps": s.stats.steps,
        "eviction_policy": tree.eviction_policy,
        "evicted_tokens": tree.evicted_tokens,
        "radix_cache": not tree.disable,
        "hicache": host is not None,
        "hicache_capacity_tokens": host.capacity_tokens if host is not None else 0,
        "hicache_tokens": host.size_tokens if host is not None else 0,
        "hicache_hits": host.hits if host is not None else 0,
        "hicache_loaded_tokens": host.loaded_tokens if host is not None else 0,
        "hicache_saved_tokens": host.saved_tokens if host is not None else 0,
    }


def cache_stats(scheduler, request_id: str) -> CacheStats:
    s = scheduler
    numbers = {"num_running": s.num_running, "num_waiting": len(s.waiting), **cache_numbers(s)}
    prefixes = [
        CachedPrefix(
            pack_i32(p["tokens"]),
            int(p["num_tokens"]),
            int(p["hits"]),
            float(p["last_use"]),
            bool(p["pinned"]),
            p["namespace"],
        )
        for p in s.tree.largest_prefixes(LARGEST_PREFIXES)
    ]
    return CacheStats(request_id, numbers, prefixes)


# What --dp-size > 1 sums over the replicas (the rest, settings, is the first replica's).
COUNTS = (
    "num_running",
    "num_waiting",
    "kv_total",
    "kv_free",
    "kv_cached",
    "kv_in_use",
    "kv_pinned",
    "prompt_tokens_computed",
    "prompt_tokens_cached",
    "decode_tokens",
    "steps",
    "evicted_tokens",
    "hicache_capacity_tokens",
    "hicache_tokens",
    "hicache_hits",
    "hicache_loaded_tokens",
    "hicache_saved_tokens",
)


def merge_cache_numbers(replicas: list[dict]) -> dict:
    """--dp-size > 1: the whole server's cache numbers from the replicas' (cache_numbers or /server_info dicts):
    counts summed, the hit rate recomputed from the sums."""
    merged = {key: sum(r[key] for r in replicas) for key in COUNTS if all(key in r for r in replicas)}
    computed, hit = merged["prompt_tokens_computed"], merged["prompt_tokens_cached"]
    merged["cache_hit_rate"] = hit / (computed + hit) if computed + hit else 0.0
    if all("num_pins" in r for r in replicas):
        # Every pin is kept on every replica (scheduler_service/dp_pins.py): the server has as many as one replica.
        merged["num_pins"] = max(r["num_pins"] for r in replicas)
    return merged


def merge_cache_stats(request_id: str, replies: list[CacheStats]) -> CacheStats:
    """--dp-size > 1: merged numbers, and the largest prefixes of all the replicas' trees; a prefix that several
    replicas hold (a pinned system prompt is on every one) is listed once, with their hits summed."""
    numbers = {**replies[0].numbers, **merge_cache_numbers([r.numbers for r in replies])}
    same: dict[tuple, CachedPrefix] = {}
    for p in (p for r in replies for p in r.largest_prefixes):
        key = (p.first_tokens, p.num_tokens, p.namespace)
        seen = same.get(key)
        same[key] = (
            p
            if seen is None
            else CachedPrefix(
                p.first_tokens,
                p.num_tokens,
                seen.hits + p.hits,
                max(seen.last_use, p.last_use),
                seen.pinned or p.pinned,
                p.namespace,
            )
        )
    prefixes = sorted(same.values(), key=lambda p: p.num_tokens, reverse=True)
    return CacheStats(request_id, numbers, prefixes[:LARGEST_PREFIXES])
