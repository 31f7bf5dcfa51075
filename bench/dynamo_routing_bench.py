"""Routing across two radixserve workers on the CPU with a tiny model: NVIDIA Dynamo's KV router (on the radix trees'
exact KV block events, python -m radixserve.dynamo) against sglang-router's cache_aware policy (its own approximate
tree of the text it routed, in front of launch.py servers) and against round robin (each router's), on the same
workload: GROUPS system prompts, each asked ROUNDS questions, the groups interleaved in a new order every round, sent
by CONCURRENCY clients. Printed side by side: the prompt-token hit rate (cached / prompt tokens, from each reply's
usage) and the request throughput, medians of --repeats runs, the caches flushed before each run.

--max-total-tokens sets every worker's KV pool: the default holds every system prompt; a small one (e.g. 1200:
about 7 of the 8 system prompts) makes the workers evict, which the KV router hears of and sglang-router does not.

    python -m bench.dynamo_routing_bench --out bench/results/dynamo-routing-cpu
    python -m bench.dynamo_routing_bench --max-total-tokens 1200 --out bench/results/dynamo-routing-cpu-tight
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.run_record import check_repeats, run_record, summarize
from radixserve.testing.tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
WORDS = "cache router prefix token block worker system prompt radix tree evict pin salt replica answer".split()


def free_port() -> int:
    """Below 32768: Dynamo 1.6.1 reads a worker's DYN_SYSTEM_PORT as a signed 16-bit number."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


class Procs:
    """Child processes, each in its own session (so that a kill reaches its children), logs in one directory."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir, self.env, self.procs = log_dir, env, []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_until(predicate, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


def workload(args, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = [
        f"You are assistant {g}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
        for g in range(args.groups)
    ]
    requests = []
    for r in range(args.rounds):
        order = list(range(args.groups))
        rng.shuffle(order)
        requests += [
            [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": f"Question {r} of group {g}: {rng.choice(WORDS)}?"},
            ]
            for g in order
        ]
    return requests


def run_workload(url: str, model: str, requests: list[list[dict]], args) -> dict:
    def one(messages):
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        usages = list(pool.map(one, requests))
    seconds = time.perf_counter() - start
    return {
        "hit_rate": sum(c for _, c in usages) / sum(p for p, _ in usages),
        "requests_per_s": len(requests) / seconds,
    }


def dynamo_deployment(procs: Procs, args, model_dir: str) -> tuple[dict, list]:
    """Two radixserve Dynamo workers and two Dynamo frontends (kv, round-robin): routers' URLs and flush calls."""
    ports = []
    for i in range(2):
        port = free_port()
        ports.append(port)
        procs.start(
            f"dynamo-worker-{i}",
            [
                sys.executable,
                "-m",
                "radixserve.dynamo",
                "--model",
                model_dir,
                "--device",
                "cpu",
                "--discovery-backend",
                "file",
                "--port",
                str(port),
                "--max-total-tokens",
                str(args.max_total_tokens),
            ],
        )
    urls = {}
    for mode in ("kv", "round-robin"):
        port = free_port()
        urls[f"dynamo {mode}"] = f"http://127.0.0.1:{port}"
        procs.start(
            f"dynamo-frontend-{mode}",
            [
                sys.executable,
                "-m",
                "dynamo.frontend",
                "--discovery-backend",
                "file",
                "--router-mode",
                mode,
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                *shlex.split(args.frontend_args),
            ],
        )
    controls = [f"http://127.0.0.1:{port}/engine/control" for port in ports]
    for control in controls:
        wait_until(lambda: httpx.post(f"{control}/server_info", json={}, timeout=5).status_code == 200, control)
    ids = [httpx.post(f"{c}/server_info", json={}, timeout=5).json()["dynamo_worker_id"] for c in controls]
    for url in urls.values():  # each frontend routes to both workers
        for worker_id in ids:
            body = {
                "model": Path(model_dir).name,
                "prompt": "ping",
                "max_tokens": 1,
                "nvext": {"backend_instance_id": worker_id},
            }
            wait_until(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200, url)
    flushes = [lambda c=c: httpx.post(f"{c}/flush_cache", json={}, timeout=30).json()["success"] for c in controls]
    return urls, flushes


