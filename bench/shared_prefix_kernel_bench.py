"""Shared-prefix (grouped) decode attention: correctness of the grouped kernels, then each kernel's share of the copy
bandwidth for the bytes it must read.

    python bench/shared_prefix_kernel_bench.py --out bench/results/shared-prefix-bandwidth-h100.md           # GPU
    python bench/shared_prefix_kernel_bench.py --check-only                                               # GPU
    TRITON_INTERPRET=1 python bench/shared_prefix_kernel_bench.py --interpret                             # CPU (CI)

Paths: "plain" (kernels/triton_attention.py's split + merge kernels) and "grouped" (kernels/shared_prefix_attention.py's
prefix, suffix and merge kernels). Correctness compares the grouped path with the plain decode kernel on the same batch
(and with the fp32 torch reference where it fits), outputs poisoned with NaN.

Bandwidth: on the W1 geometry (8 prefixes of 1,024 tokens x 16 members, 128 own tokens each) and the gsp geometry
(2,048-token prefixes, same groups), for the Qwen3-8B and Qwen3-0.6B attention shapes, each path runs over
--layers copies of the KV cache in one CUDA graph (more bytes than L2 holds, as a decode step's layers are), and the
torch profiler gives each kernel's time. A kernel's must-read bytes: each prefix once (prefix kernel), the own tokens
(suffix kernel), every context (plain kernels; their share can pass 100% as members' shared
prefix rows come from L2). "padded": the group table and bounds as a decode CUDA graph passes them (bs // 2 groups,
the context length, the batch size), which is what serving runs. A last row per shape and geometry gives the read-only
floor of the prefix and suffix gathers (bench/kv_read_floor.py): the share no kernel reading them so can pass. The
checks are in bench/shared_prefix_kernel_checks.py.

--lone: the serving probe's geometry (8 prompts of 2,048 tokens x 4 members, 130 own tokens) with 0, 1 and 2 decodes
in no group (whole contexts of 2,178 tokens), and with members of 2,048 own tokens (long histories), padded as a
decode graph: the plain path, the grouped path with those decodes in the suffix kernel, and with them as groups of one
(--lone-decode-min-tokens 512).
"""

import argparse
import datetime
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.shared_prefix_batches import (  # noqa: E402,F401
    graph_padded,
    kv_bytes,
    with_lone_groups,
    layer_copies,
    make_grouped_batch,
    own_bytes,
    prefix_bytes,
    rel_err,
    run_grouped,
    run_plain,
    step_slices,
)
from bench.shared_prefix_kernel_checks import DEVICE, run_checks  # noqa: E402

GEOMETRIES = {"W1": (8, 16, 1024, 128), "gsp": (8, 16, 2048, 128)}  # groups, members, prefix, own tokens
CONTEXT_LEN = 40960  # Qwen3's: the bound a decode CUDA graph is captured with


# --------------------------------------------------------------------------------------------------
# Bandwidth (GPU)
# --------------------------------------------------------------------------------------------------


def attention_shapes():
    """{name: (q heads, KV heads, head_dim)} of the models in radixserve/testing/configs."""
    shapes = {}
    for name in ("qwen3-8b", "qwen3-0.6b"):
        with open(os.path.join(ROOT, "radixserve", "testing", "configs", f"{name}.json")) as f:
            cfg = json.load(f)
        shapes[name] = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    return shapes


def path_variants(kernels_split, kernels_prefix):
    """(label, run(batch, o), must-read bytes by kernel name) of each path measured."""
    full = lambda b: kv_bytes(b, grouped=False)  # noqa: E731
    return [
        ("plain, split + merge", lambda b, o: run_plain(kernels_split, b, o), {"_decode_split_kernel": full}),
        (
            "grouped, split, exact bounds",
            lambda b, o: run_grouped(kernels_prefix, b, o),
            {"_prefix_kernel": prefix_bytes, "_suffix_split_kernel": own_bytes},
        ),
        (
            "grouped, split, padded",
            lambda b, o: run_grouped(kernels_prefix, b["padded"], o),
            {"_prefix_kernel": prefix_bytes, "_suffix_split_kernel": own_bytes},
        ),
    ]


