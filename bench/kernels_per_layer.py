"""Kernels per decoder layer in one decode step, and the step's time, with the layer fusions on and off (GPU).

    python -m bench.kernels_per_layer --configs qwen3-8b qwen3-0.6b --out bench/results/kernels-per-layer-h100.md

A Qwen3 model of the given config's shape with random weights (radixserve.loader.load_dummy), bf16, its KV cache in
scattered slots; decode steps of three batches: one request (1,024 tokens of context), 16 requests, and W1's 8
shared prefixes of 1,024 tokens x 16 members with 128 own tokens each, as serving runs it (shared-prefix attention
on, the group table padded as a decode CUDA graph has it). For each option set: the device kernels one decoder layer
launches (torch profiler over one eager call of layer 1), the whole step (forward + logits) as a CUDA graph replay,
and its logits against the unfused step's (all fusions off, cuBLAS split-K allowed). Writes no result unless --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import torch

import kernels
from bench.gpu_timing import capture, kernel_times, launched_kernels, replay_seconds
from radixserve.model_config import ModelConfig
from radixserve.forward_context import DecodeGroups, ForwardContext, pack_decode_groups, set_forward_context
from radixserve.layers.linear import set_gemm_split_k
from radixserve.loader import load_dummy
from radixserve.models.registry import model_class
from radixserve.protocol import PrefixGroups, pack_i32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNFUSED = dict(fused_qkv=0, gate_up_silu_max_rows=0, skinny_linear_max_rows=0, pdl=0)
# name: (kernel options, cuBLAS split-K allowed)
OPTION_SETS = {
    "unfused (before)": (UNFUSED, True),
    "fused, no split-K": ({}, False),
    "fused, no split-K, gate/up unfused": (dict(gate_up_silu_max_rows=0), False),
    "fused, no split-K, gate/up fused to 128 rows": (dict(gate_up_silu_max_rows=128), False),
    "Q/K fused only": (dict(fused_qkv=1, gate_up_silu_max_rows=0, skinny_linear_max_rows=0), True),
    "Q/K fused, gate/up fused to 16 rows": (
        dict(fused_qkv=1, gate_up_silu_max_rows=16, skinny_linear_max_rows=0),
        True,
    ),
    "serving's defaults (+ skinny projections)": ({}, True),
    "serving's defaults, PDL off": (dict(pdl=0), True),
    "serving's defaults, no prefetch": (dict(pdl_prefetch=0), True),
    "serving's defaults, norms apart": (dict(norms_in_projections=0), True),
    "serving's defaults, Q/K/V prep apart": (dict(qkv_in_decode_max_rows=0), True),
}
BATCHES = {"bs1": (1, 0, 1024), "bs16": (16, 0, 1024), "W1": (128, 1024, 128)}  # requests, shared prefix, own
CONTEXT_LEN = 40960


def build_model(config: str, num_layers: int | None = None, device="cuda", dtype=torch.bfloat16):
    with open(os.path.join(ROOT, "radixserve", "testing", "configs", f"{config}.json")) as f:
        raw = json.load(f)
    if num_layers:
        raw["num_hidden_layers"] = num_layers
    cfg = ModelConfig.from_dict(raw)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg)
    finally:
        torch.set_default_dtype(old)
    load_dummy(model, 0)
    model.fold_norm_weights()  # as the model runner does: the norms' weights in the projections after them
    return model.eval(), cfg


def decode_step(model, cfg, requests: int, shared: int, own: int, seed=0, device="cuda"):
    """(ForwardContext, input_ids, positions) of one decode step: `requests` requests of `own` tokens each after a
    prefix of `shared` tokens shared by groups of 16 (0: nothing shared), every slot scattered; binds each layer's
    KV cache (random contents) to the model."""
    rng = np.random.default_rng(seed)
    members = 16 if shared else 1
    groups = requests // members if shared else 0
    slots_needed = groups * shared + requests * own + 1
    perm = rng.permutation(np.arange(1, slots_needed + 1)).astype(np.int32)  # slot 0 is padding's
    context = shared + own
    table = torch.zeros(requests + 1, CONTEXT_LEN, dtype=torch.int32)
    cursor = 0
    prefixes = []
    for _ in range(groups):
        prefixes.append(perm[cursor : cursor + shared])
        cursor += shared
    for r in range(requests):
        if shared:
            table[r, :shared] = torch.from_numpy(prefixes[r // members])
        table[r, shared:context] = torch.from_numpy(perm[cursor : cursor + own])
        cursor += own
    kv_heads = cfg.kv_heads_per_rank(1)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in model.model.layers:
        shape = (slots_needed + 1, kv_heads, cfg.head_dim)
        layer.self_attn.attn.k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        layer.self_attn.attn.v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((requests,), context, dtype=torch.int32)
    decode_groups = None
    if shared:
        prefix_groups = PrefixGroups(
            pack_i32([shared] * groups),
            pack_i32([m * members for m in range(groups)]),
            pack_i32([r // members for r in range(requests)]),
            pack_i32([shared] * requests),
        )
        slices = functools.partial(
            kernels.prefix_slices,
            num_q_heads=cfg.num_heads,
            num_kv_heads=kv_heads,
            dtype=torch.bfloat16,
            device=torch.device(device),
        )
        flat, _, _ = pack_decode_groups(prefix_groups, 0, max(1, requests // 2), requests, slices)
        decode_groups = DecodeGroups.view(
            torch.from_numpy(flat).to(device),
            max(1, requests // 2),
            requests,
            CONTEXT_LEN,
            requests,
            kernels.prefix_slices_bound(CONTEXT_LEN),
        )
    ints = lambda t: t.to(device)  # noqa: E731
    ctx = ForwardContext(
        num_extend_reqs=0,
        num_extend_tokens=0,
        req_to_token=ints(table),
        req_pool_indices=ints(torch.arange(requests, dtype=torch.int32)),
        prefix_lens=ints(seq_lens - 1),
        extend_lens=ints(torch.ones(requests, dtype=torch.int32)),
        extend_start_loc=ints(torch.arange(requests, dtype=torch.int32)),
        seq_lens=ints(seq_lens),
        out_cache_loc=ints(table[torch.arange(requests), context - 1].contiguous()),
        max_extend_len=0,
        max_seq_len=CONTEXT_LEN,
        decode_groups=decode_groups,
    )
    input_ids = torch.randint(0, cfg.vocab_size, (requests,), generator=torch.Generator().manual_seed(seed)).to(device)
    positions = torch.full((requests,), context - 1, dtype=torch.int64, device=device)
    return ctx, input_ids, positions


def layer_kernels(model, cfg, ctx, requests: int) -> list[str]:
    """The device kernels one call of decoder layer 1 launches, fed what layer 0 gives it (a residual to add, or with
    the norms in the projections a norm left to the QKV kernel), as every layer but the first is."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(requests, cfg.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
    positions = torch.full((requests,), 5, dtype=torch.int64, device="cuda")
    set_forward_context(ctx)
    try:
        with torch.inference_mode():
            hidden, residual = model.model.layers[0](positions, hidden, None)
            return launched_kernels(lambda: model.model.layers[1](positions, hidden, residual))
    finally:
        set_forward_context(None)


