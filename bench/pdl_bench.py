"""A decode step's time by which kernels launch with programmatic dependent launch (PDL), and by the prefix kernel's
programs per SM (GPU, Hopper or later).

    python -m bench.pdl_bench --out bench/results/pdl-h100.md

Qwen3-0.6B and -8B shapes with random weights, bf16, the batches of bench/kernels_per_layer.py (one request; W1's 8
shared prefixes x 16 members, padded as a decode graph has them), forward + logits as one CUDA graph, median of 20
replays; every variant twice, alternating, so that drift shows. Variants name the kernel kinds that launch with PDL
(kernels/triton_common.PDL_KINDS; "off": kernels.OPTIONS["pdl"] off) and, for W1, whether the prefix kernel keeps
one program per SM so that the suffix kernel can run beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import kernels
from bench import kernels_per_layer as kpl
from kernels import shared_prefix_attention as spa
from kernels import triton_common

ALL = {"norm", "qkv", "attention", "small linear", "linear"}
# name: (pdl on, kinds, prefix programs per SM; None: the policy's)
VARIANTS = {
    "off": (0, set(), 2),
    "all kinds, projections of any size": (1, ALL, 2),
    "attention": (1, {"attention"}, 2),
    "attention + norm + qkv": (1, {"attention", "norm", "qkv"}, 2),
    "projections only": (1, {"small linear", "linear"}, 2),
    "attention, prefix 1 per SM": (1, {"attention"}, 1),
    "serving's defaults": (1, set(triton_common.PDL_KINDS), None),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--batches", nargs="+", default=["bs1", "W1"])
    parser.add_argument("--out")
    ns = parser.parse_args()
    lines = [
        f"`python -m bench.pdl_bench {' '.join(sys.argv[1:])}` on {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}",
        "",
        "| config | batch | variant | step ms (median of both passes) | passes |",
        "|---|---|---|---|---|",
    ]
    defaults = (set(triton_common.PDL_KINDS), dict(spa.PREFIX_SPLITS))
    kpl.apply({}, True)
    for config in ns.configs:
        model, cfg = kpl.build_model(config)
        for batch in ns.batches:
            requests, shared, own = kpl.BATCHES[batch]
            times = {name: [] for name in VARIANTS}
            for _ in range(2):
                for name, (pdl, kinds, per_sm) in VARIANTS.items():
                    kernels.configure(pdl=pdl)
                    triton_common.PDL_KINDS.clear()
                    triton_common.PDL_KINDS.update(kinds)
                    spa.PREFIX_SPLITS.update(defaults[1])
                    if per_sm is not None:  # forced (the policy's is PREFIX_SPLITS's own, 2)
                        spa.PREFIX_SPLITS["programs_per_sm"] = per_sm
                    ctx, ids, positions = kpl.decode_step(model, cfg, requests, shared, own)
                    seconds, _ = kpl.step(model, ctx, ids, positions)
                    times[name].append(seconds * 1e3)
            for name, t in times.items():
                passes = ", ".join(f"{x:.3f}" for x in t)
                row = f"| {config} | {batch} | {name} | {statistics.median(t):.3f} | {passes} |"
                lines.append(row)
                print(row, flush=True)
        del model
        torch.cuda.empty_cache()
    kernels.configure(pdl=1)
    triton_common.PDL_KINDS.clear()
    triton_common.PDL_KINDS.update(defaults[0])
    spa.PREFIX_SPLITS.update(defaults[1])
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
