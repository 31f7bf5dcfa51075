"""Greedy tokens with shared-prefix decode attention against the plain decode path, in the GPU's dtype (issue 10's
bf16 check): the same requests through two engines, one with --disable-shared-prefix-attention.

    python -m bench.shared_prefix_agreement --config qwen3-0.6b --tokenizer DIR [--json-out FILE]
    python -m bench.shared_prefix_agreement --smoke      # tiny model on the CPU, fp32: must agree exactly

Requests: --groups system prompts x --per-group questions each (256 by default), greedy, EOS ignored. Prints the share
of requests whose whole output is identical, and top-1 agreement: the share of output positions, up to each request's
first difference, that agree, counting every position after a difference as a disagreement (free-running decoding
can not be compared past one). Exit 1 when top-1 agreement is under --min-agreement."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from bench.run_record import run_record
from radixserve.engine import Engine
from radixserve.sampling import SamplingParams


def run(model_dir: str, prompts, new_tokens: int, **engine_args) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model_dir, **engine_args) as engine:
        results = engine.generate(prompts, params)
        assert engine.server_info()["kv_invariant_ok"]
        return [list(r.token_ids) for r in results]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    agree = total = identical = 0
    for x, y in zip(a, b):
        first_diff = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        agree += first_diff
        total += len(x)
        identical += first_diff == len(x)
    return agree / max(1, total), identical / max(1, len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--tokenizer")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-agreement", type=float, default=0.995)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    if ns.smoke:
        from radixserve.testing.tiny_models import tiny_model_dir

        model_dir = str(tiny_model_dir("llama"))
        ns.groups, ns.per_group, ns.system_len, ns.question_len, ns.new_tokens = 2, 4, 48, 8, 8
        engine_args = {"device": "cpu", "shared_prefix_min_tokens": 16}
        ns.min_agreement = 1.0
    else:
        if not ns.tokenizer:
            parser.error("--tokenizer is required (or --smoke)")
        from radixserve.testing.tiny_models import dummy_config_dir

        model_dir = str(dummy_config_dir(ns.config, ns.tokenizer))
        engine_args = {"device": "cuda" if torch.cuda.is_available() else "cpu", "load_format": "dummy"}
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    rng = np.random.default_rng(0)
    systems = [rng.integers(100, vocab - 100, ns.system_len).tolist() for _ in range(ns.groups)]
    prompts = [
        systems[g] + rng.integers(100, vocab - 100, ns.question_len).tolist()
        for g in range(ns.groups)
        for _ in range(ns.per_group)
    ]
    grouped = run(model_dir, prompts, ns.new_tokens, **engine_args)
    plain = run(model_dir, prompts, ns.new_tokens, disable_shared_prefix_attention=True, **engine_args)
    top1, identical = agreement(grouped, plain)
    record = run_record()
    row = {
        **record,
        "requests": len(prompts),
        "new_tokens": ns.new_tokens,
        "top1_agreement": round(top1, 5),
        "identical_outputs": round(identical, 5),
    }
    print(f"{record['date']}  {record['command']}  ({record['gpu']})")
    print(
        f"{len(prompts)} requests ({ns.groups} x {ns.per_group}, {ns.system_len} + {ns.question_len} tokens, "
        f"{ns.new_tokens} out): top-1 agreement {top1:.2%}, identical outputs {identical:.2%}"
    )
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(row, f, indent=2)
    if top1 < ns.min_agreement:
        sys.exit(1)


if __name__ == "__main__":
    main()
