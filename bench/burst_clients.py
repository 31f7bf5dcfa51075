"""The client side of bench/ttft_under_load.py's burst: N streamed chat requests sent at once with the official `openai`
client, split over client processes that build their clients, meet at a barrier and send together; per request its
time to the first content chunk, the gaps between chunks and its usage; per burst the figures of `burst`."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import statistics
import time

import numpy as np

# The load generator's processes for a burst of 128 users (8 requests each). Each process builds and sends its
# requests on one event loop, with the openai package's ~1 ms of Python per request, and reads every one of its
# streams there: with 4 processes (sessions 9-13) that serialization was part of every first token. The same server,
# 4 / 8 / 16 processes interleaved, 5 bursts each on one H100 host: TTFT p50 112.4 / 89.9 / 85.6 ms, p99 151.6 / 121.2 /
# 114.9 (bench/results/ttft-under-load-h100-session13/client-procs-ab.txt): the first token kept falling until 16, so
# below that the figure was partly the clients'. Users on their own machines share no loop.
CLIENT_PROCS = 16


def default_client_procs() -> int:
    """CLIENT_PROCS, or one per CPU on a smaller machine."""
    return max(1, min(CLIENT_PROCS, os.cpu_count() or 2))


async def _one(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    start, start_ns = time.perf_counter(), time.monotonic_ns()  # (the second on the clock of bench.burst_timeline)
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # Dummy weights may sample special tokens only, whose text is empty when skipped: time them too.
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    times, usage, first_ns = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            first_ns = first_ns or time.monotonic_ns()
    if usage is None:
        raise RuntimeError("a stream ended without usage")
    details = getattr(usage, "prompt_tokens_details", None)
    # No text at all (dummy weights can sample ids past the tokenizer's vocabulary, which decode to nothing): no
    # time to its first token can be seen; counted apart (no_text_requests).
    return {
        "ttft": times[0] - start if times else None,
        "gaps": np.diff(times).tolist(),
        "end": time.time(),
        "decode_s": times[-1] - times[0] if times else 0.0,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": getattr(details, "cached_tokens", 0) or 0,
        "start_ns": start_ns,
        "first_ns": first_ns,
    }


class GcPauses:
    """The cyclic garbage collector's pauses in this process while it is on (gc.callbacks): the longest, in ms."""

    def __init__(self):
        self.longest_ms, self._began = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.longest_ms = max(self.longest_ms, (time.perf_counter() - self._began) * 1e3)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


async def _share(
    url: str, model: str, chats: list[list[dict]], barrier, shared_client: bool, max_tokens: int, freeze_gc: bool
):
    from openai import AsyncOpenAI

    def client():
        return AsyncOpenAI(
            base_url=f"{url}/v1", api_key=os.environ.get("RADIXSERVE_API_KEY", "unused"), max_retries=0, timeout=600
        )

    clients = [client()] * len(chats) if shared_client else [client() for _ in chats]
    # A client process's own full collection (467 ms, caught in one H100 burst of ten) held back every request of
    # that process (bench/results/ttft-under-load-h100.md, session 13): the load generator's pause, not the
    # server's. The heap built so far (the openai package, the clients) is frozen out of the collector for the burst,
    # as the server's processes freeze theirs after start-up; the longest pause left is reported (client_gc_max_ms).
    if freeze_gc:
        gc.collect()
        gc.freeze()
    # Every process starts its requests at the same moment, once all have built their clients: building 32
    # AsyncOpenAI clients (an SSL context each) took over a second on the H100 host, and a fixed lead time let the
    # processes' shares arrive 0.1-0.5 s apart, each competing with the streams of those before it.
    barrier.wait(timeout=300)
    go = time.time()
    try:
        with GcPauses() as pauses:
            results = await asyncio.gather(
                *(_one(c, model, m, max_tokens) for c, m in zip(clients, chats)), return_exceptions=True
            )
        # As text: the openai package's errors do not survive pickling back to the parent process.
        rows = [{"error": repr(r)} if isinstance(r, BaseException) else r for r in results]
        for row in rows:
            row["client_gc_max_ms"] = round(pauses.longest_ms, 1)
        return go, rows
    finally:
        for c in set(clients):
            await c.close()
        gc.unfreeze()


def client_share(
    url: str,
    model: str,
    chats: list[list[dict]],
    barrier,
    shared_client: bool,
    max_tokens: int,
    freeze_gc: bool = True,
):
    """One client process's part of a burst (a multiprocessing target): its start time and its requests' figures.
    freeze_gc: the process's heap kept out of the garbage collector during the burst (_share says why)."""
    return asyncio.run(_share(url, model, chats, barrier, shared_client, max_tokens, freeze_gc))


_manager = None


def start_barrier(parties: int):
    """A barrier the client processes of one burst wait at (from one manager process, started on first use)."""
    global _manager
    if _manager is None:
        _manager = multiprocessing.get_context("spawn").Manager()
    return _manager.Barrier(parties)


def burst(pool, procs: int, url: str, model: str, chats: list[list[dict]], ns) -> dict:
    """All chats at once, split over the client processes: the burst's figures."""
    shares = [share for share in (chats[p::procs] for p in range(procs)) if share]
    barrier = start_barrier(len(shares))
    parts = pool.starmap(
        client_share, [(url, model, share, barrier, ns.shared_client, ns.max_tokens) for share in shares]
    )
    start_at = min(go for go, _ in parts)
    results = [r for _, part in parts for r in part]
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed, the first with {failed[0]}")
    seen = [r for r in results if r["ttft"] is not None]
    ttfts = np.array([r["ttft"] for r in seen]) * 1e3
    gaps = np.array([g for r in results for g in r["gaps"]] or [float("nan")]) * 1e3
    tokens = sum(r["completion_tokens"] for r in results)
    seconds = max(r["end"] for r in results) - start_at
    return {
        "ttft_p50_ms": round(float(np.percentile(ttfts, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ttfts, 99)), 1),
        "ttft_max_ms": round(float(ttfts.max()), 1),
        "itl_mean_ms": round(float(gaps.mean()), 2),
        "itl_p50_ms": round(float(np.percentile(gaps, 50)), 2),
        "itl_p99_ms": round(float(np.percentile(gaps, 99)), 2),
        "tpot_ms": round(1e3 * statistics.mean(r["decode_s"] / max(1, r["completion_tokens"] - 1) for r in seen), 2),
        "no_text_requests": len(results) - len(seen),
        "client_gc_max_ms": max(r["client_gc_max_ms"] for r in results),
        "output_tok_per_s": round(tokens / seconds, 1),
        "requests_per_s": round(len(results) / seconds, 2),
        "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in results), 1),
        "cached_share": round(
            sum(r["cached_tokens"] for r in results) / max(1, sum(r["prompt_tokens"] for r in results)), 4
        ),
    }
