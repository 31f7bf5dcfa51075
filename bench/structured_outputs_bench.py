"""Throughput of JSON-schema-constrained generation against unconstrained generation of the same number of tokens.

    python bench/structured_outputs_bench.py --config qwen3-0.6b --tokenizer DIR [--requests 256 --json-out FILE]
    python bench/structured_outputs_bench.py --model DIR --device cpu --requests 16     # a quick check on the CPU

Real model shapes with dummy weights. Every constrained request has the same JSON schema (compiled once per process,
as a server serving one agent's schema does) and samples at temperature 1, so the random model wanders through the
grammar; its reply ends where the grammar allows EOS. The unconstrained run then asks each request for exactly as many
tokens as its constrained reply had (EOS ignored), so both runs compute the same prefill and decode work and differ
only by the grammar: the per-step bitmask fill, its copy to the device and the masking of the logits.
"""

from __future__ import annotations

import sys
from pathlib import Path


import argparse
import json
import time

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "maxLength": 10}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "role", "score", "tags", "address"],
}


def timed(engine: Engine, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--tokenizer", help="tokenizer dir for --config (e.g. the Qwen3 tokenizer)")
    parser.add_argument("--model", help="a model directory instead of --config (real weights)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    if ns.model:
        model_dir, engine_args = ns.model, {}
    else:
        if not ns.tokenizer:
            parser.error("--config needs --tokenizer")
        model_dir, engine_args = str(dummy_config_dir(ns.config, ns.tokenizer)), {"load_format": "dummy"}
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, min(vocab, 30000), ns.prompt_len).tolist() for _ in range(ns.requests)]
    schema = json.dumps(SCHEMA)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_new_tokens=ns.max_new_tokens, json_schema=schema)
        for i in range(ns.requests)
    ]
    device_name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    with Engine(model_dir, device=ns.device, max_running_requests=ns.requests, **engine_args) as engine:
        # Warm-up: Triton kernels, CUDA graphs, the worker's tokenizer and the schema's compilation.
        engine.generate(prompts[:8], constrained[:8])
        engine.flush_cache()
        grammar_s, grammar_results = timed(engine, prompts, constrained)
        lengths = [len(r.token_ids) for r in grammar_results]
        checks = [_valid(r.text) for r in grammar_results]
        valid = None if None in checks else sum(checks)
        plain = [
            SamplingParams(temperature=1.0, seed=i, max_new_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)
        ]
        engine.flush_cache()
        plain_s, plain_results = timed(engine, prompts, plain)
        assert [len(r.token_ids) for r in plain_results] == lengths
    tokens = sum(lengths)
    row = {
        "device": device_name,
        "model": ns.model or f"{ns.config} (dummy weights)",
        "requests": ns.requests,
        "prompt_len": ns.prompt_len,
        "output_tokens": tokens,
        "mean_output_len": round(tokens / ns.requests, 1),
        "valid_json": valid,
        "truncated": sum(n >= ns.max_new_tokens for n in lengths),
        "constrained_s": round(grammar_s, 2),
        "unconstrained_s": round(plain_s, 2),
        "constrained_tok_per_s": round(tokens / grammar_s),
        "unconstrained_tok_per_s": round(tokens / plain_s),
        "constrained_over_unconstrained": round(plain_s / grammar_s, 3),
        "command": " ".join(["python", *sys.argv]),
    }
    print(json.dumps(row, indent=2))
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(row, indent=2) + "\n")


def _valid(text: str) -> bool | None:
    try:
        import jsonschema
    except ImportError:  # a GPU machine without the test extra: replies go unchecked
        return None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