def measure(label, run, bytes_by_kernel, layers, copy_bw):
    """Per-layer time of run over the layer copies (one CUDA graph), and each kernel's time and bandwidth share."""
    from bench.gpu_timing import capture, kernel_times, replay_seconds

    outs = [torch.empty_like(b["q"]) for b in layers]
    graph = capture(lambda: [run(b, o) for b, o in zip(layers, outs)])
    per_layer = replay_seconds(graph) / len(layers)
    kernels = {}
    for name, (seconds, calls) in kernel_times(graph.replay).items():
        must = bytes_by_kernel.get(name)
        per_layer_calls = calls / len(layers)
        # A kernel launched more than once a layer reads its bytes over all of its calls.
        share = must(layers[0]) / (seconds * per_layer_calls) / copy_bw if must else None
        kernels[name] = (seconds, per_layer_calls, share)
    return per_layer, kernels  # the graph and its outputs are freed here, with the frame


def bandwidth(shapes, geometries, layers, copy_bw, lines, paths=None):
    from kernels import shared_prefix_attention, triton_attention

    g = torch.Generator().manual_seed(0)
    lines += [
        "",
        "| shape | geometry | path | us per layer | kernel: us per call, share of copy bandwidth "
        "for its must-read bytes |",
        "|---|---|---|---|---|",
    ]
    results = {}
    for (shape, (hq, hkv, d)), (geo, (groups, members, prefix, own)) in itertools.product(
        shapes.items(), geometries.items()
    ):
        b = make_grouped_batch([(prefix, [own] * members)] * groups, [], hq, hkv, d, torch.bfloat16, "cuda", g)
        copies = layer_copies(b, layers)
        for c in copies:
            c["padded"] = graph_padded(c, CONTEXT_LEN, max(1, c["q"].shape[0] // 2))
        for label, run, must in path_variants(triton_attention, shared_prefix_attention):
            if paths and label not in paths:
                continue
            per_layer, kernels = measure(label, run, must, copies, copy_bw)
            results[shape, geo, label] = (per_layer, kernels)
            detail = "; ".join(
                f"{n} {s * 1e6:.1f}" + (f" ({share:.0%})" if share else "") + (f" x{calls:g}" if calls != 1 else "")
                for n, (s, calls, share) in kernels.items()
            )
            lines.append(f"| {shape} | {geo} | {label} | {per_layer * 1e6:.1f} | {detail} |")
            print(f"{shape:<11} {geo:<4} {label:<30} {per_layer * 1e6:8.1f} us/layer   {detail}", flush=True)
        if not paths:
            floor = floors(copies, copy_bw)
            lines.append(f"| {shape} | {geo} | read-only floor (bench/kv_read_floor.py) | - | {floor} |")
            print(f"{shape:<11} {geo:<4} {'read-only floor':<30} {floor}", flush=True)
        del b, copies
        torch.cuda.empty_cache()
    return results


def lone_decodes(shapes, layers, copy_bw, lines):
    """--lone (the module's docstring): us a layer of each path, as decode graphs run them."""
    from kernels import shared_prefix_attention, triton_attention

    g = torch.Generator().manual_seed(0)
    lines += ["", "| shape | own tokens | decodes in no group | plain | grouped | grouped, lone as groups of one |"]
    lines += ["|---|---|---|---|---|---|"]
    paths = [
        lambda b, o: run_plain(triton_attention, b, o),
        lambda b, o: run_grouped(shared_prefix_attention, b["padded"], o),
        lambda b, o: run_grouped(shared_prefix_attention, b["lone"], o),
    ]
    # (own tokens a member, lone decodes): serving's questions, and members with long own histories (multi-turn).
    cases = [(130, 0), (130, 1), (130, 2), (2048, 0)]
    for (shape, (hq, hkv, d)), (own, lone) in itertools.product(shapes.items(), cases):
        b = make_grouped_batch([(2048, [own] * 4)] * 8, [2048 + own] * lone, hq, hkv, d, torch.bfloat16, "cuda", g)
        copies = layer_copies(b, layers)
        table = max(1, b["q"].shape[0] // 2)
        for c in copies:
            c["padded"] = graph_padded(c, CONTEXT_LEN, table)
            c["lone"] = graph_padded(with_lone_groups(c, 512), CONTEXT_LEN, table)
        times = [measure("", run, {}, copies, copy_bw)[0] * 1e6 for run in paths]
        lines.append(f"| {shape} | {own} | {lone} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
        print(f"{shape:<11} own {own} lone {lone}: plain / grouped / lone groups "
              + " / ".join(f"{t:.1f}" for t in times) + " us/layer", flush=True)  # fmt: skip
        del b, copies
        torch.cuda.empty_cache()


def floors(copies, copy_bw):
    """The read-only floor of the prefix kernel's gathers (sliced as a decode graph slices them) and of the suffix
    kernel's: what no kernel reading them so can beat (bench/kv_read_floor.py), with its share of the copy bandwidth;
    and the ceiling of any kernel's share for that many bytes, a contiguous read of them."""
    from bench.kv_read_floor import ceiling_seconds, floor_seconds

    b = copies[0]
    out = []
    for which, must, n in (("prefix", prefix_bytes(b), step_slices(b)), ("suffix", own_bytes(b), 1)):
        seconds, config = floor_seconds(copies, which, n)
        out.append(f"{which} gathers {seconds * 1e6:.1f} ({must / seconds / copy_bw:.0%}) at {config}")
        seconds, config = ceiling_seconds(must)
        out.append(f"{which} bytes read contiguously {seconds * 1e6:.1f} ({must / seconds / copy_bw:.0%}) at {config}")
    return "; ".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="CPU tensors, TRITON_INTERPRET=1, small shapes")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--no-checks", action="store_true", help="bandwidth only")
    parser.add_argument("--quick-checks", action="store_true", help="GPU checks in bf16 and fp32, three shapes")
    parser.add_argument("--lone", action="store_true", help="only the serving geometry with lone decodes (docstring)")
    parser.add_argument("--layers", type=int, default=6, help="KV cache copies a timed step runs over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args()
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--interpret needs TRITON_INTERPRET=1 in the environment (triton reads it at import)")
    DEVICE[0] = "cpu" if args.interpret else "cuda"
    from kernels import reference, shared_prefix_attention, triton_attention

    g = torch.Generator().manual_seed(args.seed)
    check_rows, lines = [], []
    failed = []
    started = time.time()
    if not args.no_checks:
        # The last split case: the step's slice count (3) as the group table carries it, below the grid's bound (8).
        three_slices = torch.tensor([3], dtype=torch.int32, device=DEVICE[0])
        paths = {
            shared_prefix_attention: [
                dict(num_suffix_splits=3, num_prefix_splits=4),
                dict(num_suffix_splits=1, num_prefix_splits=3, fuse_merge=False),
                dict(num_suffix_splits=1, num_prefix_splits=8, prefix_splits=three_slices),
                # Every slice of the grid's 8 live (where the prefix has that many tiles): the fused fold's loop
                # past its unrolled slices (shared_prefix_attention.FOLD_UNROLL_SLICES).
                dict(num_suffix_splits=1, num_prefix_splits=8),
            ],
        }
        print(f"{'dtype':<9} {'shape':<15} {'case':<70} {'vs plain':>10} {'vs ref':>10} {'tol':>8}")
        run_checks(check_rows, paths, triton_attention, reference, args.interpret, g, args.quick_checks)
        failed = [r for r in check_rows if not r[-1]]
        print(f"checks: {len(check_rows) - len(failed)}/{len(check_rows)} pass in {time.time() - started:.0f} s")
    if not args.interpret and not args.check_only:
        from bench.gpu_timing import copy_bandwidth

        copy_bw = copy_bandwidth()
        lines += [f"Copy bandwidth (2 GiB device-to-device, read + written): {copy_bw / 1e9:.0f} GB/s."]
        print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
        if args.lone:
            lone_decodes(attention_shapes(), args.layers, copy_bw, lines)
        else:
            bandwidth(attention_shapes(), GEOMETRIES, args.layers, copy_bw, lines)
    if args.out:
        header = [
            "# Shared-prefix decode attention: correctness and bandwidth",
            "",
            f"`python bench/shared_prefix_kernel_bench.py {' '.join(sys.argv[1:])}` on "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}.",
            "",
        ]
        checks = [
            "",
            "## Correctness (relative L2 error, outputs in fp32)",
            "",
            "| dtype | shape | case | group sizes | vs plain kernel | vs fp32 reference | tol | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        checks += [
            f"| {dt} | {shape} | {case} | {sizes} | {err:.2e} | {'-' if r is None else f'{r:.2e}'} | {tol:.0e} "
            f"| {'ok' if ok else 'FAIL'} |"
            for dt, shape, case, sizes, err, r, tol, ok in check_rows
        ]
        with open(args.out, "w") as f:
            f.write("\n".join(header + lines + checks) + "\n")
    print("ALL PASS" if not failed else f"{len(failed)} FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
