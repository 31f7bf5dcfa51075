"""The kernel and attention flags of the server (ServerArgs in config.py, whose base class this is): which kernels a
step launches, how, and when decodes read a shared prefix together. Apart from config.py so that each file holds one
family of flags; launch.py's --help lists them under their own heading."""

from __future__ import annotations

from dataclasses import dataclass, field


def flag(default, help: str, **kw):
    """A ServerArgs field: its default, and its --help text and any other argparse options."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class KernelArgs:
    kernel_backend: str = flag(
        "auto", "auto|triton|reference (torch twins, for ablations).", choices=["auto", "triton", "reference"]
    )
    disable_cuda_graph: bool = flag(False, "Run decode steps eagerly instead of replaying captured CUDA graphs.")
    disable_pinned_staging: bool = flag(
        False,
        "Copy each step's index arrays to the GPU from pageable memory (waits "
        "for the stream) instead of through pinned buffers (ablation).",
    )
    cpu_logits_block_mib: int = flag(
        8,
        "CPU workers: logits into a buffer kept across steps and sampled in row blocks of at most this many MiB, so "
        "that memory stays flat (0: the whole batch at once, fresh tensors every step).",
    )
    cuda_graph_max_bs: int = flag(256, "Largest decode batch captured in a CUDA graph (larger ones run eagerly).")
    disable_prefill_cuda_graph: bool = flag(
        False,
        "Run prefill and mixed steps eagerly instead of replaying piecewise CUDA graphs (attention eager between "
        "captured pieces; radixserve/worker/prefill_cuda_graph.py).",
    )
    # 4096: a burst of 128 cache hits of 20 new tokens admits ~2,100 in one step, which at 2,048 ran eagerly, ~21 ms
    # of host launches against ~11 as graphs (bench/results/extend-gqa-h100/prefill-graph-4096.md).
    prefill_cuda_graph_max_tokens: int = flag(
        4096, "Largest step (new tokens) that replays piecewise prefill CUDA graphs; larger steps run eagerly."
    )
    # On by default: a decode step measured faster with them on the H100 (Qwen3-0.6B batch 1 1.745 -> 1.462 ms, W1
    # 3.82 -> 3.26 ms; Qwen3-8B 6.95 -> 6.52 and 10.11 -> 9.30 ms: bench/results/kernels-h100-2026-11-24b/).
    disable_fused_layer_kernels: bool = flag(
        False,
        "Run Q/K norms, RoPE and the KV store as four kernels instead of one, the gate/up projection and "
        "SiLU-and-mul as two, and each decode layer's RMSNorms apart from the projections after them.",
    )
    gate_up_silu_max_rows: int = flag(
        16,
        "Largest batch (rows) whose gate/up projection runs as one kernel with SiLU-and-mul in its epilogue; larger "
        "ones use cuBLAS and a SiLU kernel (0: never).",
    )
    skinny_linear_max_rows: int = flag(
        16,
        "Largest batch (rows, at most 16) whose other projections run as one weight-streaming Triton kernel "
        "(kernels/triton_skinny_linear.py) instead of cuBLAS (0: never).",
    )
    disable_extend_key_split: bool = flag(
        False, "Never split a prefill chunk's keys over programs (done when its grid would leave most of the GPU idle)."
    )
    disable_pdl: bool = flag(
        False,
        "Launch every kernel only once the one before it has finished, instead of letting kernels built for it start "
        "beside their predecessor and wait only where they read its output (programmatic dependent launch, Hopper and "
        "later GPUs).",
    )
    # On by default since the H100 measured it faster end to end (W1 1.09x on Qwen3-8B and 1.24x on 0.6B, nothing
    # lost on unshared prompts) and as exact as the plain path on real weights (bench/results/h100-2026-11-23/).
    disable_shared_prefix_attention: bool = flag(
        False,
        "Decodes that share a cached prefix read its KV each on its own instead of once for the group (shared-prefix "
        "decode attention off).",
    )
    shared_prefix_min_tokens: int = flag(
        512,
        "Shortest shared prefix for which decodes read it together (the kernel "
        "breaks even at about 256 tokens and gains from 512 on an H100).",
    )
    # 512 since measured (bench/results/mixed-step-groups-h200.md, H200): a grouped layer with one such decode took
    # 112 us, 50 as a group of one; serving at 80 req/s, per token 3.3 -> 2.7 ms. forward_context.lone_decode_groups.
    lone_decode_min_tokens: int = flag(
        512, "In a step with groups, a decode in none this long or longer is read as a group of one (0: never)."
    )
    # A step with prompt chunks runs its attention eagerly and at serving loads is bound by the host, where the grouped
    # path costs more than the ~40K tokens' reads it spares (bench/results/mixed-step-groups-h200.md, H200: serving at
    # 80 req/s, TTFT p50 14.1 -> 11.5 ms, off 12.9). W1 and gsp spare more: forward_context.batch_decode_groups.
    mixed_step_groups_min_saved_tokens: int = flag(
        65536,
        "A step with prompt chunks reads its decodes' shared prefixes together only when that spares reading this "
        "many context tokens or more (0: always).",
    )
