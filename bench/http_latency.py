"""Time to the first token through HTTP against the same through the offline Engine, on one model and device: what
the front end (FastAPI, the tokenizer process's hop, detokenization, SSE) adds to a request at batch 1.

    python -m bench.http_latency --config qwen3-0.6b --tokenizer DIR              # GPU, dummy weights of a real shape
    python -m bench.http_latency --model DIR --device cpu                         # any model directory, e.g. on the CPU

Both paths get the same 1-token prompts (fresh random ids, so nothing is cached), greedy, one output token. HTTP
sends token ids to streamed `/generate` and `/v1/completions` over one kept-alive connection; the TTFT is the time
until the first SSE event carrying a token. Every figure is the median of --repeats after a warm-up of the same
requests; the difference HTTP - Engine is the front end's share."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir

from bench.run_record import check_repeats, run_record
from bench.server_process import start_server


def first_event_seconds(client: httpx.Client, route: str, body: dict) -> float:
    """Seconds from sending a streamed request to the first SSE event that carries a token; reads the rest."""
    start = time.perf_counter()
    first = None
    with client.stream("POST", route, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("output_ids") or (event.get("choices") and event["choices"][0].get("text") is not None):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{route}: no token in the stream")
    return first


def http_ttfts(model_dir: str, extra: list[str], prompts: list[list[int]], warmup: list[list[int]]) -> dict:
    proc, url, log = start_server(model_dir, extra, "radixserve-http-latency-")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            generate = lambda ids: first_event_seconds(  # noqa: E731
                client,
                "/generate",
                {
                    "input_ids": ids,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                },
            )
            completions = lambda ids: first_event_seconds(  # noqa: E731
                client,
                "/v1/completions",
                {
                    "model": model,
                    "prompt": ids,
                    "max_tokens": 1,
                    "temperature": 0,
                    "stream": True,
                },
            )
            for ids in warmup:
                generate(ids)
                completions(ids)
            times = {
                "generate": [generate(ids) for ids in prompts[0::2]],
                "completions": [completions(ids) for ids in prompts[1::2]],
            }
            info = client.get("/server_info").json()
            if not info.get("kv_invariant_ok", True):
                raise RuntimeError(f"KV invariant broken after the HTTP runs: {info}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.unlink(missing_ok=True)
    return times


def engine_ttfts(model_dir: str, engine_kwargs: dict, prompts: list[list[int]], warmup: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    times = []
    with Engine(model_dir, **engine_kwargs) as engine:
        for ids in warmup:
            engine.generate(ids, params)
        for ids in prompts:
            start = time.perf_counter()
            engine.generate(ids, params)
            times.append(time.perf_counter() - start)
        if not engine.server_info()["kv_invariant_ok"]:
            raise RuntimeError("KV invariant broken after the Engine runs")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a real model shape with dummy weights (needs --tokenizer)")
    source.add_argument("--model", help="a model directory with weights")
    parser.add_argument("--tokenizer")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    check_repeats(ns.repeats)

    if ns.config:
        if not ns.tokenizer:
            parser.error("--config needs --tokenizer")
        model_dir, load_format = str(dummy_config_dir(ns.config, ns.tokenizer)), "dummy"
    else:
        model_dir, load_format = ns.model, "auto"
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    fresh = lambda: [int(rng.integers(100, vocab - 100))]  # noqa: E731 - a new 1-token prompt: never a cache hit
    warmup = [fresh() for _ in range(5)]
    prompts = [fresh() for _ in range(2 * ns.repeats)]

    flags = ["--load-format", load_format, "--device", ns.device]
    http = http_ttfts(model_dir, flags, prompts, warmup)
    engine = engine_ttfts(model_dir, {"load_format": load_format, "device": ns.device}, prompts[: ns.repeats], warmup)

    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
    spread = lambda xs: [round(min(xs) * 1e3, 2), round(max(xs) * 1e3, 2)]  # noqa: E731
    row = {
        "model": ns.config or ns.model,
        "device": ns.device,
        "repeats": ns.repeats,
        "engine_ttft_ms": ms(engine),
        "engine_ttft_spread": spread(engine),
        "http_generate_ttft_ms": ms(http["generate"]),
        "http_generate_spread": spread(http["generate"]),
        "http_completions_ttft_ms": ms(http["completions"]),
        "http_completions_spread": spread(http["completions"]),
        "front_end_ms (completions - engine)": round(ms(http["completions"]) - ms(engine), 2),
        **run_record(),
    }
    print(json.dumps(row, indent=1))
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
