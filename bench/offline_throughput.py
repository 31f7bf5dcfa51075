"""Offline throughput of the engine on chat workloads with long shared system prompts, with and without shared-prefix
decode attention (issue 10), the radix cache and CUDA graphs. Real model shapes with dummy weights (greedy, EOS
ignored, so every request generates exactly its output length).

    python -m bench.offline_throughput --config qwen3-8b --tokenizer DIR --shape w1 [--repeats 3]
    python -m bench.offline_throughput --config qwen3-0.6b --tokenizer DIR --shape all --png throughput.png
    python -m bench.offline_throughput --smoke          # tiny model and shapes on the CPU: checks the script runs

Shapes (requests = system prompts x questions each; tokens: system + question, output):
  w1       8 x 16, 1,024 + 128, 128 out (the issue's W1)
  sglang   64 x 16, 2,048 + 128, 256 out (SGLang's shared-prefix benchmark)
  random   128 prompts of 1,152 random tokens, 128 out: nothing shared, the feature must cost nothing
  sweep    group size 2..32 at a 1,024-token prompt, and prompt length 256..4,096 at groups of 16 (for the PNG)
  all      every shape above
--custom G N S Q O runs one workload of your own; --modes also offers "no cache" and "eager" (no CUDA graphs).
Decode batches above --cuda-graph-max-bs (256) run eagerly in every mode (the SGLang shape runs 1,024 at once).

Runs the multi-process Engine (scheduler and worker processes, as the server), one process per mode (an engine sizes
its KV cache from free GPU memory, which a previous engine would distort) running every workload. Prints per mode and
workload: wall time, output tokens/s, and the bytes of KV one decode step reads in the model (every running request's
context, or each shared prefix once plus every request's own tokens) beside what the scheduler counted it saved.
Every figure is the median of --repeats timed runs (cache flushed before each) with its spread (bench/run_record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np
import torch

from bench.run_record import REPO, check_repeats, run_record, summarize_rows
from radixserve.engine import Engine
from radixserve.sampling import SamplingParams

MODES = {  # name -> engine arguments
    "shared prefix": {},
    "plain decode": {"disable_shared_prefix_attention": True},
    "no cache": {"disable_radix_cache": True},
    "eager": {"disable_cuda_graph": True},
}


class Workload(NamedTuple):
    name: str
    groups: int  # system prompts
    per_group: int  # requests per system prompt
    system_len: int
    question_len: int
    output_len: int

    @property
    def requests(self) -> int:
        return self.groups * self.per_group


def shapes(name: str) -> list[Workload]:
    if name == "smoke":  # tiny, for the CPU: the same code paths, seconds instead of minutes
        return [
            Workload("W1 smoke", 2, 4, 64, 8, 8),
            Workload("random smoke", 8, 1, 0, 72, 8),
            Workload("group 2", 4, 2, 64, 8, 8),
            Workload("prefix 32", 2, 4, 32, 8, 8),
        ]
    w1 = [Workload("W1", 8, 16, 1024, 128, 128)]
    sglang = [Workload("SGLang", 64, 16, 2048, 128, 256)]
    random = [Workload("random", 128, 1, 0, 1152, 128)]
    sweep = [Workload(f"group {g}", 128 // g, g, 1024, 128, 128) for g in (2, 4, 8, 32)] + [
        Workload(f"prefix {p}", 8, 16, p, 128, 128) for p in (256, 512, 2048, 4096)
    ]
    return {"w1": w1, "sglang": sglang, "random": random, "sweep": w1 + sweep, "all": w1 + sglang + random + sweep}[
        name
    ]


def prompts_for(w: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, vocab - 100, w.system_len).tolist() for _ in range(w.groups)]
    prompts = [
        systems[g] + rng.integers(100, vocab - 100, w.question_len).tolist()
        for g in range(w.groups)
        for _ in range(w.per_group)
    ]
    return [prompts[i] for i in rng.permutation(len(prompts))]  # arrivals interleave the groups


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def modelled_kv_read(w: Workload, grouped: bool, bytes_per_token: int, min_tokens: int) -> int:
    """Bytes of KV one decode step reads with every request running, halfway through its output: each request's
    whole context, or (grouped) each system prompt once plus every request's own tokens."""
    own = w.question_len + w.output_len // 2
    if grouped and w.per_group >= 2 and w.system_len >= min_tokens:
        return (w.groups * w.system_len + w.requests * own) * bytes_per_token
    return w.requests * (w.system_len + own) * bytes_per_token


def triton_cache_entries() -> set[str]:
    """Kernels Triton has compiled in this mode's processes so far: each compile adds one entry to the cache
    directory that run_mode gives the mode (a fresh one, so that loads from an older cache do not hide a compile)."""
    directory = os.environ.get("TRITON_CACHE_DIR")
    return set(os.listdir(directory)) if directory and os.path.isdir(directory) else set()


