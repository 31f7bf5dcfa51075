"""Time to first token when many users arrive at once: N streamed chat requests through HTTP, sent together, with the
official `openai` client, over G shared system prompts of L tokens (issue 27's burst).

    python -m bench.ttft_under_load --config qwen3-0.6b --tokenizer DIR --device cuda          # the H100 burst
    python -m bench.ttft_under_load --model DIR --device cpu --requests 32 --max-tokens 8      # any model directory

A server (`launch.py`) is started per mode: `pieces` (the default server: chat prompts tokenized per message, pieces
cached, a known prompt tokenized on the event loop), `whole` (--disable-chat-segment-cache) and `pool` (pieces cached,
every prompt tokenized in the pool: --inline-tokenize-chars 0). For each: a warm-up that caches the G system prompts
(one request each) and sends three untimed bursts, then --repeats timed bursts, each with new questions (so only the
system prompts are cached, as for real users). On the CPU the modes' servers run side by side and their bursts alternate
(--interleave), so that the load of a shared machine weighs on both alike; on a GPU one server runs at a time. Reported
per burst: TTFT p50 / p99, inter-token latency (gaps between content chunks) mean / p50 / p99, time per output token,
output tokens/s and requests/s (from the common start to the last token); each figure the median of the bursts, with its
spread.

The clients: N requests split over --client-procs processes, each request with its own AsyncOpenAI client (its own
connection); the processes build their clients, meet at a barrier and send together. One client shared by 128 concurrent
streams (--shared-client) measures the client too: httpx's connection pool scans every connection on each request event,
which cost ~1.5 s of client CPU per 128-request burst on a 2-core machine (see tests/http/test_chat_segments_server.py).

System prompts are English-like prose cut at L tokens by the model's tokenizer; questions are ~20 tokens. Replies run
--max-tokens tokens (ignore_eos, greedy)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import signal
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from bench.run_record import check_repeats, run_record, summarize, summarize_rows
from bench.server_process import start_server
from radixserve.testing.tiny_models import dummy_config_dir
from radixserve.tokenizer_loading import load_tokenizer

MODES = {
    "pieces": [],
    "whole": ["--disable-chat-segment-cache"],
    "pool": ["--inline-tokenize-chars", "0"],  # pieces cached, but every prompt tokenized in the pool
}
WORDS = (
    "the of and to in is you that it for are as with be on your this by we or an will can not all at from "
    "have more if their about which when they one our any what other use must should answer request user "
    "policy customer account order product support service data privacy safety rule step example always "
    "never explain clearly briefly politely information question response tool result error refund ship "
    "price plan team company report review check confirm follow guideline section note important format "
    "list table summary detail context language tone formal friendly concise accurate helpful assistant"
).split()


def system_prompts(tokenizer, groups: int, tokens: int, seed: int) -> list[str]:
    """G distinct prompts of prose-like text, each cut at `tokens` tokens (re-encoded it may differ by one or two)."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        words = [rng.choice(WORDS) for _ in range(tokens * 2)]
        text = f"You are assistant {g} of our company. " + " ".join(
            w + (". " if rng.random() < 0.08 else "") for w in words
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def conversations(prompts: list[str], n: int, tag: str, seed: int) -> list[list[dict]]:
    """n chats over the prompts in turn, each with its own question (new for every tag: nothing of it is cached)."""
    rng = random.Random(f"{seed}-{tag}")
    return [
        [
            {"role": "system", "content": prompts[i % len(prompts)]},
            {"role": "user", "content": f"[{tag} #{i}] " + " ".join(rng.choice(WORDS) for _ in range(14)) + "?"},
        ]
        for i in range(n)
    ]


# ------------------------------------------------------------------------------------------------- clients


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


# -------------------------------------------------------------------------------------------------- modes


WARM_BURSTS = 3


class ModeServer:
    """One mode's server, warmed up: its G system prompts cached and WARM_BURSTS untimed bursts sent."""

    def __init__(self, mode: str, model_dir: str, ns, prompts: list[str], pool):
        self.mode, self.ns, self.prompts, self.pool = mode, ns, prompts, pool
        flags = [
            "--device",
            ns.device,
            *(["--load-format", ns.load_format] if ns.load_format else []),
            *(["--tokenizer", ns.tokenizer] if ns.tokenizer and not ns.config else []),
            *MODES[mode],
            *ns.server_flags.split(),
        ]
        self.server, self.url, self.log = start_server(model_dir, flags, f"radixserve-ttft-{mode}-")
        self.runs: list[dict] = []
        try:
            self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]
            # One request per system prompt, one at a time: each is cached (its KV, and its pieces in the front end
            # that took it).
            burst(pool, 1, self.url, self.model, conversations(prompts, len(prompts), f"{mode}-cache", ns.seed), ns)
            # Then untimed bursts until every front end has met every prompt: each learns the pieces from the
            # connections the kernel hands it, so after one burst of 128 over 8 front ends a front end has missed a
            # given prompt with probability (7/8)^16 = 12%, after three (7/8)^48 = 0.2%: a timed burst then measures
            # the steady state. (On the H100 the burst's p50 moves more between hosts and bursts than this changed:
            # ttft-under-load-h100.md, session 13.)
            for w in range(WARM_BURSTS):
                self.burst(f"warm{w}")
        except BaseException:
            self.stop(failed=True)
            raise

    def burst(self, tag: str) -> dict:
        chats = conversations(self.prompts, self.ns.requests, f"{self.mode}-{tag}", self.ns.seed)
        return burst(self.pool, self.ns.client_procs, self.url, self.model, chats, self.ns)

    def timed_burst(self) -> None:
        self.runs.append(self.burst(str(len(self.runs))))
        print(f"  {self.mode} burst {len(self.runs) - 1}: {json.dumps(self.runs[-1])}", flush=True)

    def stop(self, failed: bool = False) -> None:
        try:
            if failed:  # the server's own account of what went wrong, before its log goes
                print(
                    f"--- {self.mode} server log (last 40 lines) ---\n"
                    + "\n".join(self.log.read_text(errors="replace").splitlines()[-40:]),
                    flush=True,
                )
            else:
                info = httpx.get(f"{self.url}/server_info", timeout=30).json()
                if not info.get("kv_invariant_ok", True):
                    raise RuntimeError(f"KV invariant broken after the bursts: {info}")
        finally:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(timeout=60)
            self.log.unlink(missing_ok=True)


