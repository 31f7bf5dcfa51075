"""Where a cache-hit prefill's time goes: a system prompt cached once, then 40 requests of that prompt plus fresh
tokens, one output token each, through the offline Engine; the worker's profiler (radixserve/worker/profiler.py)
records 8 of those steps after the first 25. Real model shapes with dummy weights.

    python -m bench.cache_hit_profile --config qwen3-8b --tokenizer DIR --out DIR   # DIR/rank0.txt: ops by time

Prints each request's time to its first token and the median."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen3-8b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--new-len", type=int, default=128)
    parser.add_argument("--out", required=True, help="directory of the profile table (rank0.txt)")
    ns = parser.parse_args()
    # Read by the worker processes the Engine starts, which inherit this environment.
    os.environ.update(RADIXSERVE_PROFILE_DIR=ns.out, RADIXSERVE_PROFILE_SKIP="25", RADIXSERVE_PROFILE_STEPS="8")
    model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
    rng = np.random.default_rng(0)
    fresh = lambda n: rng.integers(100, 100_000, n).tolist()  # noqa: E731 - a fresh random prompt
    one_token = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    with Engine(model_dir, load_format="dummy", device="cuda") as engine:
        system = fresh(ns.prefix_len)
        engine.generate(system + fresh(ns.new_len), one_token)  # caches the system prompt
        times = []
        for _ in range(40):
            start = time.perf_counter()
            engine.generate(system + fresh(ns.new_len), one_token)
            times.append(time.perf_counter() - start)
    print("cache-hit TTFT ms:", [round(t * 1e3, 1) for t in times])
    print("median", round(statistics.median(times) * 1e3, 2))


if __name__ == "__main__":
    main()
