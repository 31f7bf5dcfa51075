"""Serving benchmark through the HTTP server: chat-like traffic with long shared system prompts, streamed, with a
bounded number of concurrent clients. Starts `launch.py` itself (dummy weights of a real shape) once per mode.

    python -m bench.serving_bench --config qwen3-0.6b --tokenizer DIR [--requests 512 --concurrency 128 --repeats 3]
        [--request-rate 80]   # Poisson arrivals at 80 requests/s instead of a closed loop of clients

Prints per mode: request throughput, output tokens/s, time to first token (mean, p50, p99), inter-token latency
(mean, p99), and the share of prompt tokens served from the radix cache (usage.prompt_tokens_details); each figure
is the median of --repeats runs on one warmed-up server (cache flushed before each) with its spread."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from radixserve.testing.tiny_models import dummy_config_dir

from bench.server_process import start_server
from bench.run_record import check_repeats, run_record, summarize_rows


def workload(ns, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    systems = [rng.integers(100, vocab - 100, ns.system_len).tolist() for _ in range(ns.groups)]
    prompts = [
        systems[i % ns.groups] + rng.integers(100, vocab - 100, ns.question_len).tolist() for i in range(ns.requests)
    ]
    return [prompts[i] for i in rng.permutation(len(prompts))]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times, usage, last_chunk = [], None, None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                last_chunk = time.perf_counter()
                if chunk["choices"][0].get("text"):
                    token_times.append(last_chunk)
    ttft = token_times[0] - start if token_times else float("nan")
    itl = np.diff(token_times).tolist() if len(token_times) > 1 else []
    # Per token (vLLM's TPOT): a token whose text is held back (part of a UTF-8 character; with dummy weights ~40%
    # of tokens) sends no chunk, so the gaps between text chunks span ~1.7 tokens and are not inter-token times.
    n = usage["completion_tokens"] if usage else 0
    tpot = (last_chunk - token_times[0]) / (n - 1) if token_times and n > 1 else None
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "usage": usage, "end": time.perf_counter()}


def arrival_times(n: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: all at once (a closed loop of clients, bounded by the
    concurrency) without a rate, else a Poisson process of that many requests per second (exponential gaps, as
    vLLM's benchmark_serving sends them), so that two servers compared see the same offered load whatever their
    speed. In a closed loop a faster server also gets its next requests sooner: more prefill work per second."""
    if not request_rate:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, n)
    return (np.cumsum(gaps) - gaps[0]).tolist()


async def loop_lag(samples: list[float], period_s: float = 0.002) -> None:
    """How late this client's event loop wakes a sleeper, again and again until cancelled. While the loop is late,
    every stream's chunks wait to be read, first tokens included, and the client times the server slower than it
    is: a closed loop that streams twice the tokens a second also keeps its client twice as busy."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(period_s)
        samples.append(time.perf_counter() - start - period_s)


async def run_load(
    url: str, prompts: list[list[int]], output_len: int, concurrency: int, request_rate: float | None = None
) -> dict:
    # aiohttp rather than httpx: profiled on the H100 machine, httpx's connection pool kept this client 71% busy
    # at 128 streams (and capped the measured throughput) while the server's tokenizer process was 27% busy.
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    arrivals = arrival_times(len(prompts), request_rate)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()

        async def guarded(p, at):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with gate:
                return await one_request(session, url, model, p, output_len)

        lags: list[float] = []
        monitor = asyncio.create_task(loop_lag(lags))
        start, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(guarded(p, at) for p, at in zip(prompts, arrivals)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        monitor.cancel()
    ttfts = sorted(r["ttft"] for r in results)
    itls = [x for r in results for x in r["itl"]]
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    return {
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(prompts) / elapsed, 2),
        "output_tok_per_s": round(completion / elapsed),
        "ttft_mean_ms": round(1e3 * statistics.mean(ttfts), 1),
        "ttft_p50_ms": round(1e3 * ttfts[len(ttfts) // 2], 1),
        "ttft_p99_ms": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "itl_mean_ms": round(1e3 * statistics.mean(itls), 2) if itls else None,
        "itl_p99_ms": round(1e3 * float(np.percentile(itls, 99)), 2) if itls else None,
        "tpot_mean_ms": round(1e3 * statistics.mean(tpots), 2) if tpots else None,
        "cached_prompt_share": round(cached / prompt_tokens, 3),
        # The client's own share in the figures above: its CPU time over the run's, and its event loop's lateness.
        "client_cpu_share": round(cpu / elapsed, 3),
        "client_loop_lag_p50_ms": round(1e3 * float(np.percentile(lags, 50)), 2) if lags else None,
        "client_loop_lag_p99_ms": round(1e3 * float(np.percentile(lags, 99)), 2) if lags else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--request-rate", type=float, default=None, help="requests per second, Poisson arrivals (default: all at once)"
    )
    parser.add_argument("--server-args", default="", help="extra launch.py flags for every mode")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (>= 3); figures are medians")
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    record = run_record()
    print(f"{record['date']}  {record['gpu']}  {record['command']}  (commit {record['git_commit']})", flush=True)
    model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = workload(ns, vocab)
    print(
        f"{ns.config} (dummy weights): {ns.requests} streamed requests, {ns.concurrency} concurrent clients, "
        f"{ns.groups} system prompts of {ns.system_len} tokens + {ns.question_len}-token questions, "
        f"{ns.output_len} output tokens each",
        flush=True,
    )
    rows = {}
    for mode, flags in {"radix cache": [], "no cache": ["--disable-radix-cache"]}.items():
        server, url, log = start_server(
            model_dir, ["--load-format", "dummy", *flags, *ns.server_args.split()], "radixserve-serving-bench-"
        )
        try:
            # Warm-up on the same prompts: every Triton kernel variant gets compiled before the clock starts.
            asyncio.run(run_load(url, prompts, 4, ns.concurrency))
            runs = []
            for _ in range(ns.repeats):
                assert httpx.post(f"{url}/flush_cache", timeout=30).json()["success"]
                runs.append(asyncio.run(run_load(url, prompts, ns.output_len, ns.concurrency, ns.request_rate)))
                info = httpx.get(f"{url}/server_info", timeout=30).json()
                runs[-1]["kv_invariant_ok_after"] = info["kv_invariant_ok"]
            rows[mode] = summarize_rows(runs)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
            log.unlink(missing_ok=True)
        print(
            f"{mode:12s} "
            + ", ".join(
                f"{k} {v['median']:g} (spread {v['spread_pct']:g}%)" if isinstance(v, dict) else f"{k} {v}"
                for k, v in rows[mode].items()
            ),
            flush=True,
        )
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({**record, "args": vars(ns), "results": rows}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
