"""CPU time of a step's grammar masks: --rows constrained requests under the JSON schema of the structured-outputs
benchmark, each walking its grammar with tokens drawn uniformly among the allowed ones (what a model with dummy
weights does), with and without the bounded-string rewrite (radixserve/grammar_rewrites.py).

    python -m bench.grammar_fill_bench --tokenizer DIR [--rows 256 --steps 64 --repeats 3]

Prints per mode the compile time and the median time of one step's batched fill (xgrammar's thread pool, as the
sampler calls it) with its spread over --repeats walks. On the GPU the fill of a step is on the critical path of
that step: the constrained/unconstrained throughput ratio cannot exceed forward / (forward + fill)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from radixserve.grammar import GrammarCompiler, RequestGrammar, allocate_bitmask, fill_bitmasks, unpack_bitmask
from radixserve.tokenizer_loading import load_tokenizer

from bench.run_record import check_repeats, run_record
from bench.structured_outputs_bench import SCHEMA


def walk(compiled, vocab_size: int, rows: int, steps: int, seed: int) -> list[float]:
    """Seconds of each step's batched fill while `rows` requests walk their grammar."""
    rng = random.Random(seed)
    grammars = [RequestGrammar(compiled, vocab_size) for _ in range(rows)]
    bitmask = allocate_bitmask(rows, vocab_size)
    times = []
    for _ in range(steps):
        active = [i for i, g in enumerate(grammars) if g.active]
        if not active:
            break
        start = time.perf_counter()
        fill_bitmasks([grammars[i] for i in active], bitmask, active)
        times.append(time.perf_counter() - start)
        for i in active:
            grammars[i].accept(rng.choice(unpack_bitmask(bitmask[i], vocab_size).nonzero().flatten().tolist()))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--vocab-size", type=int, help="the model's logits width (default: the tokenizer's length)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    check_repeats(ns.repeats)
    tokenizer = load_tokenizer(ns.tokenizer)
    vocab_size = ns.vocab_size or len(tokenizer)
    spec = ("json_schema", json.dumps(SCHEMA))
    results = {}
    for mode, unroll in (("xgrammar's EBNF", False), ("bounded strings unrolled", True)):
        compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], unroll_bounded_strings=unroll)
        start = time.perf_counter()
        compiled = compiler.compile(spec)
        compile_s = time.perf_counter() - start
        medians = [
            statistics.median(walk(compiled, vocab_size, ns.rows, ns.steps, seed)) * 1e3 for seed in range(ns.repeats)
        ]
        results[mode] = {
            "compile_s": round(compile_s, 2),
            "fill_ms_per_step": round(statistics.median(medians), 3),
            "fill_ms_spread": [round(min(medians), 3), round(max(medians), 3)],
        }
        print(
            f"{mode:26s} compile {compile_s:6.2f} s   fill per step ({ns.rows} rows) median "
            f"{results[mode]['fill_ms_per_step']:8.3f} ms  (runs {', '.join(f'{m:.3f}' for m in medians)})",
            flush=True,
        )
    row = {"rows": ns.rows, "steps": ns.steps, "vocab_size": vocab_size, "results": results, **run_record()}
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
