"""The decode-sized projections of real model shapes: cuBLAS (torch's F.linear) against kernels/triton_skinny_linear.py
(GPU), per call and as a share of the copy bandwidth for the weight's bytes.

    python -m bench.skinny_linear_bench [--rows 1 4 16] [--sweep] [--out bench/results/skinny-linear-h100.md]

Each timing replays a CUDA graph of one call per layer over as many distinct weights as the model has layers, as a
decode step does (a weight read once per step, never found in L2), and divides by the layer count. --sweep times
the kernel's block and split settings on every shape and prints the best per shape.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from bench.gpu_timing import capture, copy_bandwidth, replay_seconds
from kernels import triton_skinny_linear

# name: (layers, {projection: (N, K)})
SHAPES = {
    "qwen3-0.6b": (28, {"qkv": (4096, 1024), "o": (1024, 2048), "down": (1024, 3072), "gate_up": (6144, 1024)}),
    "qwen3-8b": (36, {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}),
}
SWEEP = [
    dict(BLOCK_N=bn, num_stages=st, programs_per_sm=p)
    for bn, st, p in itertools.product((16, 32, 64), (3, 5), (1, 2, 4))
]


def per_call_seconds(fn, weights, x) -> float:
    graph = capture(lambda: [fn(x, w) for w in weights])
    seconds = replay_seconds(graph, reps=20) / len(weights)
    del graph
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out")
    ns = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    bandwidth = copy_bandwidth()
    lines = [
        f"# Decode-sized projections: cuBLAS against the skinny kernel, {torch.cuda.get_device_name()}",
        "",
        f"`python -m bench.skinny_linear_bench {' '.join(sys.argv[1:])}`, torch {torch.__version__}; copy "
        f"bandwidth {bandwidth / 1e9:.0f} GB/s (read + written). Share: weight bytes / time / copy bandwidth.",
        "",
        "| shape | projection | rows | cuBLAS us | share | skinny us | share | splits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, (layers, projections) in SHAPES.items():
        for name, (n, k) in projections.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
            nbytes = n * k * 2
            for rows in ns.rows:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0]).float()
                got = triton_skinny_linear.skinny_linear(x, weights[0]).float()
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (shape, name, rows, err)
                cublas = per_call_seconds(F.linear, weights, x)
                skinny = per_call_seconds(triton_skinny_linear.skinny_linear, weights, x)
                cfg = triton_skinny_linear.skinny_config(x.dtype, x.device)
                splits = triton_skinny_linear.num_splits(n, k, cfg, x.device)
                row = (
                    f"| {shape} | {name} | {rows} | {cublas * 1e6:.2f} | {nbytes / cublas / bandwidth:.0%} | "
                    f"{skinny * 1e6:.2f} | {nbytes / skinny / bandwidth:.0%} | {splits} |"
                )
                lines.append(row)
                print(row, flush=True)
                if ns.sweep and rows == ns.rows[0]:
                    timed = []
                    for cfg in SWEEP:
                        fn = lambda x, w, cfg=cfg: triton_skinny_linear.skinny_linear(x, w, config=cfg)  # noqa: E731
                        timed.append((per_call_seconds(fn, weights, x), cfg))
                    timed.sort(key=lambda t: t[0])
                    for seconds, cfg in timed[:3]:
                        print(
                            f"    sweep {shape} {name}: {seconds * 1e6:.2f} us ({nbytes / seconds / bandwidth:.0%}) "
                            f"{cfg}",
                            flush=True,
                        )
            del weights
            torch.cuda.empty_cache()
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
