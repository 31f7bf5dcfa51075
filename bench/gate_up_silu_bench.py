"""The fused gate/up projection + SiLU-and-mul (kernels/triton_mlp.py) against cuBLAS + the SiLU-and-mul kernel, by
row count, for the Qwen3-8B and Qwen3-0.6B MLP shapes, and a sweep of its tiles (GPU).

    python -m bench.gate_up_silu_bench [--sweep]

Times are CUDA-graph replays over 8 weight copies in turn (more than L2 holds, as a step's layers are), per call.
Prints, per shape, the largest row count at which the fused kernel wins: the value for
kernels.OPTIONS["gate_up_silu_max_rows"].
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench.gpu_timing import capture, copy_bandwidth, replay_seconds
from kernels import triton_elementwise, triton_mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIES = 8
SWEEP = [
    dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (32, 128, 4, 4),
        (16, 128, 4, 4),
        (64, 128, 4, 4),
        (32, 256, 4, 3),
        (32, 64, 4, 6),
        (64, 64, 4, 5),
        (32, 128, 8, 4),
        (64, 128, 8, 3),
    ]
]


def mlp_shape(config):
    with open(os.path.join(ROOT, "radixserve", "testing", "configs", f"{config}.json")) as f:
        cfg = json.load(f)
    return cfg["hidden_size"], cfg["intermediate_size"]


def time_per_call(fn, weights, x):
    graph = capture(lambda: [fn(x, w) for w in weights])
    return replay_seconds(graph, reps=20) / len(weights)


def unfused(x, w):
    return triton_elementwise.silu_and_mul(F.linear(x, w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also try the tiles in SWEEP at 1 and 16 rows")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ns = parser.parse_args()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for config in ("qwen3-8b", "qwen3-0.6b"):
        hidden, inter = mlp_shape(config)
        weights = [
            (torch.randn(2 * inter, hidden, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
            for _ in range(COPIES)
        ]
        weight_bytes = weights[0].numel() * 2
        if ns.sweep:
            for rows in (1, 16):
                x = torch.randn(rows, hidden, generator=gen, device="cuda").to(torch.bfloat16)
                for cfg in SWEEP:
                    try:
                        t = time_per_call(lambda x, w: triton_mlp.gate_up_silu(x, w, cfg), weights, x)
                    except Exception as exc:  # e.g. out of shared memory
                        print(f"{config} M{rows} {cfg}: {type(exc).__name__}")
                        continue
                    print(
                        f"{config} sweep M{rows} {cfg}: {t * 1e6:.1f} us, {weight_bytes / t / copy_bw:.0%} of copy "
                        f"bandwidth",
                        flush=True,
                    )
        best_rows, winning = 0, True
        for rows in sorted(ns.rows):
            x = torch.randn(rows, hidden, generator=gen, device="cuda").to(torch.bfloat16)
            fused = time_per_call(triton_mlp.gate_up_silu, weights, x)
            base = time_per_call(unfused, weights, x)
            err = (
                (triton_mlp.gate_up_silu(x, weights[0]).float() - unfused(x, weights[0]).float()).norm()
                / unfused(x, weights[0]).float().norm()
            ).item()
            winning = winning and fused < base
            best_rows = rows if winning else best_rows
            print(
                f"{config:<11} M{rows:<4} fused {fused * 1e6:7.1f} us ({weight_bytes / fused / copy_bw:4.0%})  "
                f"cuBLAS + silu_and_mul {base * 1e6:7.1f} us ({weight_bytes / base / copy_bw:4.0%})  "
                f"{base / fused:5.2f}x  rel err {err:.1e}",
                flush=True,
            )
        print(f"{config}: fused wins up to {best_rows} rows (the contiguous run from 1 row)", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
