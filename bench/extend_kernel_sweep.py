"""The extend (prefill) attention kernel over block configs, at the geometries serving meets (GPU).

    python -m bench.extend_kernel_sweep [--only burst06 hit8b ...] > bench/results/extend-gqa-h100/sweep.txt

Geometries, Qwen3-0.6B (16 query heads over 8 KV heads) and Qwen3-8B (32 over 8) shapes, head_dim 128, bf16, each
request's context at scattered slots (bench/paged_batch.py): issue 27's burst of cache hits (102 requests of 20 new
tokens over 1,520 cached), shorter chunks (4 new tokens), a lone cache hit (128 over 1,024), W1's chunks (16 x 128 over
1,024), cold prompts of 1,152 and 8,192 tokens, a chunk of 2,048 over 8,192 cached and 4 prompts of 2,048. For each:
the default config (kernels/triton_attention.extend_config, its split count from extend_num_splits), the default
with the keys split in 1, 2, 4 and 8, and every config of CONFIGS, median of
bench.kernel_bench.median_ms, the causal FLOP rate, and the largest difference from the default's output."""

from __future__ import annotations

import argparse

import torch

from bench.kernel_bench import extend_flops, median_ms
from bench.paged_batch import make_paged_batch
from kernels import triton_attention

# (BLOCK_M query rows, BLOCK_N keys, warps, stages)
CONFIGS = [
    (16, 64, 4, 3),
    (32, 64, 2, 3),
    (32, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
    (64, 128, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 3),
]
# name: (query heads, KV heads, prefix lengths, extend lengths)
GEOMETRIES = {
    "burst06 102x(1520+20)": (16, 8, [1520] * 102, [20] * 102),
    "burst8b 102x(1520+20)": (32, 8, [1520] * 102, [20] * 102),
    "short06 128x(1520+4)": (16, 8, [1520] * 128, [4] * 128),
    "short8b 128x(1520+4)": (32, 8, [1520] * 128, [4] * 128),
    "hit06 1x(1024+128)": (16, 8, [1024], [128]),
    "hit8b 1x(1024+128)": (32, 8, [1024], [128]),
    "w1c06 16x(1024+128)": (16, 8, [1024] * 16, [128] * 16),
    "w1c8b 16x(1024+128)": (32, 8, [1024] * 16, [128] * 16),
    "cold06 1x1152": (16, 8, [0], [1152]),
    "cold8b 1x1152": (32, 8, [0], [1152]),
    "long06 1x8192": (16, 8, [0], [8192]),
    "long8b 1x8192": (32, 8, [0], [8192]),
    "chunk8b 1x(8192+2048)": (32, 8, [8192], [2048]),
    "mix8b 4x2048": (32, 8, [0] * 4, [2048] * 4),
}


def sweep(name: str, hq: int, hkv: int, prefix_lens: list[int], extend_lens: list[int], g) -> None:
    b = make_paged_batch(torch, prefix_lens, extend_lens, hq, hkv, 128, torch.bfloat16, "cuda", g, spare_slots=0)
    out = torch.empty_like(b["q"])
    args = (
        *(b[key] for key in ("q", "k", "v")),
        out,
        *(b[key] for key in ("k_cache", "v_cache", "req_to_token", "req_pool_indices", "prefix_lens")),
        *(b[key] for key in ("extend_lens", "extend_start_loc")),
        128**-0.5,
        max(extend_lens),
    )
    flops = extend_flops(prefix_lens, extend_lens, hq, 128)
    triton_attention.extend_attention(*args)
    reference = out.clone()
    rows = []
    splits = [(f"default, {k} split{'s' * (k > 1)}", dict(num_splits=k)) for k in (1, 2, 4, 8)]
    for label, cfg in [("default", None), *splits] + [
        (f"M{m} N{n} w{w} s{s}", dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)) for m, n, w, s in CONFIGS
    ]:
        run = lambda: triton_attention.extend_attention(*args, config=cfg)  # noqa: E731
        out.fill_(float("nan"))
        run()
        err = (out.float() - reference.float()).abs().max().item()
        rows.append((label, median_ms(run), err))
    best = min(ms for _, ms, _ in rows)
    for label, ms, err in rows:
        mark = " <== best" if ms == best else ""
        rate = flops / ms / 1e9
        print(f"{name:24s} {label:16s} {ms * 1e3:8.1f} us {rate:6.0f} TFLOP/s err {err:.2g}{mark}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="geometries whose name contains one of these")
    ns = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    for name, (hq, hkv, prefix_lens, extend_lens) in GEOMETRIES.items():
        if not ns.only or any(part in name for part in ns.only):
            sweep(name, hq, hkv, prefix_lens, extend_lens, g)


if __name__ == "__main__":
    main()
