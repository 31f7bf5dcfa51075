"""Tunes the split path of shared-prefix decode attention (kernels/shared_prefix_attention.py) on an H100: the
prefix kernel's blocks, its slice length and the partials' dtype, then the suffix kernel's blocks, on the W1 and gsp
geometries of both model shapes, padded as a decode CUDA graph runs them (GPU).

    python -m bench.shared_prefix_tune --out bench/results/shared-prefix-tune-h100.md

Each trial is bench/shared_prefix_kernel_bench.py's measurement (the grouped path over several KV-cache copies in
one CUDA graph, each kernel's time from the torch profiler and its share of the copy bandwidth for the bytes it must
read). Stage 1 times every prefix block config at 256-token slices and float32 partials; stage 2 the two fastest with
every slice length and both partials dtypes; stage 3 the suffix blocks under the best of stage 2. Trials are ranked
by the whole path's time per layer (slices and partials move work between the two kernels). Stops at --budget-s
and reports what it has. It changes the module's tables in this process only; the chosen values go into the code
by hand, with the report.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from bench.shared_prefix_batches import (
    graph_padded,
    layer_copies,
    make_grouped_batch,
    own_bytes,
    prefix_bytes,
    run_grouped,
)
from bench.shared_prefix_kernel_bench import CONTEXT_LEN, GEOMETRIES, attention_shapes, measure
from kernels import shared_prefix_attention as spa

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M 32 only where a group's rows fit (GQA 2 x 16 members).
PREFIX_BLOCKS = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 3),
    (64, 128, 4, 2),
    (64, 128, 8, 2),
    (64, 64, 8, 3),
    (32, 64, 4, 3),
    (32, 128, 4, 2),
]
SLICE_TOKENS = (128, 256, 512)
PARTIALS = ("float32", "input")
# (BLOCK_N, num_warps, num_stages)
SUFFIX_BLOCKS = [
    (16, 1, 2),
    (64, 4, 2),
    (64, 4, 3),
    (64, 2, 2),
    (32, 4, 2),
    (32, 2, 3),
    (128, 4, 2),
    (128, 8, 2),
    (128, 4, 1),
    (16, 2, 2),
]
KERNELS = {"_prefix_kernel": prefix_bytes, "_suffix_split_kernel": own_bytes}


def trial(copies, copy_bw):
    """(us per layer, {kernel: (us, share)}) of the grouped path under the module's current tables."""
    for c in copies:  # the step's slice count follows the policy under test
        c["padded"] = graph_padded(c, CONTEXT_LEN, max(1, c["q"].shape[0] // 2))
    per_layer, kernels = measure("tune", lambda b, o: run_grouped(spa, b["padded"], o), KERNELS, copies, copy_bw)
    return per_layer * 1e6, {n: (s * 1e6, share) for n, (s, calls, share) in kernels.items() if n in KERNELS}


def describe(kernels):
    return "; ".join(f"{n.strip('_').split('_')[0]} {us:.1f} us ({share:.0%})" for n, (us, share) in kernels.items())


def tune(shape, geometry, copy_bw, layers, lines, deadline):
    hq, hkv, d = attention_shapes()[shape]
    groups, members, prefix, own = GEOMETRIES[geometry]
    b = make_grouped_batch(
        [(prefix, [own] * members)] * groups, [], hq, hkv, d, torch.bfloat16, "cuda", torch.Generator().manual_seed(1)
    )
    copies = layer_copies(b, layers)
    saved_prefix, saved_slices = dict(spa.PREFIX_CONFIG["16bit"]), spa.PREFIX_SPLITS["min_split_tokens"]
    saved_partials, saved_suffix = spa.PARTIALS_16BIT, dict(spa.SUFFIX_CONFIG["16bit"])
    results = []

    def run(label, prefix_blocks, slice_tokens, partials, suffix_blocks):
        if time.time() > deadline:
            return None
        m, n, w, st = prefix_blocks
        if m < members * (hq // hkv) and m != 64:
            return None
        spa.PREFIX_CONFIG["16bit"] = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
        spa.PREFIX_SPLITS["min_split_tokens"] = slice_tokens
        spa.PARTIALS_16BIT = partials
        spa.SUFFIX_CONFIG["16bit"] = (
            {} if suffix_blocks is None else dict(zip(("BLOCK_N", "num_warps", "num_stages"), suffix_blocks))
        )
        try:
            us, kernels = trial(copies, copy_bw)
        except Exception as exc:  # e.g. out of shared memory
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return None
        row = (us, label, prefix_blocks, slice_tokens, partials, suffix_blocks, kernels)
        results.append(row)
        print(f"  {shape} {geometry} {label}: {us:.1f} us/layer  {describe(kernels)}", flush=True)
        return row

    try:
        stage1 = [run(f"prefix {pb}", pb, 256, "float32", None) for pb in PREFIX_BLOCKS]
        top = sorted((r for r in stage1 if r), key=lambda r: r[0])[:2]
        for r in top:
            for tokens in SLICE_TOKENS:
                for partials in PARTIALS:
                    if (tokens, partials) != (256, "float32"):
                        run(f"prefix {r[2]} slices {tokens} partials {partials}", r[2], tokens, partials, None)
        best = min(results, key=lambda r: r[0])
        for sb in SUFFIX_BLOCKS:
            run(f"best prefix, suffix {sb}", best[2], best[3], best[4], sb)
    finally:
        spa.PREFIX_CONFIG["16bit"], spa.PREFIX_SPLITS["min_split_tokens"] = saved_prefix, saved_slices
        spa.PARTIALS_16BIT, spa.SUFFIX_CONFIG["16bit"] = saved_partials, saved_suffix
    results.sort(key=lambda r: r[0])
    lines += [
        "",
        f"### {shape}, {geometry} ({groups} prefixes of {prefix} tokens x {members} members, {own} own tokens)",
        "",
        "| us per layer | trial | prefix (BLOCK_M, BLOCK_N, warps, stages) | slice tokens | partials | suffix "
        "(BLOCK_N, warps, stages) | kernels: us (share of copy bandwidth) |",
        "|---|---|---|---|---|---|---|",
    ]
    for us, label, pb, tokens, partials, sb, kernels in results:
        lines.append(
            f"| {us:.1f} | {label} | {pb} | {tokens} | {partials} | {sb or 'decode default'} | {describe(kernels)} |"
        )
    torch.cuda.empty_cache()
    return results[0] if results else None


def scaling(copy_bw, layers, lines):
    """The split path's two kernels against the length they read (Qwen3-8B shape, 8 groups x 16): each kernel's time
    is a fixed part plus its bytes at the copy bandwidth, and the fixed part is what short suffixes and prefixes
    pay."""
    hq, hkv, d = attention_shapes()["qwen3-8b"]
    lines += ["", "### Time against length (qwen3-8b, 8 groups x 16, current tables)", ""]
    lines += ["| kernel | length | us | share of copy bandwidth |", "|---|---|---|---|"]
    sweeps = (("_suffix_split_kernel", (64, 128, 256, 1024, 4096)), ("_prefix_kernel", (256, 1024, 4096)))
    for kernel, lengths in sweeps:
        for length in lengths:
            prefix, own = (1024, length) if kernel == "_suffix_split_kernel" else (length, 128)
            b = make_grouped_batch(
                [(prefix, [own] * 16)] * 8, [], hq, hkv, d, torch.bfloat16, "cuda", torch.Generator().manual_seed(1)
            )
            _, kernels = trial(layer_copies(b, layers if max(prefix, own) <= 1024 else 2), copy_bw)
            us, share = kernels[kernel]
            lines.append(f"| {kernel} | {length} | {us:.1f} | {share:.0%} |")
            print(f"  {kernel} {length}: {us:.1f} us ({share:.0%})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-0.6b"])
    parser.add_argument("--geometries", nargs="+", default=["W1", "gsp"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--scaling", action="store_true", help="only each kernel's time against the length it reads")
    parser.add_argument("--out")
    args = parser.parse_args()
    from bench.gpu_timing import copy_bandwidth

    started = time.time()
    copy_bw = copy_bandwidth()
    lines = [
        "# Shared-prefix split path: tuning",
        "",
        f"`python -m bench.shared_prefix_tune {' '.join(sys.argv[1:])}` on {torch.cuda.get_device_name()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}. "
        f"Copy bandwidth {copy_bw / 1e9:.0f} GB/s.",
    ]
    if args.scaling:
        scaling(copy_bw, args.layers, lines)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        return
    pairs = [(s, g) for s in args.shapes for g in args.geometries]
    bests = []
    for i, (shape, geometry) in enumerate(pairs):
        # Each pair gets an equal share of what is left of the budget.
        deadline = time.time() + (args.budget_s - (time.time() - started)) / (len(pairs) - i)
        best = tune(shape, geometry, copy_bw, args.layers, lines, deadline)
        if best:
            bests.append(f"- {shape} {geometry}: {best[0]:.1f} us/layer with {best[1]} ({describe(best[6])})")
    lines[3:3] = ["", "Best per shape and geometry:", "", *bests]
    print("\n".join(bests))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