def run_modes(modes: list[str], model_dir: str, ns, prompts: list[str], pool) -> dict:
    """Every mode's timed bursts: one server after the other, or with --interleave all of them up at once and their
    bursts alternating, so that a machine whose load drifts (a shared CPU) weighs on every mode alike."""
    results = {}
    groups = [[mode] for mode in modes] if not ns.interleave else [modes]
    for group in groups:
        servers: list[ModeServer] = []
        failed = True
        try:
            for mode in group:
                servers.append(ModeServer(mode, model_dir, ns, prompts, pool))
            for _ in range(ns.repeats):
                for server in servers:
                    server.timed_burst()
            failed = False
        finally:
            for server in servers:
                server.stop(failed)
        results.update({server.mode: summarize_rows(server.runs) for server in servers})
    return results


def run_mode(mode: str, model_dir: str, ns, prompts: list[str], pool) -> dict:
    """One mode's figures (bench.scorecard's burst part)."""
    return run_modes([mode], model_dir, argparse.Namespace(**{**vars(ns), "interleave": False}), prompts, pool)[mode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an HF model directory (with its tokenizer)")
    parser.add_argument(
        "--config",
        help="a real shape with dummy weights (radixserve/testing/configs), e.g. qwen3-0.6b; needs --tokenizer",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory (with --config: copied beside the shape)")
    parser.add_argument("--load-format", help="passed to launch.py (dummy with --config)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--requests", type=int, default=128, help="N: requests per burst")
    parser.add_argument("--groups", type=int, default=8, help="G: distinct system prompts")
    parser.add_argument("--system-tokens", type=int, default=1520, help="L: tokens of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of each reply")
    parser.add_argument("--repeats", type=int, default=3, help="timed bursts per mode")
    parser.add_argument("--modes", default="pieces,whole", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 4)),
        help="client processes the requests are split over",
    )
    parser.add_argument("--shared-client", action="store_true", help="one AsyncOpenAI client per process")
    parser.add_argument("--server-flags", default="", help="more launch.py flags, e.g. '--max-total-tokens 65536'")
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="all modes' servers up at once, bursts alternating (default: on the CPU only)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="write the record and the figures here")
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    modes = [m for m in ns.modes.split(",") if m]
    if any(m not in MODES for m in modes) or (ns.model is None) == (ns.config is None):
        parser.error(f"exactly one of --model and --config; --modes takes {', '.join(MODES)}")
    if ns.config:
        if not ns.tokenizer:
            parser.error("--config needs --tokenizer")
        model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
        ns.load_format = ns.load_format or "dummy"
    else:
        model_dir = ns.model
    prompts = system_prompts(load_tokenizer(ns.tokenizer or model_dir), ns.groups, ns.system_tokens, ns.seed)
    if ns.interleave is None:
        ns.interleave = ns.device == "cpu"  # a GPU holds one server's KV pool at a time (--mem-fraction-static)
    with multiprocessing.get_context("spawn").Pool(ns.client_procs) as pool:
        results = run_modes(modes, model_dir, ns, prompts, pool)
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p99_ms", "output_tok_per_s", "cached_share")
    for mode, figures in results.items():
        print(
            f"{mode}: " + ", ".join(f"{k} {figures[k]['median']} ({figures[k]['spread_pct']}%)" for k in keys),
            flush=True,
        )
    paired = {}
    if ns.interleave and len(modes) == 2:  # bursts i of the two modes ran back to back: their ratio cancels drift
        first, second = (results[m] for m in modes)
        for key in ("ttft_p50_ms", "ttft_p99_ms"):
            paired[f"{key} {modes[1]}/{modes[0]}"] = summarize(
                [b / a for a, b in zip(first[key]["runs"], second[key]["runs"])]
            )
            print(f"paired {key} {modes[1]}/{modes[0]}: {paired[f'{key} {modes[1]}/{modes[0]}']}", flush=True)
    workload = {
        k: getattr(ns, k)
        for k in (
            "requests",
            "groups",
            "system_tokens",
            "max_tokens",
            "repeats",
            "client_procs",
            "shared_client",
            "device",
            "config",
            "model",
            "server_flags",
            "interleave",
        )
    }
    out = {"record": run_record(), "workload": workload, "cpus": os.cpu_count(), "results": results, "paired": paired}
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json_out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
