"""CPU micro-benchmark of the HTTP process's work per streamed token: N streamed chat requests through the real
RequestManager (its per-output path: detokenizing, stop handling, metrics, delivery), RequestGroup streams,
openai_events and EventStreamResponse on uvloop, fed T scheduler steps of one token each; the ASGI `send` is a no-op, so
uvicorn's write and the socket are not in it. Prints microseconds per token (median of --repeats runs) and, with
--profile, where they go.

    python -m bench.front_end_stream_bench [--streams 128] [--steps 64] [--repeats 5] [--profile]
    PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) python -m bench.front_end_stream_bench  # shared metrics (--api-server-count)

In a burst of 128 streams this work shares the one event loop with the requests still arriving (issue 27:
bench/results/ttft-under-load-h100.md): every microsecond per token is ~0.1 ms of loop time per step."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import time

import numpy as np
import uvloop

from radixserve.protocol import BatchOutput, RequestOutput, SchedulerLoad, pack_i32
from radixserve.runtime.ipc import Endpoints
from radixserve.sampling import SamplingParams
from radixserve.testing import smollm2_dir
from radixserve.tokenizer_loading import load_tokenizer
from tokenizer_service.metrics import ServerMetrics
from tokenizer_service.request_manager import RequestManager
from tokenizer_service.streaming import EventStreamResponse, OpenAIStream, openai_events


class NoSocket:
    def send(self, message) -> None:
        pass


async def run_once(tokenizer, streams: int, steps: int, seed: int) -> float:
    """Seconds for `steps` steps of `streams` tokens, every stream's chunks written (to nowhere)."""
    # With PROMETHEUS_MULTIPROC_DIR set (before prometheus-client is imported), every value goes to the files that
    # several front ends share (tokenizer_service/metrics.py), as in a server with --api-server-count > 1.
    metrics = ServerMetrics("bench", shared_dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    manager = RequestManager(tokenizer, Endpoints("/nonexistent"), metrics, max_in_flight=10**6)
    manager._to_scheduler = NoSocket()
    rng = np.random.default_rng(seed)
    # Ids of ordinary words: what text-bearing decode steps look like (dummy weights would send many without text).
    words = [i for i in rng.integers(1000, 20000, 4000).tolist() if tokenizer.decode([i]).strip().isalpha()][:500]
    prompt = rng.integers(1000, 20000, 64).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)
    written = [0]

    async def send(message) -> None:
        written[0] += len(message.get("body", b""))

    never = asyncio.Event()

    async def receive():
        await never.wait()

    tasks, rids = [], []
    for i in range(streams):
        group = manager.submit(f"req-{i}", [(prompt, params)])
        rids.append(group.sequences[0].rid)
        stream = OpenAIStream(True, tokenizer.decode)
        events = openai_events(stream, group, f"chatcmpl-{i}", 0, "bench", False, True)
        tasks.append(asyncio.create_task(EventStreamResponse(events, group)({}, receive, send)))
    await asyncio.sleep(0)  # every stream sends its preamble and waits
    load = SchedulerLoad(streams, 0, 0, 0, 0)
    batches = []
    for step in range(steps):
        last = step == steps - 1
        outputs = []
        for rid in rids:
            token = words[int(rng.integers(len(words)))]
            outputs.append(
                RequestOutput(
                    rid,
                    pack_i32([token]),
                    [],
                    last,
                    "length" if last else None,
                    None,
                    None,
                    len(prompt),
                    step + 1,
                    0,
                    0.001 if step == 0 else None,
                )
            )
        batches.append(BatchOutput(outputs, load))
    start = time.perf_counter()
    for batch in batches:
        manager._on_batch(batch)
        for _ in range(3):  # the woken streams run, each once
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    assert written[0] > 0 and not manager._sequences
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    ns = parser.parse_args()
    tokenizer = load_tokenizer(smollm2_dir())
    run = uvloop.run  # the event loop the server runs on
    run(run_once(tokenizer, ns.streams, 4, 0))  # warm-up
    runs = []
    for r in range(ns.repeats):
        seconds = run(run_once(tokenizer, ns.streams, ns.steps, r + 1))
        runs.append(seconds / (ns.streams * ns.steps) * 1e6)
    shared = " (metrics in multiprocess files)" if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else ""
    print(
        f"{ns.streams} streams x {ns.steps} tokens{shared}: {statistics.median(runs):.2f} us per token "
        f"(runs {', '.join(f'{x:.2f}' for x in runs)})"
    )
    if ns.profile:
        profile = cProfile.Profile()
        profile.enable()
        run(run_once(tokenizer, ns.streams, ns.steps, 99))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
