"""Every GPU target of the project in one command: batch-1 decode, first-token times, the W1 and generated-shared-
prefix workloads with shared-prefix attention on and off, the device's busy share in W1's decode steps, serving
through HTTP, and fidelity on real weights. Writes a flat JSON object (bench/results/scorecard-h100.json by default)
with commit, date, GPU and one key per figure: the median of repeated runs, and beside it KEY_spread, [min, max].

    python -m bench.scorecard --tokenizer DIR --parts 06b,serve      # one call of < 10 minutes on an H100
    python -m bench.scorecard --tokenizer DIR --parts 8b
    python -m bench.scorecard --tokenizer DIR --parts burst          # issue 27's burst of 128 chats (1-2 minutes)
    python -m bench.scorecard --tokenizer DIR --parts burst --burst-api-servers 1   # the same, one HTTP process
    python -m bench.scorecard --tokenizer DIR --parts burst --burst-client-procs 4  # sessions 9-13's load generator
    python -m bench.scorecard --parts fidelity                       # real weights (the demo model)

A part adds its keys to the file and leaves the others' as they were, so that the parts can run in separate calls.
Real model shapes with dummy weights (radixserve/testing/configs), greedy, EOS ignored; every workload is warmed up on
its own shapes before the clock runs (Triton compiles each kernel variant on first use)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.burst_clients import CLIENT_PROCS
from bench.latency import measure as measure_latency
from bench.offline_throughput import Workload, prompts_for, timed_run
from bench.run_record import REPO, run_record
from radixserve.engine import Engine
from radixserve.runtime.front_ends import default_count as default_front_end_count
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir

PARTS = ("06b", "8b", "serve", "burst", "fidelity")
SHAPES = {"06b": "qwen3-0.6b", "8b": "qwen3-8b"}
W1 = Workload("W1", 8, 16, 1024, 128, 128)
GSP = {"06b": Workload("gsp", 64, 16, 2048, 128, 256), "8b": Workload("gsp", 16, 16, 2048, 128, 256)}
PLAIN = {"disable_shared_prefix_attention": True}


def put(card: dict, key: str, values: list[float], scale: float = 1.0, digits: int = 3) -> None:
    """card[key] = the median of values (times scale), card[key_spread] = [min, max]."""
    card[key] = round(statistics.median(values) * scale, digits)
    card[key + "_spread"] = [round(min(values) * scale, digits), round(max(values) * scale, digits)]


def workload_seconds(engine: Engine, w: Workload, repeats: int, card: dict, key: str) -> list[float]:
    prompts = prompts_for(w, engine.model_config.vocab_size)
    timed_run(engine, prompts, w.output_len)  # warm-up: every shape of the timed runs compiles first
    runs = [timed_run(engine, prompts, w.output_len) for _ in range(repeats)]
    card[key + "_triton_compiles"] = sum(r["triton_compiles"] for r in runs)  # a compile mid-run costs seconds
    compiled = sorted({name for r in runs for name in r["triton_compiled"]})
    if compiled:
        card[key + "_triton_compiled"] = compiled  # which kernels met a new variant after the warm-up
    return [r["seconds"] for r in runs]


def gpu_busy_in_decode(engine: Engine, w: Workload, profile_dir: Path, seconds: float, repeats: int) -> list[float]:
    """The device's busy share over 30 decode steps of a W1 run, opened when its decode phase has begun (the
    workers' StepProfiler, RADIXSERVE_PROFILE_TRIGGER): repeats runs."""
    prompts = prompts_for(w, engine.model_config.vocab_size)
    shares = []
    for _ in range(repeats):
        result = profile_dir / "rank0.json"
        result.unlink(missing_ok=True)
        # Prefill is the first ~third of a W1 run: open the window a little after it.
        timer = threading.Timer(0.45 * seconds, lambda: (profile_dir / "start").touch())
        timer.start()
        timed_run(engine, prompts, w.output_len)
        timer.join()
        for _ in range(100):
            if result.exists():
                break
            time.sleep(0.1)
        shares.append(json.loads(result.read_text())["gpu_busy"])
    return shares


