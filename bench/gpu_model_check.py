"""On the GPU: the model runner uses the Triton kernels and its greedy output matches the CPU reference run token
for token (tiny models, fp32), then a bf16 run for sanity. Prints a table; exits non-zero on a mismatch.

    python -m bench.gpu_model_check [--model-dirs DIR ...]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import kernels
from radixserve.engine import Engine
from radixserve.sampling import SamplingParams


def prompts(engine: Engine) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over",
        "Radix trees share prefixes because",
        "1 2 3 4 5 6 7 8",
        "A long shared system prompt " * 40 + "and a question?",
    ]
    return [engine.tokenizer.encode(t) for t in texts]


def run(model_dir: str, device: str, dtype: str, backend: str, cuda_graph: bool = True, tp_size: int = 1):
    with Engine(
        model_dir,
        device=device,
        dtype=dtype,
        kernel_backend=backend,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        disable_cuda_graph=not cuda_graph,
        cuda_graph_max_bs=32,
        tp_size=tp_size,
    ) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
        batch = prompts(engine) * 4  # repeated prompts: the second copies hit the radix cache
        start = time.perf_counter()
        outs = [r.token_ids for r in engine.generate(batch, params)]
        elapsed = time.perf_counter() - start
        assert engine.server_info()["kv_invariant_ok"]
    return outs, elapsed


def compare(model_dir, cpu, gpu, label, t_cpu, t_gpu) -> int:
    same = sum(a == b for a, b in zip(cpu, gpu))
    print(
        f"{model_dir}: fp32 greedy, {label} vs CPU reference: {same}/{len(cpu)} sequences identical "
        f"(cpu {t_cpu:.1f}s, gpu {t_gpu:.1f}s)"
    )
    for a, b in zip(cpu, gpu):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"  first divergence at token {first}: cpu {a[first : first + 5]} gpu {b[first : first + 5]}")
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dirs", nargs="+", required=True)
    parser.add_argument("--tp-size", type=int, default=1, help="GPU runs with this many ranks (NCCL)")
    ns = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    failures = 0
    for model_dir in ns.model_dirs:
        cpu, t_cpu = run(model_dir, "cpu", "float32", "reference")
        for graphs in (True, False):
            gpu, t_gpu = run(model_dir, "cuda", "float32", "triton", cuda_graph=graphs, tp_size=ns.tp_size)
            label = f"GPU Triton, TP={ns.tp_size} ({'CUDA graphs' if graphs else 'eager'})"
            failures += compare(model_dir, cpu, gpu, label, t_cpu, t_gpu)
        bf16, _ = run(model_dir, "cuda", "bfloat16", "triton", tp_size=ns.tp_size)
        agree = sum(x == y for a, b in zip(cpu, bf16) for x, y in zip(a, b)) / sum(len(a) for a in cpu)
        print(f"  bf16 Triton vs fp32 CPU: {agree:.1%} of tokens agree (informative; bf16 rounding flips near-ties)")
    print(f"kernel backend used on cuda: {kernels.get_backend()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
