"""Chat prompts tokenized per second by the front end's tokenizer pool (tokenizer_service/tokenization.py), by the
number of threads (--tokenizer-workers): does encoding scale with cores, and what do cached pieces save?

    python -m bench.tokenizer_pool_bench --tokenizer DIR [--workers 1,2,4,8,16 --chats 256 --system-tokens 1520]

Per thread count, three loads of `--chats` chats sent to `Tokenization.encode_chat` at once (as the HTTP routes do):
`distinct-whole` (every chat its own system prompt, pieces off: --disable-chat-segment-cache), `distinct-pieces` (the
same with pieces on: all new, so the cost of cutting and caching shows), `shared-pieces` (8 system prompts, as in
issue 27's burst, into a fresh cache). Each figure is the median of --repeats runs with fresh text, with its spread.
No server: the pool alone, so that the figures are the tokenizer's, not HTTP's."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from bench.run_record import check_repeats, run_record, summarize
from bench.ttft_under_load import conversations, system_prompts
from radixserve.tokenizer_loading import load_tokenizer
from tokenizer_service.openai_schema import ChatCompletionRequest
from tokenizer_service.tokenization import Tokenization

LOADS = {"distinct-whole": (None, 0), "distinct-pieces": (None, 64), "shared-pieces": (8, 64)}


def chats_per_second(tokenizer, workers: int, groups: int | None, cache_mib: int, ns, seed: int) -> float:
    prompts = system_prompts(tokenizer, groups or ns.chats, ns.system_tokens, seed)
    requests = [ChatCompletionRequest(messages=m) for m in conversations(prompts, ns.chats, f"run{seed}", seed)]
    tokenization = Tokenization(tokenizer, 1 << 20, workers, cache_mib)
    try:

        async def run() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(tokenization.encode_chat(r) for r in requests))
            return time.perf_counter() - start

        return len(requests) / asyncio.run(run())
    finally:
        tokenization.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a model or tokenizer directory")
    parser.add_argument("--workers", default=",".join(str(w) for w in sorted({1, 2, os.cpu_count() or 2})))
    parser.add_argument("--chats", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=1520)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    tokenizer = load_tokenizer(ns.tokenizer)
    results: dict = {}
    for workers in (int(w) for w in ns.workers.split(",")):
        for load, (groups, cache_mib) in LOADS.items():
            runs = [chats_per_second(tokenizer, workers, groups, cache_mib, ns, seed) for seed in range(ns.repeats)]
            results[f"{load} workers={workers}"] = summarize(runs)
            print(
                f"{load:16s} workers={workers:<3d} {results[f'{load} workers={workers}']['median']:9.1f} chats/s "
                f"(spread {results[f'{load} workers={workers}']['spread_pct']}%)",
                flush=True,
            )
    if ns.json_out:
        out = {
            "record": run_record(),
            "cpus": os.cpu_count(),
            "chats": ns.chats,
            "system_tokens": ns.system_tokens,
            "chats_per_second": results,
        }
        with open(ns.json_out, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