def engine_burst_seconds(engine: Engine, repeats: int) -> tuple[list[float], list[float]]:
    """Issue 27's burst as token ids through Engine: 8 system prompts of 1,520 tokens cached by a warm-up, then 128
    requests at once, each a system prompt and 20 new tokens, one output token. Per repeat: the first tokens' p50
    and p99 (seconds from the submission of the burst)."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    systems = [rng.integers(100, vocab - 100, 1520).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    burst = lambda: [systems[i % 8] + rng.integers(100, vocab - 100, 20).tolist() for i in range(128)]  # noqa: E731
    engine.generate([s + [7] for s in systems], params)
    engine.generate(burst(), params)  # warm-up on the burst's shapes
    p50, p99 = [], []
    for _ in range(repeats):
        times = sorted(r.first_token_s for r in engine.generate(burst(), params))
        p50.append(times[len(times) // 2])
        p99.append(times[min(len(times) - 1, int(0.99 * len(times)))])
    return p50, p99


def shape_part(part: str, tokenizer: str, repeats: int, card: dict) -> None:
    model_dir = str(dummy_config_dir(SHAPES[part], tokenizer))
    gsp = GSP[part]
    profile_dir = Path(tempfile.mkdtemp(prefix="radixserve-scorecard-profile-"))
    os.environ.update(
        RADIXSERVE_PROFILE_DIR=str(profile_dir), RADIXSERVE_PROFILE_TRIGGER="1", RADIXSERVE_PROFILE_STEPS="30"
    )
    common = dict(load_format="dummy", device="cuda", max_running_requests=1024)
    start = time.perf_counter()
    try:
        with Engine(model_dir, **common) as engine:
            card[f"engine_start_s_{part}"] = round(time.perf_counter() - start, 1)
            one, many, ttft_1, ttft_hit, ttft_cold = measure_latency(engine, 256, 1024, 128, max(repeats, 5))
            per_token = [(m - statistics.median(one)) / 255 for m in many]
            put(card, f"bs1_ms_{part}", per_token, 1e3)
            put(card, f"ttft_1tok_ms_{part}", ttft_1, 1e3, 2)
            put(card, f"ttft_hit_ms_{part}", ttft_hit, 1e3, 2)
            put(card, f"ttft_cold_ms_{part}", ttft_cold, 1e3, 2)
            w1 = workload_seconds(engine, W1, repeats, card, f"w1_s_{part}")
            put(card, f"w1_s_{part}", w1)
            put(
                card, f"gpu_busy_w1_{part}", gpu_busy_in_decode(engine, W1, profile_dir, statistics.median(w1), repeats)
            )
            put(card, f"gsp_s_{part}", workload_seconds(engine, gsp, repeats, card, f"gsp_s_{part}"))
            if part == "06b":
                p50, p99 = engine_burst_seconds(engine, repeats)
                put(card, "engine_burst_ttft_p50_ms_06b", p50, 1e3, 1)
                put(card, "engine_burst_ttft_p99_ms_06b", p99, 1e3, 1)
    finally:
        for key in ("RADIXSERVE_PROFILE_DIR", "RADIXSERVE_PROFILE_TRIGGER", "RADIXSERVE_PROFILE_STEPS"):
            os.environ.pop(key, None)
    print_card(card, part)
    with Engine(model_dir, **common, **PLAIN) as engine:
        put(card, f"w1_plain_s_{part}", workload_seconds(engine, W1, repeats, card, f"w1_plain_s_{part}"))
        put(card, f"gsp_plain_s_{part}", workload_seconds(engine, gsp, repeats, card, f"gsp_plain_s_{part}"))


# serve_rate_*: the same 512 requests sent at this many per second (Poisson arrivals, bench.serving_bench
# --request-rate), below what either mode serves in a closed loop (~116 requests/s with shared-prefix attention off):
# 128 closed-loop clients send a faster server more requests per second, so its closed-loop TTFT carries more load.
SERVE_RATE = 80.0


def serve_part(tokenizer: str, repeats: int, card: dict) -> None:
    """bench.serving_bench's load (0.6B shape, 128 clients, 8 system prompts of 2,048 tokens) through launch.py with
    shared-prefix attention on and off, in a closed loop and at a fixed arrival rate, and Engine's mean step time on
    the same requests and concurrency."""
    from bench.server_process import start_server
    from bench.serving_bench import run_load, workload

    model_dir = str(dummy_config_dir(SHAPES["06b"], tokenizer))
    load = argparse.Namespace(requests=512, concurrency=128, groups=8, system_len=2048, question_len=64, output_len=128)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = workload(load, vocab)
    for mode, flags in {"": [], "plain_": ["--disable-shared-prefix-attention"]}.items():
        server, url, log = start_server(model_dir, ["--load-format", "dummy", *flags], "radixserve-scorecard-")
        try:
            asyncio.run(run_load(url, prompts, 4, load.concurrency))  # warm-up
            runs, rate_runs = [], []
            for _ in range(repeats):
                assert httpx.post(f"{url}/flush_cache", timeout=30).json()["success"]
                runs.append(asyncio.run(run_load(url, prompts, load.output_len, load.concurrency)))
            for _ in range(repeats):  # the same offered load for both modes (see SERVE_RATE)
                assert httpx.post(f"{url}/flush_cache", timeout=30).json()["success"]
                rate_runs.append(asyncio.run(run_load(url, prompts, load.output_len, 4 * load.concurrency, SERVE_RATE)))
            assert httpx.get(f"{url}/server_info", timeout=30).json()["kv_invariant_ok"]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
            log.unlink(missing_ok=True)
        put(card, f"serve_{mode}ttft_p50_ms", [r["ttft_p50_ms"] for r in runs], 1, 1)
        put(card, f"serve_{mode}ttft_p99_ms", [r["ttft_p99_ms"] for r in runs], 1, 1)
        # Inter-token latency per token (the stream's span over its tokens); per text chunk as _chunk (see
        # serving_bench.one_request: with dummy weights ~40% of tokens send no chunk of their own).
        put(card, f"serve_{mode}itl_ms", [r["tpot_mean_ms"] for r in runs], 1, 2)
        put(card, f"serve_{mode}itl_chunk_ms", [r["itl_mean_ms"] for r in runs], 1, 2)
        put(card, f"serve_{mode}output_tok_s", [r["output_tok_per_s"] for r in runs], 1, 0)
        # The closed loop's client: if its loop runs late, its TTFT includes the wait (serving_bench.loop_lag).
        put(card, f"serve_{mode}client_cpu_share", [r["client_cpu_share"] for r in runs], 1, 3)
        put(card, f"serve_{mode}client_loop_lag_p99_ms", [r["client_loop_lag_p99_ms"] for r in runs], 1, 2)
        put(card, f"serve_rate_{mode}ttft_p50_ms", [r["ttft_p50_ms"] for r in rate_runs], 1, 1)
        put(card, f"serve_rate_{mode}ttft_p99_ms", [r["ttft_p99_ms"] for r in rate_runs], 1, 1)
        put(card, f"serve_rate_{mode}itl_ms", [r["tpot_mean_ms"] for r in rate_runs], 1, 2)
    from radixserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=load.output_len, ignore_eos=True)
    with Engine(model_dir, load_format="dummy", device="cuda", max_running_requests=load.concurrency) as engine:
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))  # warm-up
        step_ms = []
        for _ in range(repeats):
            assert engine.flush_cache()
            before = engine.server_info()["steps"]
            start = time.perf_counter()
            engine.generate(prompts, params)
            step_ms.append((time.perf_counter() - start) * 1e3 / (engine.server_info()["steps"] - before))
    put(card, "engine_step_ms_serve_shape", step_ms, 1, 2)
    card["serve_itl_over_engine_step"] = round(card["serve_itl_ms"] / card["engine_step_ms_serve_shape"], 3)


def burst_part(
    tokenizer: str, repeats: int, card: dict, api_servers: int | None = None, client_procs: int = CLIENT_PROCS
) -> None:
    """bench.ttft_under_load's burst (0.6B shape): 128 streamed chat requests at once through the openai client over
    8 cached system prompts of ~1,520 tokens, after a warm-up; TTFT p50 / p99 of each timed burst. api_servers: the
    server's HTTP processes (--api-server-count; None: the server's default for this machine); client_procs: the
    load generator's processes (bench/burst_clients.py CLIENT_PROCS says why so many); both recorded in the card
    beside the figures."""
    import multiprocessing

    from bench.ttft_under_load import run_mode, system_prompts
    from radixserve.tokenizer_loading import load_tokenizer

    ns = argparse.Namespace(
        device="cuda",
        load_format="dummy",
        tokenizer=tokenizer,
        config=SHAPES["06b"],
        server_flags="" if api_servers is None else f"--api-server-count {api_servers}",
        seed=0,
        client_procs=client_procs,
        shared_client=False,
        max_tokens=64,
        requests=128,
        repeats=repeats,
    )
    prompts = system_prompts(load_tokenizer(tokenizer), 8, 1520, 0)
    with multiprocessing.get_context("spawn").Pool(ns.client_procs) as pool:
        result = run_mode("pieces", str(dummy_config_dir(SHAPES["06b"], tokenizer)), ns, prompts, pool)
    put(card, "serve_burst_ttft_p50_ms", result["ttft_p50_ms"]["runs"], 1, 1)
    put(card, "serve_burst_ttft_p99_ms", result["ttft_p99_ms"]["runs"], 1, 1)
    card["serve_burst_api_servers"] = default_front_end_count("cuda") if api_servers is None else api_servers
    card["serve_burst_client_procs"] = client_procs
    # The client processes' longest garbage-collector pause in any timed burst (their heap is frozen for a burst:
    # bench/burst_clients.py _share): a figure spoilt by the load generator shows here.
    card["serve_burst_client_gc_max_ms"] = max(result["client_gc_max_ms"]["runs"])


def fidelity_part(card: dict) -> None:
    """bench.fidelity on the demo model's real weights: radixserve bf16 and HF transformers bf16, top-1 agreement
    with HF fp32 teacher forcing (256 chat prompts x 64 tokens)."""
    import subprocess
    import sys

    out = Path(tempfile.mkdtemp()) / "fidelity.json"
    subprocess.run(
        [sys.executable, "-m", "bench.fidelity", "--device", "cuda", "--modes", "bfloat16", "--out", str(out)], cwd=REPO
    )  # (exits 1 below the bar: the figures say so)
    rows = json.loads(out.read_text())["results"]
    card["fidelity_bf16_top1"] = round(rows["radixserve bfloat16"]["top1_agreement"], 5)
    card["fidelity_bf16_hf_top1"] = round(rows["HF transformers bfloat16 (reference bar)"]["top1_agreement"], 5)


def print_card(card: dict, part: str) -> None:
    for key, value in card.items():
        serving = part in ("serve", "burst") and key.startswith(("serve", "engine"))
        if key.endswith((f"_{part}", f"_{part}_spread")) or serving:
            print(f"  {key:34s} {value}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a Qwen3 tokenizer directory (the dummy shapes' tokenizer)")
    parser.add_argument("--parts", default="06b,serve", help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--burst-api-servers", type=int, help="the burst part's server: --api-server-count (default: the server's)"
    )
    parser.add_argument(
        "--burst-client-procs",
        type=int,
        default=CLIENT_PROCS,
        help=f"the burst part's client processes (default {CLIENT_PROCS})",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scorecard-h100.json"))
    ns = parser.parse_args()
    parts = [p for p in ns.parts.split(",") if p]
    if any(p not in PARTS for p in parts):
        parser.error(f"--parts takes {PARTS}")
    if any(p != "fidelity" for p in parts) and not ns.tokenizer:
        parser.error("--tokenizer is needed for the dummy-weight parts")
    out = Path(ns.out)
    card = json.loads(out.read_text()) if out.exists() else {}
    record = run_record()
    card.update(commit=record["git_commit"], date=record["date"], gpu=torch.cuda.get_device_name())
    card.setdefault("commands", {})
    # One Triton cache for every engine of this run: kernels compile once, and compiles inside timed runs still
    # show as new entries (bench.offline_throughput.triton_compiles).
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "radixserve-scorecard-triton"))
    for part in parts:
        start = time.perf_counter()
        if part in SHAPES:
            shape_part(part, ns.tokenizer, ns.repeats, card)
        elif part == "serve":
            serve_part(ns.tokenizer, ns.repeats, card)
        elif part == "burst":
            burst_part(ns.tokenizer, ns.repeats, card, ns.burst_api_servers, ns.burst_client_procs)
        else:
            fidelity_part(card)
        card["commands"][part] = f"{record['command']}  ({record['git_commit']}, {record['date']})"
        # Parts run on different machines across calls: each keeps its host (run_record.host_python_ms says why).
        card.setdefault("hosts", {})[part] = {"cpu": record["host_cpu"], "python_ms": record["host_python_ms"]}
        print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)
        print_card(card, part)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")  # after each part: a cut-off call keeps it


if __name__ == "__main__":
    main()
