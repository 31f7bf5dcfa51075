"""Prometheus metrics of the HTTP front end, served on GET /metrics.

Latencies are measured here, where the client's clock runs: time to first token and end-to-end latency start when
the HTTP request was parsed, so they include tokenization and the trip through the scheduler queue. Scheduler-side
numbers (queue time, running / waiting requests, KV usage) arrive with every BatchOutput and are mirrored here.

The radix cache's numbers (hit rate, pinned tokens, host-tier hits, evictions by policy) are totals the scheduler
keeps (scheduler_service/cache_stats.py); /metrics refreshes them from /server_info's answer and CacheMetrics exposes
them as they are, counters included, rather than re-counting them here.

Each server owns its own CollectorRegistry rather than prometheus-client's global one, so that several apps can
live in one Python process (tests) without "duplicated timeseries" errors.

With --api-server-count > 1 (`shared_dir`) every front end writes its values to prometheus-client's multiprocess
files (PROMETHEUS_MULTIPROC_DIR, set by the launcher before prometheus-client is imported) and /metrics merges every
process's files, so any front end reports the whole server: counters and histograms summed, requests in flight
summed, the scheduler's gauges as most recently reported by any front end. Which front end took how many requests is
radixserve:api_server_requests_total{api_server=...}.
"""

from __future__ import annotations

import asyncio
import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

from radixserve.protocol import SchedulerLoad

PREFIX = "radixserve:"

# Buckets spanning a fast GPU decode step (ms) to a long CPU prefill (tens of seconds).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


SHARED_SYNC_S = 1.0  # with several front ends, how often each one writes its chat segment cache's numbers


