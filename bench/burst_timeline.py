"""Where a burst's first tokens go, across the processes: bench/ttft_under_load.py's burst (N streamed chat requests at
once through the official `openai` client over G cached system prompts) against a server whose processes carry the
hooks of bench/timeline_hooks/sitecustomize.py, then a 10-ms chronology of each timed burst: requests started by the
clients, reaching the app (the first middleware), their prompts built, submitted, the worker's steps, the HTTP
process's batches of outputs (count and milliseconds), first chunks seen by the clients. One clock for every process
(time.monotonic_ns).

    python -m bench.burst_timeline --config qwen3-0.6b --tokenizer DIR --device cuda        # issue 27's burst
    python -m bench.burst_timeline --model DIR --device cpu --requests 32 --max-tokens 8     # any model directory

It showed (bench/results/ttft-under-load-h100.md) that on the H100 host the HTTP process's one event loop takes
requests in at ~1.1-1.3 ms each while the first streams' per-token work shares it."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.server_process import start_server
from bench.process_timeline import read_events
from bench.burst_clients import burst, client_share, default_client_procs, start_barrier
from bench.ttft_under_load import conversations, system_prompts
from radixserve.testing.tiny_models import dummy_config_dir
from radixserve.tokenizer_loading import load_tokenizer

HOOKS = Path(__file__).resolve().parent / "timeline_hooks"
# (label, hooked function, "B" entry or "E" exit)
EVENTS = [
    ("arrived", "HostCheckMiddleware.__call__", "B"),
    ("built", "build_prompts", "B"),
    ("submitted", "RequestManager.submit", "E"),
]


def events_since(directory: Path, since: int) -> list[tuple[int, str, str, str]]:
    """The hooks' events (time, pid, B/E, function) from `since` on, in time order."""
    return [event for event in read_events(directory) if event[0] >= since]


def spans(rows: list[tuple[int, str, str, str]], name: str) -> list[tuple[int, int]]:
    """(begin, end) of each call of a hooked function, paired within its process."""
    out, begun = [], {}
    for at, pid, phase, label in rows:
        if label != name:
            continue
        if phase == "B":
            begun[pid] = at
        elif pid in begun:
            out.append((begun.pop(pid), at))
    return out


def chronology(rows, starts: np.ndarray, firsts: np.ndarray, bin_ms: int, span_ms: int) -> dict:
    """The burst's figures and its table, times relative to the first request's start."""
    t0 = int(starts.min())

    def rel(values) -> np.ndarray:
        return (np.asarray(values, dtype=np.int64) - t0) / 1e6

    series = {"started": rel(starts)}
    for label, name, phase in EVENTS:
        series[label] = rel([at for at, _, p, n in rows if n == name and p == phase and at >= t0])
    series["first chunk"] = rel(firsts)
    steps = rel([b for b, _ in spans(rows, "ModelRunner.prepare") if b >= t0])
    batches = [(b, e) for b, e in spans(rows, "RequestManager._on_batch") if b >= t0]
    batch_at, batch_ms = rel([b for b, _ in batches]), np.array([(e - b) / 1e6 for b, e in batches])
    table = []
    for lo in range(0, span_ms, bin_ms):
        hi = lo + bin_ms
        row = {label: int(((v >= lo) & (v < hi)).sum()) for label, v in series.items()}
        row["steps"] = int(((steps >= lo) & (steps < hi)).sum())
        in_bin = (batch_at >= lo) & (batch_at < hi)
        row["output batches"] = int(in_bin.sum())
        row["output ms"] = round(float(batch_ms[in_bin].sum()), 2)
        table.append({"ms": lo, **row})
    summary = {
        f"{label} p50 / max ms": [round(float(np.percentile(v, 50)), 1), round(float(v.max()), 1)]
        for label, v in series.items()
        if len(v)
    }
    summary["first chunk p99 ms"] = round(float(np.percentile(series["first chunk"], 99)), 1)
    # With several front ends the kernel spreads the connections over them (SO_REUSEPORT): per front end, the
    # requests it took, when its last one was submitted and its milliseconds of output batches.
    front_ends = {}
    for at, pid, phase, name in rows:
        if at < t0:
            continue
        row = front_ends.setdefault(pid, {"requests": 0, "last submitted ms": 0.0, "output ms": 0.0})
        if (name, phase) == ("HostCheckMiddleware.__call__", "B"):
            row["requests"] += 1
        elif (name, phase) == ("RequestManager.submit", "E"):
            row["last submitted ms"] = round(max(row["last submitted ms"], (at - t0) / 1e6), 1)
    for pid in front_ends:
        batches_of_pid = spans([r for r in rows if r[1] == pid], "RequestManager._on_batch")
        front_ends[pid]["output ms"] = round(sum(e - b for b, e in batches_of_pid) / 1e6, 1)
    summary["front ends (requests, last submitted ms, output ms)"] = sorted(
        (r["requests"], r["last submitted ms"], r["output ms"]) for r in front_ends.values() if r["requests"]
    )
    return {"summary": summary, "table": table}


