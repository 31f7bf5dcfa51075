"""Where sharing a prefix starts to pay: W1 and gsp wall time against the number of requests per shared prefix, with
shared-prefix attention on and off (`Engine`, dummy weights of a real shape, greedy).

    python -m bench.prefix_sharing_sweep --config qwen3-8b --tokenizer DIR [--per-prefix 1 2 4 8 16 32] --json-out F
    python -m bench.prefix_sharing_sweep --plot F.json --png F.png   (the plot alone, where matplotlib is installed)

W1 keeps its 8 system prompts of 1,024 tokens (128 new tokens each, 128 out) and gsp its groups of the scorecard's 8B
shape (16 prompts of 2,048 tokens, 128 new, 256 out); only the requests per prompt change. Each point is the median
of --repeats runs after a warm-up on the same prompts, from an empty cache (bench.offline_throughput.timed_run)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench.offline_throughput import prompts_for, timed_run
from bench.run_record import run_record
from bench.scorecard import GSP, PLAIN, SHAPES, W1
from radixserve.testing.tiny_models import dummy_config_dir

WORKLOADS = {"w1": W1, "gsp": GSP["8b"]}


def sweep(model_dir: str, per_prefix: list[int], repeats: int) -> dict:
    from radixserve.engine import Engine

    seconds = {}
    for mode, flags in {"shared": {}, "plain": PLAIN}.items():
        with Engine(model_dir, load_format="dummy", device="cuda", max_running_requests=1024, **flags) as engine:
            for name, base in WORKLOADS.items():
                for k in per_prefix:
                    w = base._replace(per_group=k)
                    prompts = prompts_for(w, engine.model_config.vocab_size)
                    timed_run(engine, prompts, w.output_len)  # warm-up on these shapes
                    runs = [timed_run(engine, prompts, w.output_len)["seconds"] for _ in range(repeats)]
                    seconds[f"{name}/{mode}/{k}"] = {"median": statistics.median(runs), "runs": runs}
                    print(f"{name:4s} {mode:6s} {k:3d} per prefix: {statistics.median(runs):.3f} s", flush=True)
    return seconds


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_prefix = result["per_prefix"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name in zip(axes, WORKLOADS):
        for mode, style in (("shared", "o-"), ("plain", "s--")):
            ys = [result["seconds"][f"{name}/{mode}/{k}"]["median"] for k in per_prefix]
            ax.plot(per_prefix, ys, style, label=f"shared-prefix attention {'on' if mode == 'shared' else 'off'}")
        ratios = [
            result["seconds"][f"{name}/shared/{k}"]["median"] / result["seconds"][f"{name}/plain/{k}"]["median"]
            for k in per_prefix
        ]
        for k, y, r in zip(per_prefix, [result["seconds"][f"{name}/shared/{k}"]["median"] for k in per_prefix], ratios):
            ax.annotate(f"{r:.2f}x", (k, y), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
        w = WORKLOADS[name]
        ax.set_title(
            f"{name.upper()}: {w.groups} prompts of {w.system_len} + {w.question_len} tokens, {w.output_len} out"
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(per_prefix, [str(k) for k in per_prefix])
        ax.set_xlabel("requests per shared prompt")
        ax.set_ylabel("wall time, s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{result['config']} shape, {result.get('gpu', '')}, commit {result.get('git_commit', '')}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-8b")
    parser.add_argument("--tokenizer")
    parser.add_argument("--per-prefix", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json-out")
    parser.add_argument("--plot", help="a JSON this bench wrote: draw it (--png) and exit")
    parser.add_argument("--png")
    ns = parser.parse_args()
    if ns.plot:
        plot(json.loads(open(ns.plot).read()), ns.png or ns.plot.replace(".json", ".png"))
        return
    import torch

    # timed_run counts Triton compiles in this cache (the engine's workers inherit it): a fresh one per sweep.
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="radixserve-sweep-triton-"))
    start = time.perf_counter()
    model_dir = str(dummy_config_dir(SHAPES.get(ns.config, ns.config), ns.tokenizer))
    result = {
        **run_record(),
        "config": ns.config,
        "gpu": torch.cuda.get_device_name(),
        "per_prefix": ns.per_prefix,
        "repeats": ns.repeats,
        "seconds": sweep(model_dir, ns.per_prefix, ns.repeats),
    }
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if ns.png:
        plot(result, ns.png)


if __name__ == "__main__":
    main()