class ServerMetrics:
    def __init__(self, model_name: str, api_server: int = 0, shared_dir: str | None = None):
        """api_server: this front end's index; shared_dir: the multiprocess directory, with several front ends."""
        if shared_dir is not None and not getattr(values.ValueClass, "_multiprocess", False):
            raise RuntimeError("PROMETHEUS_MULTIPROC_DIR must be set before prometheus_client is imported")
        self.shared_dir = shared_dir
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, list(labels), registry=r).labels(**labels)

        def gauge(name, doc, merged="mostrecent"):
            # merged: how several front ends' values combine (ignored with one): the scheduler's numbers as last
            # reported, or a sum of the front ends' own
            return Gauge(PREFIX + name, doc, list(labels), registry=r, multiprocess_mode=merged).labels(**labels)

        # Observed per token, so fed once per scheduler batch (request_manager._on_batch).
        self.time_to_first_token = BatchHistogram(
            PREFIX + "time_to_first_token_seconds",
            "From request receipt to the first generated token.",
            TTFT_BUCKETS,
            model_name,
            shared=shared_dir is not None,
        )
        self.inter_token_latency = BatchHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Between consecutive generated tokens of one sequence.",
            ITL_BUCKETS,
            model_name,
            shared=shared_dir is not None,
        )
        r.register(self.time_to_first_token)
        r.register(self.inter_token_latency)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "From request receipt to the last token of a sequence.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "queue_time_seconds", "Time a sequence waited in the scheduler before admission.", QUEUE_BUCKETS
        )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted sequences.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens delivered to clients.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the radix cache.")
        self._finished = Counter(
            PREFIX + "requests_finished",
            "Finished sequences by finish reason.",
            ["model_name", "finish_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.api_server_requests = Counter(
            PREFIX + "api_server_requests",
            "Generating requests taken by each HTTP front end (--api-server-count).",
            ["model_name", "api_server"],
            registry=r,
        ).labels(model_name=model_name, api_server=str(api_server))

        self.num_requests_in_flight = gauge(
            "num_requests_in_flight", "Sequences submitted by the HTTP front ends and not finished.", merged="sum"
        )
        self.num_running = gauge("num_running_reqs", "Sequences holding KV in the scheduler (decoding or prefilling).")
        self.num_waiting = gauge("num_waiting_reqs", "Sequences queued in the scheduler.")
        self.kv_slots_used = gauge("kv_slots_used", "KV slots owned by running sequences or locked in the cache.")
        self.kv_slots_cached = gauge("kv_slots_cached", "KV slots holding evictable cached prefixes.")
        self.kv_slots_total = gauge("kv_slots_total", "KV slots in the pool.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV slots in use by requests (0..1).")

        # --dp-size > 1: the same per replica (label dp_rank), from /server_info's dp<i>_ numbers.
        replica_labels = ["model_name", "dp_rank"]
        recent = {"registry": r, "multiprocess_mode": "mostrecent"}
        self._replica_running = Gauge(
            PREFIX + "replica_num_running_reqs", "Sequences holding KV in one replica.", replica_labels, **recent
        )
        self._replica_waiting = Gauge(
            PREFIX + "replica_num_waiting_reqs", "Sequences queued in one replica.", replica_labels, **recent
        )
        self._replica_cached = Gauge(
            PREFIX + "replica_cached_prompt_tokens",
            "Prompt tokens one replica served from its radix cache so far.",
            replica_labels,
            **recent,
        )
        self.cache = CacheMetrics(model_name)
        r.register(self.cache)
        self.segments: SegmentCacheMetrics | None = None

    def watch_segment_cache(self, cache) -> None:
        """The tokenizer's cache of chat prompt pieces (tokenizer_service/segment_cache.py), read at each scrape (with
        several front ends, written to the shared files every SHARED_SYNC_S by sync_shared_loop and at a scrape)."""
        self.segments = SegmentCacheMetrics(self._model_name, cache, self.registry if self.shared_dir else None)
        if self.shared_dir is None:
            self.registry.register(self.segments)

    async def sync_shared_loop(self) -> None:
        """Several front ends: what a scrape of another front end cannot read from this process's memory."""
        while True:
            await asyncio.sleep(SHARED_SYNC_S)
            if self.segments is not None:
                self.segments.sync()

    def update_cache(self, info: dict) -> None:
        """The scheduler's cache numbers, from a /server_info answer."""
        self.cache.numbers = dict(info)

    def update_replicas(self, info: dict) -> None:
        dp_rank = 0
        while f"dp{dp_rank}_num_running" in info:
            labels = {"model_name": self._model_name, "dp_rank": str(dp_rank)}
            self._replica_running.labels(**labels).set(info[f"dp{dp_rank}_num_running"])
            self._replica_waiting.labels(**labels).set(info[f"dp{dp_rank}_num_waiting"])
            self._replica_cached.labels(**labels).set(info[f"dp{dp_rank}_cached_prompt_tokens"])
            dp_rank += 1

    def observe_finish(self, finish_reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finish_reason=finish_reason).inc()

    def update_load(self, load: SchedulerLoad) -> None:
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.kv_slots_used.set(load.kv_slots_used)
        self.kv_slots_cached.set(load.kv_slots_cached)
        self.kv_slots_total.set(load.kv_slots_total)
        self.kv_cache_usage.set(load.kv_slots_used / load.kv_slots_total if load.kv_slots_total else 0.0)

    def render(self) -> bytes:
        if self.shared_dir is None:
            return generate_latest(self.registry)
        if self.segments is not None:
            self.segments.sync()
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self.shared_dir)  # every front end's files, this one's included
        merged.register(self.cache)  # the scheduler's own totals, as this front end just asked for them
        return generate_latest(merged)


# (metric name, kind, the scheduler's number, help); counters get "_total" appended by prometheus-client.
CACHE_METRICS = (
    (
        "cache_hit_rate",
        "gauge",
        "cache_hit_rate",
        "Share of the prompt tokens the scheduler needed that it found in the radix cache, since start (0..1).",
    ),
    ("cache_prompt_tokens_cached", "counter", "prompt_tokens_cached", "Prompt tokens served from the radix cache."),
    (
        "cache_prompt_tokens_computed",
        "counter",
        "prompt_tokens_computed",
        "Prompt tokens computed by prefill (recomputation after a retraction included).",
    ),
    ("cache_pinned_tokens", "gauge", "kv_pinned", "KV slots held by pinned prefixes and not locked by a request."),
    ("cache_pins", "gauge", "num_pins", "Pinned prefixes (POST /v1/cache/pin, --pin-prompts)."),
    ("kv_slots_pinned", "gauge", "kv_pinned", "KV slots held by pinned prefixes (same as cache_pinned_tokens)."),
    ("hicache_hits", "counter", "hicache_hits", "Prefix hits served by a copy from the host-memory tier."),
    (
        "hicache_loaded_tokens",
        "counter",
        "hicache_loaded_tokens",
        "Tokens of KV copied from host memory back to the KV pool.",
    ),
    ("hicache_saved_tokens", "counter", "hicache_saved_tokens", "Tokens of evicted KV copied to host memory."),
    ("hicache_tokens", "gauge", "hicache_tokens", "Tokens of KV held in host memory (--hicache-size)."),
    ("hicache_capacity_tokens", "gauge", "hicache_capacity_tokens", "Tokens of KV the host-memory tier can hold."),
)