def triton_compiles() -> int:
    return len(triton_cache_entries())


def kernel_names(entries: set[str]) -> list[str]:
    """The kernels of these cache entries (each entry's directory holds <kernel name>.json among its files)."""
    directory = os.environ["TRITON_CACHE_DIR"]
    return sorted(
        name[:-5]
        for entry in entries
        for name in os.listdir(os.path.join(directory, entry))
        if name.endswith(".json") and not name.startswith("__grp__")
    )


def timed_run(engine: Engine, prompts, output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    assert engine.flush_cache()  # every run starts from an empty cache, as the first did
    before = engine.server_info()
    compiled_before = triton_cache_entries()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = engine.server_info()
    assert after["kv_invariant_ok"]
    output_tokens = sum(len(r.token_ids) for r in results)
    steps = after["steps"] - before["steps"]
    return {
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed),
        "requests_per_s": round(len(prompts) / elapsed, 2),
        "cached_prompt_tokens": sum(r.cached_tokens for r in results),
        "prefill_tokens_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        "steps": steps,
        "grouped_decodes": after.get("grouped_decodes", 0) - before.get("grouped_decodes", 0),
        "saved_tokens_per_step": round(
            (after.get("shared_prefix_tokens_saved", 0) - before.get("shared_prefix_tokens_saved", 0)) / max(1, steps)
        ),
        # A compile inside a timed run costs it a second or more; a warm engine should show none.
        "triton_compiles": len(triton_cache_entries() - compiled_before),
        "triton_compiled": kernel_names(triton_cache_entries() - compiled_before),
    }


def run_mode(model_dir: str, workloads: list[Workload], vocab: int, repeats: int, **engine_args) -> dict:
    # A fresh Triton cache for this mode's processes (the workers inherit it), so that triton_compiles() counts
    # every compile, also those an older cache would have served from disk.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="radixserve-triton-")
    with Engine(model_dir, load_format="dummy", **engine_args) as engine:
        rows = {}
        for w in workloads:
            prompts = prompts_for(w, vocab)
            # Warm-up: one whole untimed run of the same prompts and output length, so that every Triton kernel
            # variant the timed runs meet (batch sizes and context lengths of mixed steps) compiles before the clock
            # runs. A 4-token warm-up left compiles inside the first timed runs (H100: up to 4.5x the later runs).
            timed_run(engine, prompts, w.output_len)
            rows[w.name] = summarize_rows([timed_run(engine, prompts, w.output_len) for _ in range(repeats)])
    return rows


def median_and_spread(value) -> str:
    if isinstance(value, dict) and "median" in value:
        return f"{value['median']:g} (spread {value['spread_pct']:g}%)"
    return str(value)


