"""Throughput of shared-prefix chat traffic whose system prompts do not fit in the device KV pool: with the host-memory
KV tier (--hicache-size, radixserve/cache/host_tier.py) and without it (issue 13). Real model shapes with dummy
weights (greedy, EOS ignored, so every request generates exactly its output length).

    python -m bench.host_tier_bench --config qwen3-8b --tokenizer DIR [--repeats 3] [--json-out FILE]
    python -m bench.host_tier_bench --smoke          # tiny model on the CPU: checks the script runs

The workload: `groups` system prompts, each asked `per_group` new questions in every one of `rounds` rounds; a round is
one Engine.generate call with all its requests (arrivals interleave the groups). The device pool is pinned with
--max-total-tokens to half the tokens of all system prompts (the working set is twice the pool), so by the time a
system prompt comes back in the next round it has been evicted: without the tier it is computed again, with the tier
it is copied back from host memory.

One process per mode (an engine sizes its memory at start, which a previous engine would distort), every figure the
median of --repeats timed runs (cache flushed before each, the host tier included) with its spread
(bench/run_record.py). Printed per mode: wall time, output tokens/s, prompt tokens computed and cached, and the
host tier's hits and tokens copied each way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import torch

from bench.run_record import REPO, check_repeats, run_record, summarize_rows
from radixserve.engine import Engine
from radixserve.sampling import SamplingParams


class Workload(NamedTuple):
    groups: int
    per_group: int  # questions per system prompt per round
    system_len: int
    question_len: int
    output_len: int
    rounds: int

    @property
    def working_set(self) -> int:
        """Tokens of all system prompts: what a cache must hold for every round after the first to hit."""
        return self.groups * self.system_len


SMOKE = Workload(groups=4, per_group=1, system_len=64, question_len=8, output_len=2, rounds=2)
DEFAULT = Workload(groups=32, per_group=8, system_len=2048, question_len=64, output_len=32, rounds=3)


def rounds_of_prompts(w: Workload, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, vocab - 100, w.system_len).tolist() for _ in range(w.groups)]
    rounds = []
    for _ in range(w.rounds):
        prompts = [
            systems[g] + rng.integers(100, vocab - 100, w.question_len).tolist()
            for g in range(w.groups)
            for _ in range(w.per_group)
        ]
        rounds.append([prompts[i] for i in rng.permutation(len(prompts))])
    return rounds


def timed_run(engine: Engine, rounds: list[list[list[int]]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    assert engine.flush_cache()  # every run starts cold, on the device and on the host
    before = engine.server_info()
    start = time.perf_counter()
    results = [r for prompts in rounds for r in engine.generate(prompts, params)]
    elapsed = time.perf_counter() - start
    after = engine.server_info()
    assert after["kv_invariant_ok"]

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    return {
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(sum(len(r.token_ids) for r in results) / elapsed),
        "prefill_tokens_computed": delta("prefill_tokens_computed"),
        "cached_prompt_tokens": sum(r.cached_tokens for r in results),
        "host_hits": delta("hicache_hits"),
        "host_loaded_tokens": delta("hicache_loaded_tokens"),
        "host_saved_tokens": delta("hicache_saved_tokens"),
    }


class InProcessSmokeEngine:
    """--smoke: the scheduler and model runner in this process (InProcessEngine), answering the two Engine calls this
    script makes, so that a test runs the whole script in seconds."""

    def __init__(self, model_dir: str, **engine_args):
        from scheduler_service.in_process_engine import InProcessEngine

        self.engine = InProcessEngine(model_dir, **engine_args)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def flush_cache(self) -> bool:
        return self.engine.scheduler.flush_cache()

    def server_info(self) -> dict:
        from scheduler_service.cache_stats import cache_numbers

        s = self.engine.scheduler
        s.check_invariant(walk_tree=True)  # raises when broken
        return {"kv_invariant_ok": True, "prefill_tokens_computed": s.stats.prefill_tokens_computed, **cache_numbers(s)}


def run_mode(model_dir: str, w: Workload, vocab: int, repeats: int, smoke: bool, **engine_args) -> dict:
    if smoke:
        engine = InProcessSmokeEngine(model_dir, load_format="dummy", **engine_args)
    else:
        engine = Engine(model_dir, load_format="dummy", **engine_args)
    try:
        rounds = rounds_of_prompts(w, vocab)
        # Warm-up on the same prompts, so that every kernel variant the runs need is compiled before the clock runs.
        timed_run(engine, rounds, 2)
        return summarize_rows([timed_run(engine, rounds, w.output_len) for _ in range(repeats)])
    finally:
        if not smoke:
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-8b", help="model shape (radixserve/testing/configs)")
    parser.add_argument("--tokenizer", help="tokenizer dir (e.g. the Qwen3 tokenizer); not with --smoke")
    parser.add_argument(
        "--workload",
        type=int,
        nargs=6,
        metavar=("GROUPS", "PER_GROUP", "SYSTEM", "QUESTION", "OUT", "ROUNDS"),
        help=f"default: {' '.join(map(str, DEFAULT))}",
    )
    parser.add_argument(
        "--hicache-size",
        type=float,
        default=None,
        help="GB of host memory for the tier (default: twice the working set's KV)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (>= 3); figures are medians")
    parser.add_argument("--json-out")
    parser.add_argument("--only-mode", help=argparse.SUPPRESS)  # internal: run one mode, print its JSON row
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    if ns.smoke:
        from radixserve.testing.tiny_models import tiny_model_dir

        model_dir, w = str(tiny_model_dir("llama")), SMOKE
    else:
        if not ns.tokenizer:
            parser.error("--tokenizer is required (or --smoke)")
        from radixserve.testing.tiny_models import dummy_config_dir

        model_dir, w = str(dummy_config_dir(ns.config, ns.tokenizer)), Workload(*(ns.workload or DEFAULT))
    config = json.loads(open(f"{model_dir}/config.json").read())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    bytes_per_token = (
        2
        * config["num_hidden_layers"]
        * config.get("num_key_value_heads", heads)
        * head_dim
        * (2 if ns.device == "cuda" else 4)
    )
    host_gb = ns.hicache_size or float(f"{2 * w.working_set * bytes_per_token / 1e9:.3g}")
    pool = w.working_set // 2
    modes = {"without host tier": {}, "with host tier": {"hicache_size": host_gb}}
    engine_args = dict(device=ns.device, max_total_tokens=pool, max_running_requests=w.groups * w.per_group)
    if ns.only_mode:
        row = run_mode(model_dir, w, config["vocab_size"], ns.repeats, False, **engine_args, **modes[ns.only_mode])
        print("ROW " + json.dumps(row))
        return

    record = run_record()
    print(f"{record['date']}  {record['command']}  (commit {record['git_commit']})")
    print(
        f"{'tiny llama' if ns.smoke else ns.config} (dummy weights) on {record['gpu']}; {w.groups} system prompts "
        f"x {w.per_group} questions x {w.rounds} rounds, {w.system_len} + {w.question_len} prompt tokens, "
        f"{w.output_len} out; working set {w.working_set} tokens, device pool {pool} tokens; host tier {host_gb} GB "
        f"({bytes_per_token} KV bytes per token)",
        flush=True,
    )
    results = {}
    for mode in modes:
        if ns.smoke:
            results[mode] = row = run_mode(
                model_dir, w, config["vocab_size"], ns.repeats, True, **engine_args, **modes[mode]
            )
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.host_tier_bench", *sys.argv[1:], "--only-mode", mode],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode or not lines:
                print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            results[mode] = row = json.loads(lines[0][4:])
        print(
            f"  {mode:18s} " + ", ".join(f"{k} {v['median']:g} (spread {v['spread_pct']:g}%)" for k, v in row.items()),
            flush=True,
        )
    if len(results) == len(modes):
        on, off = (results[m]["seconds"]["median"] for m in ("with host tier", "without host tier"))
        print(f"  host tier: {off / on:.2f}x median wall time")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(
                {
                    **record,
                    "config": vars(ns),
                    "workload": w._asdict(),
                    "device_pool_tokens": pool,
                    "hicache_size_gb": host_gb,
                    "kv_bytes_per_token": bytes_per_token,
                    "results": results,
                },
                f,
                indent=2,
            )
    if len(results) != len(modes):
        sys.exit(1)


if __name__ == "__main__":
    main()