class BatchHistogram:
    """A histogram fed a batch of observations at a time: bucket counts in a list, exposed by a collector.
    prometheus-client's Histogram takes a lock and walks its buckets per observation, per token of every stream
    (128 streams: a few hundred microseconds a step on the event loop); this costs a C bisect per value. Only the
    event loop writes it, and a scrape reads whole integers, so no lock is needed."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str, shared: bool = False):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        # Several front ends: each batch's counts also go to this process's multiprocess file, as prometheus-client's
        # own Histogram writes its buckets there (per observation; here per touched bucket of a batch).
        self._shared = None
        if shared:
            labels = ["model_name", "le"]
            self._shared = [
                values.ValueClass("histogram", name, name + "_bucket", labels, [model_name, floatToGoString(b)], doc)
                for b in [*self.bounds, float("inf")]
            ]
            self._shared_sum = values.ValueClass("histogram", name, name + "_sum", ["model_name"], [model_name], doc)

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        if self._shared is None:
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1
        else:
            added: dict[int, int] = {}
            for value in values:
                i = bisect.bisect_left(bounds, value)
                added[i] = added.get(i, 0) + 1
            for i, n in added.items():
                counts[i] += n
                self._shared[i].inc(n)
        total = sum(values)
        if self._shared is not None and values:
            self._shared_sum.inc(total)
        self.sum += total

    def collect(self):
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], cumulative, sum_value=self.sum)
        yield family


class CacheMetrics:
    """A prometheus-client collector of the scheduler's cache numbers as last reported (nothing before the first
    report, so a scrape never shows a made-up zero)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.numbers: dict = {}

    def collect(self):
        numbers = self.numbers
        if not numbers:
            return
        for name, kind, key, doc in CACHE_METRICS:
            value = numbers.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                PREFIX + name, doc, labels=["model_name"]
            )
            family.add_metric([self.model_name], value)
            yield family
        if isinstance(numbers.get("evicted_tokens"), int):
            # Labelled by the policy in force (--radix-eviction-policy), so runs under different policies compare.
            evicted = CounterMetricFamily(
                PREFIX + "cache_evicted_tokens",
                "Cached tokens evicted from the KV pool, by eviction policy.",
                labels=["model_name", "policy"],
            )
            evicted.add_metric([self.model_name, str(numbers.get("eviction_policy", "lru"))], numbers["evicted_tokens"])
            yield evicted


SEGMENT_METRICS = (
    ("chat_segment_cache_hits", "counter", "hits", "Chat prompt pieces whose ids were cached."),
    ("chat_segment_cache_misses", "counter", "misses", "Chat prompt pieces encoded (not cached)."),
    ("chat_segment_cache_evictions", "counter", "evictions", "Pieces dropped to stay in budget."),
    ("chat_segment_cache_bytes", "gauge", "bytes", "Estimated bytes the cached pieces hold."),
)


class SegmentCacheMetrics:
    """A collector of the chat piece cache's numbers: pieces found and encoded, and the bytes it holds. With several
    front ends (shared_registry given) each process's cache is its own: sync() writes its numbers as counters and a
    summed gauge of the multiprocess files instead, which /metrics adds up over the front ends."""

    def __init__(self, model_name: str, cache, shared_registry: CollectorRegistry | None = None):
        self.model_name, self.cache = model_name, cache
        self._shared: dict[str, Counter | Gauge] = {}
        self._written: dict[str, int] = {}
        for name, kind, attr, doc in SEGMENT_METRICS if shared_registry is not None else ():
            if kind == "counter":
                metric = Counter(PREFIX + name, doc, ["model_name"], registry=shared_registry)
            else:
                metric = Gauge(PREFIX + name, doc, ["model_name"], registry=shared_registry, multiprocess_mode="sum")
            self._shared[attr], self._written[attr] = metric.labels(model_name), 0

    def sync(self) -> None:
        for attr, metric in self._shared.items():
            value = getattr(self.cache, attr)
            if isinstance(metric, Gauge):
                metric.set(value)
            elif value > self._written[attr]:
                metric.inc(value - self._written[attr])
            self._written[attr] = value

    def collect(self):
        for name, kind, attr, doc in SEGMENT_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                PREFIX + name, doc, labels=["model_name"]
            )
            family.add_metric([self.model_name], getattr(self.cache, attr))
            yield family
