"""Soak test: N concurrent streaming clients for T minutes against one server, then the questions an operator asks
of a server that has run for a while: did any request fail, is the KV accounting whole once it is idle, and does the
memory of any process keep growing?

    python -m bench.soak --clients 1000 --minutes 10                       # starts launch.py with a tiny model
    python -m bench.soak --url http://127.0.0.1:30000 --launcher-pid PID   # any running server

Each client sends a streamed /v1/completions request, reads it to the end and sends the next, until the time is up
(requests in flight then finish; none is cut off). A request fails on a non-200 status, an error event, a broken
stream, or a stream that ends without `data: [DONE]` and a finish_reason. RSS (VmRSS) of launch.py and every process
below it is read from /proc every --sample-s seconds: with --url, pass --launcher-pid (or no RSS is recorded).
Writes a JSON record (command, figures, samples) and a PNG of RSS over time; prints a summary."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import httpx

from radixserve.runtime.process_util import process_tree_argv
from radixserve.testing.tiny_models import tiny_model_dir

from bench.server_process import start_server

RSS_TOLERANCE = 0.05  # no process's RSS at the end more than 5% above its value after the first minute
BASELINE_S = 60.0


# ---------------------------------------------------------------------------------------------- process memory


def process_tree(root: int) -> dict[int, str]:
    """root and its descendants, each named by what it runs (launch.py, worker-0, scheduler, tokenizer)."""
    return {pid: process_name(argv, pid) for pid, argv in process_tree_argv(root).items()}


def process_name(argv: list[str], pid: int) -> str:
    if "launch.py" in " ".join(argv):
        return "launch.py"
    if "-m" in argv:
        module = argv[argv.index("-m") + 1]
        if module == "radixserve.worker" and "--rank" in argv:
            return f"worker-{argv[argv.index('--rank') + 1]}"
        return module.removesuffix("_service")
    return f"pid {pid}"


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------- load


@dataclass
class Tally:
    completed: int = 0
    chunks: int = 0  # streamed events carrying text (about one token each)
    failures: Counter = field(default_factory=Counter)
    failure_examples: dict[str, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        self.failure_examples.setdefault(kind, detail[:500])


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, tally: Tally) -> None:
    start = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                tally.fail(f"HTTP {response.status}", await response.text())
                return
            finish_reason, done, chunks = None, False, 0
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.fail("error event", line)
                    return
                chunks += 1
                finish_reason = event["choices"][0].get("finish_reason") or finish_reason
            if not done or finish_reason is None:
                tally.fail("stream ended early", f"done={done} finish_reason={finish_reason}")
                return
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
        tally.fail(type(e).__name__, repr(e))
        return
    tally.completed += 1
    tally.chunks += chunks
    tally.latencies.append(time.monotonic() - start)


async def client_loop(session, url: str, index: int, max_tokens: int, stop_at: float, tally: Tally) -> None:
    n = 0
    while time.monotonic() < stop_at:
        # Each request differs (no cache hit makes it free) but shares a prefix with the others (the radix cache
        # is exercised: inserts, matches, evictions).
        body = {
            "prompt": f"Soak client {index} request {n}: tell me a story.",
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0.7,
            "seed": index * 100003 + n,
            "ignore_eos": True,
        }
        await one_stream(session, url, body, tally)
        n += 1


async def sample_rss(launcher_pid: int | None, t0: float, samples: list[dict], every_s: float) -> None:
    while launcher_pid is not None:
        now = time.monotonic() - t0
        for pid, name in process_tree(launcher_pid).items():
            rss = rss_mib(pid)
            if rss is not None:
                samples.append({"t_s": round(now, 1), "process": name, "pid": pid, "rss_mib": round(rss, 2)})
        await asyncio.sleep(every_s)


async def run_soak(ns, url: str, launcher_pid: int | None) -> tuple[Tally, list[dict], float]:
    tally, samples = Tally(), []
    t0 = time.monotonic()
    stop_at = t0 + ns.minutes * 60
    sampler = asyncio.create_task(sample_rss(launcher_pid, t0, samples, ns.sample_s))
    connector = aiohttp.TCPConnector(limit=0)  # one connection per client, no pool limit
    timeout = aiohttp.ClientTimeout(total=None, sock_read=ns.read_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client_loop(session, url, i, ns.max_tokens, stop_at, tally) for i in range(ns.clients)))
    elapsed = time.monotonic() - t0
    sampler.cancel()  # and one last sample, after the load
    for pid, name in process_tree(launcher_pid).items() if launcher_pid else []:
        if (rss := rss_mib(pid)) is not None:
            samples.append({"t_s": round(time.monotonic() - t0, 1), "process": name, "pid": pid, "rss_mib": rss})
    return tally, samples, elapsed


# ---------------------------------------------------------------------------------------------- results


def wait_for_idle(url: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        idle = info["num_running"] == 0 and info["num_waiting"] == 0 and info.get("num_requests_in_flight", 0) == 0
        if idle or time.monotonic() > deadline:
            return info


def kv_invariant_whole(info: dict) -> bool:
    in_use = info["kv_owned"] + info["kv_protected"]
    return (
        info["kv_invariant_ok"] is True
        and in_use == 0
        and info["kv_free"] + info["kv_evictable"] + in_use == info["kv_total"]
    )


def rss_summary(samples: list[dict]) -> dict[str, dict]:
    """Per process: RSS after the first minute (the first sample at or past it), at the end, the peak, and whether
    the end is at most RSS_TOLERANCE above the first-minute value. Only growth counts: a leak grows, while a worker
    whose batch empties during the drain hands its working memory back and ends below its baseline (2026-11-23:
    -15.6%, failed by the earlier two-sided rule)."""
    out = {}
    for name in dict.fromkeys(s["process"] for s in samples):
        series = [s for s in samples if s["process"] == name]
        base = next((s for s in series if s["t_s"] >= BASELINE_S), series[0])
        end = series[-1]
        change = (end["rss_mib"] - base["rss_mib"]) / base["rss_mib"]
        out[name] = {
            "pid": end["pid"],
            "start_mib": series[0]["rss_mib"],
            "after_1_min_mib": base["rss_mib"],
            "end_mib": end["rss_mib"],
            "peak_mib": max(s["rss_mib"] for s in series),
            "change_since_1_min": round(change, 4),
            "within_tolerance": change <= RSS_TOLERANCE,
        }
    return out


def plot_rss(samples: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name in dict.fromkeys(s["process"] for s in samples):
        series = [s for s in samples if s["process"] == name]
        ax.plot([s["t_s"] / 60 for s in series], [s["rss_mib"] for s in series], label=name)
    ax.axvline(BASELINE_S / 60, color="grey", linestyle=":", label="1 minute (baseline)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="server to soak (default: start launch.py with --model on the CPU)")
    parser.add_argument("--launcher-pid", type=int, help="launch.py's pid, to sample RSS of a server given by --url")
    parser.add_argument("--model", help="model directory for the server started here (default: tiny Llama)")
    parser.add_argument("--server-args", default="", help="extra launch.py flags for the server started here")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument(
        "--read-timeout-s", type=float, default=600.0, help="a stream silent this long counts as failed"
    )
    parser.add_argument("--out", default="bench/results/soak-cpu", help="path prefix of the .json and .png written")
    ns = parser.parse_args()

    proc = log = None
    if ns.url is None:
        proc, url, log = start_server(
            ns.model or str(tiny_model_dir("llama")),
            ["--device", "cpu", *shlex.split(ns.server_args)],
            "radixserve-soak-",
        )
        launcher_pid = proc.pid
    else:
        url, launcher_pid = ns.url.rstrip("/"), ns.launcher_pid
    started = datetime.now(timezone.utc)
    try:
        tally, samples, elapsed = asyncio.run(run_soak(ns, url, launcher_pid))
        info = wait_for_idle(url)
        server_alive = proc is None or proc.poll() is None
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    rss = rss_summary(samples) if samples else {}
    record = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "bench.soak", *sys.argv[1:]]),
        "date_utc": started.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "url": url,
        "clients": ns.clients,
        "minutes": ns.minutes,
        "max_tokens": ns.max_tokens,
        "elapsed_s": round(elapsed, 1),
        "requests_completed": tally.completed,
        "chunks_streamed": tally.chunks,
        "requests_failed": sum(tally.failures.values()),
        "failures": dict(tally.failures),
        "failure_examples": tally.failure_examples,
        "latency_s": {"p50": percentile(tally.latencies, 0.5), "p99": percentile(tally.latencies, 0.99)},
        "server_alive_at_end": server_alive,
        "kv_invariant_whole": kv_invariant_whole(info),
        "server_info_at_end": {k: v for k, v in info.items() if k != "server_args"},
        "rss": rss,
        "rss_within_tolerance": all(r["within_tolerance"] for r in rss.values()) if rss else None,
        "rss_samples": samples,
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    if samples:
        plot_rss(
            samples,
            out.with_suffix(".png"),
            f"RSS under {ns.clients} streaming clients for {ns.minutes:g} min ({started:%Y-%m-%d})",
        )
    print(
        f"{tally.completed} requests completed, {record['requests_failed']} failed {dict(tally.failures)}, "
        f"{tally.chunks} chunks streamed in {elapsed:.0f} s; latency p50 {record['latency_s']['p50']} s, "
        f"p99 {record['latency_s']['p99']} s"
    )
    print(
        f"KV invariant at idle: {'whole' if record['kv_invariant_whole'] else 'BROKEN'} "
        f"({ {k: info[k] for k in ('kv_total', 'kv_free', 'kv_evictable', 'kv_owned', 'kv_protected')} })"
    )
    for name, r in rss.items():
        print(
            f"RSS {name:>10}: start {r['start_mib']:.0f} MiB, after 1 min {r['after_1_min_mib']:.0f}, "
            f"end {r['end_mib']:.0f}, peak {r['peak_mib']:.0f} ({r['change_since_1_min']:+.1%} since 1 min)"
        )
    if log is not None:
        print(f"server log: {log}")
    ok = record["requests_failed"] == 0 and record["kv_invariant_whole"] and server_alive
    return 0 if ok and record["rss_within_tolerance"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
