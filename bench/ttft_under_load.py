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

The clients (bench/burst_clients.py): N requests split over --client-procs processes, each request with its own
AsyncOpenAI client (its own connection); the processes build their clients, meet at a barrier and send together. One
client shared by 128 concurrent streams (--shared-client) measures the client too: httpx's connection pool scans every
connection on each request event, which cost ~1.5 s of client CPU per 128-request burst on a 2-core machine (see
tests/http/test_chat_segments_server.py).

System prompts are English-like prose cut at L tokens by the model's tokenizer; questions are ~20 tokens. Replies run
--max-tokens tokens (ignore_eos, greedy)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
from pathlib import Path

import httpx

from bench.burst_clients import burst, default_client_procs
from bench.run_record import check_repeats, run_record, summarize, summarize_rows
from bench.server_process import start_server
from radixserve.testing.tiny_models import dummy_config_dir
from radixserve.tokenizer_loading import load_tokenizer

MODES = {
    "pieces": [],
    "whole": ["--disable-chat-segment-cache"],
    "pool": ["--inline-tokenize-chars", "0"],  # pieces cached, but every prompt tokenized in the pool
    # The worker's early read-back between long steps off (radixserve/worker/step_pipeline.py): its A/B.
    "no-read-back-wait": ["--read-back-wait-ms", "0"],
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
        default=default_client_procs(),
        help="client processes the requests are split over (default: one per CPU, at most 16: bench/burst_clients.py "
        "CLIENT_PROCS says why)",
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