def sglang_deployment(procs: Procs, args, model_dir: str) -> tuple[dict, list]:
    """Two launch.py servers and two sglang-routers (cache_aware, round_robin) in front of them."""
    servers = []
    for i in range(2):
        port = free_port()
        servers.append(f"http://127.0.0.1:{port}")
        procs.start(
            f"server-{i}",
            [
                sys.executable,
                "launch.py",
                "--model",
                model_dir,
                "--device",
                "cpu",
                "--port",
                str(port),
                "--max-total-tokens",
                str(args.max_total_tokens),
            ],
        )
    for url in servers:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, url)
    urls = {}
    for policy in ("cache_aware", "round_robin"):
        port = free_port()
        urls[f"sglang-router {policy}"] = f"http://127.0.0.1:{port}"
        procs.start(
            f"sglang-router-{policy}",
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *servers,
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
        )
        wait_until(
            lambda: len(httpx.get(f"{urls[f'sglang-router {policy}']}/get_loads", timeout=5).json()["workers"]) == 2,
            f"sglang-router {policy}",
        )
    flushes = [lambda s=s: httpx.post(f"{s}/flush_cache", timeout=30).status_code == 200 for s in servers]
    return urls, flushes


def measure(urls: dict, flushes: list, args, model: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in urls}
    for repeat in range(args.repeats):
        requests = workload(args, seed=repeat)
        for name, url in urls.items():  # the routers take turns, so that drift on a shared CPU hits them alike
            assert all(flush() for flush in flushes)
            time.sleep(0.5)  # the KV router hears the flush on the event plane
            runs[name].append(run_workload(url, model, requests, args))
            print(
                f"  repeat {repeat}: {name}: hit rate {runs[name][-1]['hit_rate']:.3f}, "
                f"{runs[name][-1]['requests_per_s']:.2f} req/s",
                flush=True,
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=110, help="words per system prompt (~150 tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="every worker's KV pool, in tokens")
    parser.add_argument(
        "--frontend-args",
        default="",
        help="more flags for Dynamo's frontends, e.g. '--router-kv-overlap-score-credit 4'",
    )
    parser.add_argument("--only", choices=["dynamo", "sglang"], help="run one of the two deployments")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args()
    check_repeats(args.repeats)
    model_dir = str(tiny_model_dir("llama"))
    model = Path(model_dir).name
    log_dir = Path(tempfile.mkdtemp(prefix="dynamo-routing-bench-"))
    env = {
        **os.environ,
        "DYN_FILE_KV": str(log_dir / "store"),
        "DYN_LOG": "warn",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
    }
    runs = {}
    deployments = {"dynamo": dynamo_deployment, "sglang": sglang_deployment}
    for name, deploy in deployments.items():  # one deployment at a time on the 2 cores
        if args.only not in (None, name):
            continue
        procs = Procs(log_dir, env)
        try:
            urls, flushes = deploy(procs, args, model_dir)
            runs.update(measure(urls, flushes, args, model))
        finally:
            procs.stop()
    table = {
        name: {key: summarize([r[key] for r in rs]) for key in ("hit_rate", "requests_per_s")}
        for name, rs in runs.items()
    }
    lines = ["| router (2 workers) | prompt-token hit rate | requests/s |", "| --- | --- | --- |"]
    for name, row in table.items():
        lines.append(
            f"| {name} | {row['hit_rate']['median']:.3f} (spread {row['hit_rate']['spread_pct']}%) | "
            f"{row['requests_per_s']['median']:.2f} (spread {row['requests_per_s']['spread_pct']}%) |"
        )
    print("\n".join(lines))
    if args.out:
        record = {**run_record(), "load_average_at_end": os.getloadavg(), "workload": vars(args), "results": table}
        Path(f"{args.out}.json").write_text(json.dumps(record, indent=2) + "\n")
        Path(f"{args.out}.md").write_text(
            f"# Routing across 2 radixserve workers (CPU, tiny model)\n\n`{record['command']}` ({record['date']}, "
            f"commit {record['git_commit']})\n\n{args.groups} system prompts x {args.rounds} questions, interleaved, "
            f"{args.concurrency} client(s), {args.max_tokens} tokens out, KV pool {args.max_total_tokens} tokens per "
            f"worker; Dynamo frontends' extra flags: `{args.frontend_args or 'none'}`; medians of {args.repeats} runs; "
            f"load average at the end {record['load_average_at_end'][0]:.1f} (a shared 2-core machine)."
            "\n\n" + "\n".join(lines) + "\n"
        )


if __name__ == "__main__":
    main()