def step(model, ctx, input_ids, positions, breakdown=False):
    set_forward_context(ctx)
    try:
        with torch.inference_mode():
            graph = capture(lambda: model.compute_logits(model(input_ids, positions)))
            seconds = replay_seconds(graph, reps=20)
            if breakdown:  # each kernel's device time in one step, largest total first
                times = kernel_times(graph.replay)
                rows = sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1])
                print(f"      step kernels: {sum(t * n for t, n in times.values()) * 1e6:.0f} us of device time")
                for name, (t, n) in rows[:14]:
                    print(f"      {t * n * 1e6:8.1f} us  {n:5.0f} x {t * 1e6:6.2f} us  {name[:70]}")
            graph.replay()
            torch.cuda.synchronize()
            logits = model.compute_logits(model(input_ids, positions)).float()
    finally:
        set_forward_context(None)
    del graph
    return seconds, logits


DEFAULTS = dict(kernels.OPTIONS)


def apply(options, split_k):
    """The option set's kernel options over the defaults, and cuBLAS split-K allowed or not."""
    kernels.configure(**{**DEFAULTS, **options})
    set_gemm_split_k(split_k)


def run(configs, batches, option_sets, lines, breakdown=False):
    results = {}
    for config in configs:
        model, cfg = build_model(config)
        for batch in batches:
            requests, shared, own = BATCHES[batch]
            ctx, input_ids, positions = decode_step(model, cfg, requests, shared, own)
            baseline = None
            for name in option_sets:
                options, split_k = OPTION_SETS[name]
                apply(options, split_k)
                names = layer_kernels(model, cfg, ctx, requests)
                seconds, logits = step(model, ctx, input_ids, positions, breakdown)
                if baseline is None:
                    baseline = logits
                err = ((logits - baseline).norm() / baseline.norm()).item()
                agree = (logits.argmax(-1) == baseline.argmax(-1)).float().mean().item()
                results[config, batch, name] = dict(
                    kernels=len(names), names=names, step_ms=seconds * 1e3, logits_rel_err=err, argmax_agree=agree
                )
                lines.append(
                    f"| {config} | {batch} | {name} | {len(names)} | {seconds * 1e3:.3f} | {err:.1e} | {agree:.0%} |"
                )
                print(
                    f"{config:<11} {batch:<5} {name:<44} {len(names):3d} kernels/layer  step {seconds * 1e3:7.3f} ms"
                    f"  logits vs unfused {err:.1e}, argmax {agree:.0%}",
                    flush=True,
                )
                print("    " + ", ".join(n[:60] for n in names), flush=True)
            del ctx
        apply({}, True)
        del model
        torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["qwen3-8b", "qwen3-0.6b"])
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--option-sets", nargs="+", default=list(OPTION_SETS), choices=list(OPTION_SETS))
    parser.add_argument("--breakdown", action="store_true", help="print each kernel's device time in the step")
    parser.add_argument("--out", help="markdown report")
    parser.add_argument("--json-out")
    ns = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    lines = [
        f"# Kernels per decoder layer in a decode step: {torch.cuda.get_device_name()}",
        "",
        f"`python -m bench.kernels_per_layer {' '.join(sys.argv[1:])}`, torch {torch.__version__}. "
        "Step: forward + logits as one CUDA graph replay (median of 20).",
        "",
        "| config | batch | options | kernels per layer | step ms | logits rel err vs unfused | argmax agree |",
        "|---|---|---|---|---|---|---|",
    ]
    if ns.option_sets[0] != "unfused (before)":
        ns.option_sets.insert(0, "unfused (before)")  # the baseline the others are compared with
    results = run(ns.configs, ns.batches, ns.option_sets, lines, ns.breakdown)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({" / ".join(k): v for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
