"""Data parallelism on the shared-prefix chat workload: --dp-size 1 against --dp-size 2 with each routing method
(cache-aware, round-robin, shortest-queue), offline Engine, dummy weights, EOS ignored. Prints throughput and the
prompt-token cache hit rate side by side; each figure is the median of --repeats timed runs (cache flushed first).

    python -m bench.data_parallel_bench --config qwen3-8b --tokenizer DIR [--groups 64 --per-group 16
        --system-len 2048 --question-len 128 --output-len 256 --tp-size 1]

Each mode runs in a fresh process (the KV cache is sized from free GPU memory); replica i uses GPUs
i*tp .. i*tp+tp-1, so --dp-size 2 needs 2 x --tp-size GPUs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from bench.offline_throughput import median_and_spread, run, workload
from bench.run_record import REPO, check_repeats, run_record
from radixserve.testing.tiny_models import dummy_config_dir

MODES = {
    "dp1": {"dp_size": 1},
    "dp2 cache_aware": {"dp_size": 2, "load_balance_method": "cache_aware"},
    "dp2 round_robin": {"dp_size": 2, "load_balance_method": "round_robin"},
    "dp2 shortest_queue": {"dp_size": 2, "load_balance_method": "shortest_queue"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-8b")
    parser.add_argument("--tokenizer", required=True, help="tokenizer dir (e.g. the Qwen3 tokenizer)")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-total-tokens", type=int, help="KV cache per replica (default: from GPU memory)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (>= 3); figures are medians")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--json-out")
    parser.add_argument("--only-mode", help=argparse.SUPPRESS)  # internal: run one mode, print its JSON row
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    prompts = workload(ns.groups, ns.per_group, ns.system_len, ns.question_len, vocab)
    if ns.only_mode:
        extra = {"max_total_tokens": ns.max_total_tokens} if ns.max_total_tokens else {}
        row = run(
            model_dir,
            prompts,
            ns.output_len,
            ns.repeats,
            device=ns.device,
            tp_size=ns.tp_size,
            **MODES[ns.only_mode],
            **extra,
        )
        row["hit_rate"] = round(row["cached_prompt_tokens"]["median"] / row["input_tokens"]["median"], 4)
        print("ROW " + json.dumps(row))
        return
    record = run_record()
    print(f"{record['date']}  {record['command']}  (commit {record['git_commit']})")
    print(
        f"{ns.config} (dummy weights) on {record['gpu']}: {len(prompts)} requests, {ns.groups} system prompts of "
        f"{ns.system_len} tokens + {ns.question_len}-token questions, {ns.output_len} output tokens, tp {ns.tp_size}"
    )
    rows = {}
    modes = ns.modes.split(",")
    for mode in modes:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.data_parallel_bench", *sys.argv[1:], "--only-mode", mode],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not lines:
            print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        rows[mode] = json.loads(lines[0][4:])
        shown = ("seconds", "output_tok_per_s", "input_tok_per_s", "hit_rate", "prefill_tokens_computed")
        print(f"{mode:20s} " + ", ".join(f"{k} {median_and_spread(rows[mode][k])}" for k in shown), flush=True)
    if "dp1" in rows:
        for mode in rows:
            if mode != "dp1":
                speedup = rows["dp1"]["seconds"]["median"] / rows[mode]["seconds"]["median"]
                print(f"{mode}: {speedup:.2f}x the throughput of dp1 (median wall time)")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({**record, "config": vars(ns), "results": rows}, f, indent=2)
    if len(rows) != len(modes):
        sys.exit(1)


if __name__ == "__main__":
    main()
