"""Offline throughput of the engine on a chat workload with long shared system prompts: radix cache on vs off, and
(on the GPU) decode steps replayed from CUDA graphs vs launched eagerly.
Real model shapes with dummy weights (greedy, EOS ignored, so every request generates exactly --output-len tokens).

    python bench/offline_throughput.py --config qwen3-0.6b --tokenizer DIR [--groups 8 --per-group 32 ...]

Runs the multi-process Engine (scheduler and worker processes, as the server). Prints, per mode: wall time, requests/s, input and output tokens/s, prompt tokens served from the cache, and
prefill tokens actually computed."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/kernels.py would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import subprocess
import json
import time

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir


def workload(groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, vocab - 100, system_len).tolist() for _ in range(groups)]
    prompts = [systems[g] + rng.integers(100, vocab - 100, question_len).tolist()
               for g in range(groups) for _ in range(per_group)]
    order = rng.permutation(len(prompts))  # arrivals interleave the groups
    return [prompts[i] for i in order]


def run(model_dir: str, prompts, output_len: int, **engine_args) -> dict:
    with Engine(model_dir, load_format="dummy", **engine_args) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
        # Warm-up on the same prompts, so that every Triton kernel variant the run needs is compiled before the clock
        # starts (a fresh machine compiles each one on first use, a second or more each).
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        assert engine.flush_cache()
        before = engine.server_info()
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        after = engine.server_info()
        assert after["kv_invariant_ok"]
    input_tokens = sum(r.prompt_tokens for r in results)
    output_tokens = sum(len(r.token_ids) for r in results)
    return {
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(prompts) / elapsed, 2),
        "input_tok_per_s": round(input_tokens / elapsed),
        "output_tok_per_s": round(output_tokens / elapsed),
        "cached_prompt_tokens": sum(r.cached_tokens for r in results),
        "input_tokens": input_tokens,
        "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        "steps": after["steps"] - before["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", required=True, help="tokenizer dir (e.g. the Qwen3 tokenizer)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--json-out")
    parser.add_argument("--only-mode", help=argparse.SUPPRESS)  # internal: run one mode, print its JSON row
    ns = parser.parse_args()
    model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    prompts = workload(ns.groups, ns.per_group, ns.system_len, ns.question_len, vocab)
    device_name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    print(f"{ns.config} (dummy weights) on {device_name}: {len(prompts)} requests, {ns.groups} system prompts of "
          f"{ns.system_len} tokens + {ns.question_len}-token questions, {ns.output_len} output tokens each")
    rows = {}
    modes = {"radix cache": {}, "no cache": {"disable_radix_cache": True},
             "radix, eager": {"disable_cuda_graph": True}}
    if ns.device != "cuda":
        del modes["radix, eager"]
    if ns.only_mode:
        row = run(model_dir, prompts, ns.output_len, device=ns.device,
                  max_running_requests=ns.max_running_requests, **modes[ns.only_mode])
        print("ROW " + json.dumps(row))
        return
    for mode in modes:
        # Each mode in a fresh process: an engine sizes its KV cache from free GPU memory, which the previous
        # engine's cache and graphs would otherwise distort.
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only-mode", mode], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not lines:
            print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        rows[mode] = json.loads(lines[0][4:])
        print(f"{mode:12s} {rows[mode]}", flush=True)
    if "no cache" in rows and "radix cache" in rows:
        print(f"radix cache speed-up: {rows['no cache']['seconds'] / rows['radix cache']['seconds']:.2f}x wall time")
    if "radix, eager" in rows and "radix cache" in rows:
        print(f"CUDA graph speed-up: {rows['radix, eager']['seconds'] / rows['radix cache']['seconds']:.2f}x wall time")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"config": vars(ns), "device": device_name, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