def draw_png(path: str, workloads: list[Workload], results: dict, title: str) -> None:
    """Output tokens/s against group size (1,024-token prompts) and against prompt length (groups of 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {w.name: w for w in workloads}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    base = next((w for w in workloads if w.name.startswith("W1")), workloads[0])
    for ax, key, label in (
        (axes[0], "per_group", "requests per system prompt (group size)"),
        (axes[1], "system_len", "system prompt tokens"),
    ):
        other = "system_len" if key == "per_group" else "per_group"
        points = sorted(
            (
                w
                for w in by_name.values()
                if w.system_len
                and getattr(w, other) == getattr(base, other)
                and (w.requests, w.question_len, w.output_len) == (base.requests, base.question_len, base.output_len)
            ),
            key=lambda w: getattr(w, key),
        )
        for mode, marker in (("shared prefix", "o-"), ("plain decode", "s--")):
            xs, ys, errs = [], [], []
            for w in points:
                row = results.get(mode, {}).get(w.name)
                if row:
                    t = row["output_tok_per_s"]
                    xs.append(getattr(w, key))
                    ys.append(t["median"])
                    errs.append([[t["median"] - t["min"]], [t["max"] - t["median"]]])
            if xs:
                ax.errorbar(
                    xs,
                    ys,
                    yerr=np.concatenate(errs, axis=1),
                    fmt=marker,
                    capsize=3,
                    label=f"{mode} attention" if mode == "plain decode" else mode,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-0.6b", help="model shape (radixserve/testing/configs)")
    parser.add_argument("--tokenizer", help="tokenizer dir (e.g. the Qwen3 tokenizer); not with --smoke")
    parser.add_argument("--shape", default="w1", choices=["w1", "sglang", "random", "sweep", "all"])
    parser.add_argument(
        "--custom",
        type=int,
        nargs=5,
        metavar=("GROUPS", "PER_GROUP", "SYSTEM", "QUESTION", "OUT"),
        help="one workload of your own instead of --shape (e.g. 8 32 2048 64 128: the earlier default)",
    )
    parser.add_argument(
        "--modes", default="shared prefix,plain decode", help=f"comma-separated, of: {', '.join(MODES)}"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and shapes on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-running-requests", type=int, default=1024)
    parser.add_argument("--shared-prefix-min-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (>= 3); figures are medians")
    parser.add_argument("--json-out")
    parser.add_argument("--png", help="draw throughput against group size and prompt length here")
    parser.add_argument("--only-mode", help=argparse.SUPPRESS)  # internal: run one mode, print its JSON rows
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    if ns.smoke:
        from radixserve.testing.tiny_models import tiny_model_dir

        model_dir, workloads, dtype_bytes = str(tiny_model_dir("llama")), shapes("smoke"), 4
        min_tokens = ns.shared_prefix_min_tokens or 16
        extra = {"max_total_tokens": 8192}
    else:
        if not ns.tokenizer:
            parser.error("--tokenizer is required (or --smoke)")
        from radixserve.testing.tiny_models import dummy_config_dir

        model_dir, workloads = str(dummy_config_dir(ns.config, ns.tokenizer)), shapes(ns.shape)
        if ns.custom:
            workloads = [Workload("custom", *ns.custom)]
        dtype_bytes = 2 if ns.device == "cuda" else 4
        min_tokens = ns.shared_prefix_min_tokens or 512
        extra = {}
    config = json.loads(open(f"{model_dir}/config.json").read())
    modes = [m.strip() for m in ns.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    if ns.device != "cuda" and "eager" in modes:
        modes.remove("eager")  # the CPU has no CUDA graphs to compare with
    engine_args = dict(
        device=ns.device, max_running_requests=ns.max_running_requests, shared_prefix_min_tokens=min_tokens, **extra
    )
    if ns.only_mode:
        rows = run_mode(model_dir, workloads, config["vocab_size"], ns.repeats, **engine_args, **MODES[ns.only_mode])
        print("ROWS " + json.dumps(rows))
        return

    record = run_record()
    bytes_per_token = kv_bytes_per_token(config, dtype_bytes)
    print(f"{record['date']}  {record['command']}  (commit {record['git_commit']})")
    print(
        f"{'tiny llama' if ns.smoke else ns.config} (dummy weights) on {record['gpu']}; KV {bytes_per_token} bytes "
        f"per token; --shared-prefix-min-tokens {min_tokens}",
        flush=True,
    )
    results = {}
    for mode in modes:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.offline_throughput", *sys.argv[1:], "--only-mode", mode],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")]
        if proc.returncode or not lines:
            print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[mode] = json.loads(lines[0][5:])
    for w in workloads:
        print(
            f"\n{w.name}: {w.requests} requests = {w.groups} x {w.per_group}, {w.system_len} + {w.question_len} "
            f"prompt tokens, {w.output_len} out"
        )
        for mode in modes:
            row = results.get(mode, {}).get(w.name)
            if row is None:
                continue
            model_kv = modelled_kv_read(w, mode == "shared prefix", bytes_per_token, min_tokens)
            saved = row["saved_tokens_per_step"]["median"] * bytes_per_token
            print(
                f"  {mode:14s} KV read per decode step (model) {model_kv / 1e6:9.1f} MB, saved (counted) "
                f"{saved / 1e6:9.1f} MB | seconds {median_and_spread(row['seconds'])}, output tok/s "
                f"{median_and_spread(row['output_tok_per_s'])}, steps {median_and_spread(row['steps'])}, "
                f"Triton compiles in the timed runs {row['triton_compiles']['runs']}",
                flush=True,
            )
        if "shared prefix" in results and "plain decode" in results and w.name in results["plain decode"]:
            on = results["shared prefix"][w.name]["seconds"]["median"]
            off = results["plain decode"][w.name]["seconds"]["median"]
            print(f"  shared-prefix attention: {off / on:.2f}x median wall time")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(
                {
                    **record,
                    "config": vars(ns),
                    "kv_bytes_per_token": bytes_per_token,
                    "workloads": [w._asdict() for w in workloads],
                    "results": results,
                },
                f,
                indent=2,
            )
    if ns.png:
        draw_png(
            ns.png,
            workloads,
            results,
            f"{'tiny llama (CPU smoke)' if ns.smoke else ns.config}, {record['gpu']}, {record['date'][:10]}",
        )
        print(f"\nwrote {ns.png}")
    if len(results) != len(modes):
        sys.exit(1)


if __name__ == "__main__":
    main()