def print_burst(index: int, result: dict) -> None:
    print(f"== burst {index}: " + ", ".join(f"{k} {v}" for k, v in result["summary"].items()), flush=True)
    columns = list(result["table"][0])
    print("  " + " | ".join(columns), flush=True)
    for row in result["table"]:
        print("  " + " | ".join(f"{row[c]:>{len(c)}}" for c in columns), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an HF model directory (with its tokenizer)")
    parser.add_argument("--config", help="a real shape with dummy weights, e.g. qwen3-0.6b; needs --tokenizer")
    parser.add_argument("--tokenizer", help="tokenizer directory (with --config)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1520)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=default_client_procs())
    parser.add_argument("--bursts", type=int, default=2, help="timed bursts, after two untimed ones")
    parser.add_argument("--bin-ms", type=int, default=10)
    parser.add_argument("--span-ms", type=int, default=300, help="how much of each burst the table shows")
    parser.add_argument("--server-flags", default="", help="more launch.py flags")
    parser.add_argument(
        "--client-gc-as-is",
        action="store_true",
        help="leave the client processes' garbage collector as it is during a burst (by default their heap is frozen:"
        " bench/burst_clients.py _share)",
    )
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    if (ns.model is None) == (ns.config is None) or (ns.config and not ns.tokenizer):
        parser.error("exactly one of --model and --config (which needs --tokenizer)")
    model_dir = ns.model or str(dummy_config_dir(ns.config, ns.tokenizer))
    flags = ["--device", ns.device, *(["--load-format", "dummy"] if ns.config else []), *ns.server_flags.split()]
    prompts = system_prompts(load_tokenizer(ns.tokenizer or model_dir), ns.groups, ns.system_tokens, 0)
    timeline = Path(tempfile.mkdtemp(prefix="radixserve-burst-timeline-"))
    pool = multiprocessing.get_context("spawn").Pool(ns.client_procs)  # before the hooks reach the environment
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)
    os.environ["RADIXSERVE_TIMELINE_DIR"] = str(timeline)
    try:
        server, url, log = start_server(model_dir, flags, "radixserve-burst-timeline-")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results = []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = argparse.Namespace(shared_client=False, max_tokens=ns.max_tokens)
        burst(pool, 1, url, model, conversations(prompts, len(prompts), "cache", 0), warm)
        for w in range(2):
            burst(pool, ns.client_procs, url, model, conversations(prompts, ns.requests, f"warm{w}", 0), warm)
        for b in range(ns.bursts):
            chats = conversations(prompts, ns.requests, f"timed{b}", 0)
            shares = [share for share in (chats[p :: ns.client_procs] for p in range(ns.client_procs)) if share]
            barrier = start_barrier(len(shares))
            since = time.monotonic_ns()
            args = [(url, model, share, barrier, False, ns.max_tokens, not ns.client_gc_as_is) for share in shares]
            rows = [r for _, part in pool.starmap(client_share, args) for r in part]
            failed = [r["error"] for r in rows if "error" in r]
            if failed:
                raise RuntimeError(f"{len(failed)} of {len(rows)} requests failed, the first with {failed[0]}")
            starts = np.array([r["start_ns"] for r in rows])
            firsts = np.array([r["first_ns"] for r in rows if r["first_ns"] is not None])
            results.append(chronology(events_since(timeline, since), starts, firsts, ns.bin_ms, ns.span_ms))
            results[-1]["summary"]["client GC longest pause ms"] = max(r["client_gc_max_ms"] for r in rows)
            print_burst(b, results[-1])
        assert httpx.get(f"{url}/server_info", timeout=30).json()["kv_invariant_ok"]
    finally:
        pool.terminate()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.unlink(missing_ok=True)
        shutil.rmtree(timeline, ignore_errors=True)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps({"args": vars(ns), "bursts": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
