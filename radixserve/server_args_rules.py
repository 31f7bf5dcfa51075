"""The rules of ServerArgs' flags (radixserve/config.py), applied as it is made: each value in its range, the
combinations refused (several data-parallel replicas across nodes, layerwise offload without a host tier), and the
defaults that follow other flags (the device, the chunk size, the tokenizer workers). The multi-node rules live with
the links (radixserve/runtime/node_link.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.config import ServerArgs


def apply_rules(args: ServerArgs) -> None:
    """Checks every flag's value and the combinations refused, and resolves the defaults that follow other flags
    (the device, the chunk size, the tokenizer workers). Raises ValueError with the flag's name."""
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.dp_size > 1 and args.nnodes > 1:
        raise ValueError(
            "--dp-size > 1 with --nnodes > 1 is not supported: run one server per node group and "
            "put sglang-router in front"
        )
    if args.nnodes > 1 or args.node_rank != 0:
        from radixserve.runtime.node_link import check_multi_node_args  # the multi-node rules live with the links

        check_multi_node_args(args)
    if not 0.0 < args.mem_fraction_static < 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.hicache_size < 0:
        raise ValueError(f"--hicache-size must be >= 0 (GB; 0 = off), got {args.hicache_size}")
    if args.enable_layerwise_offload:
        _check_layerwise_offload(args)
    if args.max_running_requests < 1:
        raise ValueError(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.max_total_tokens is not None and args.max_total_tokens < 2:
        raise ValueError(f"--max-total-tokens must be >= 2, got {args.max_total_tokens}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size == 0:
        raise ValueError("--chunked-prefill-size must be positive or -1 (no chunking)")
    if args.max_pinned_tokens is not None and args.max_pinned_tokens < 0:
        raise ValueError(f"--max-pinned-tokens must be >= 0, got {args.max_pinned_tokens}")
    if args.pin_prompts is not None and not Path(args.pin_prompts).is_file():
        raise ValueError(f"--pin-prompts: no such file {args.pin_prompts}")
    if args.cpu_logits_block_mib < 0:
        raise ValueError(f"--cpu-logits-block-mib must be >= 0, got {args.cpu_logits_block_mib}")
    if args.shared_prefix_min_tokens < 1:
        raise ValueError(f"--shared-prefix-min-tokens must be >= 1, got {args.shared_prefix_min_tokens}")
    if args.lone_decode_min_tokens < 0:
        raise ValueError(f"--lone-decode-min-tokens must be >= 0 (0: never), got {args.lone_decode_min_tokens}")
    if (saved := args.mixed_step_groups_min_saved_tokens) < 0:
        raise ValueError(f"--mixed-step-groups-min-saved-tokens must be >= 0 (0: always), got {saved}")
    if args.max_sequences_per_request < 1:
        raise ValueError(f"--max-sequences-per-request must be >= 1, got {args.max_sequences_per_request}")
    if args.tokenizer_workers is None:
        args.tokenizer_workers = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        )
    if args.tokenizer_workers < 1:
        raise ValueError(f"--tokenizer-workers must be >= 1, got {args.tokenizer_workers}")
    if args.inline_tokenize_chars < 0:
        raise ValueError(f"--inline-tokenize-chars must be >= 0, got {args.inline_tokenize_chars}")
    if args.chat_segment_cache_mib < 0:
        raise ValueError(f"--chat-segment-cache-mib must be >= 0, got {args.chat_segment_cache_mib}")
    if args.responses_store_size < 0 or not args.responses_store_ttl > 0:
        raise ValueError(
            "--responses-store-size must be >= 0 and --responses-store-ttl > 0, got "
            f"{args.responses_store_size} and {args.responses_store_ttl}"
        )
    if args.max_header_bytes < 1024:
        raise ValueError(f"--max-header-bytes must be >= 1024, got {args.max_header_bytes}")
    if args.kv_events_block_size is not None and args.kv_events_block_size < 0:
        raise ValueError(f"--kv-events-block-size must be >= 0 (0: no KV events), got {args.kv_events_block_size}")
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port out of range: {args.port}")
    if args.device == "auto":
        import torch  # only where the device is still open: the launcher resolves it before the children start

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = 8192 if args.device == "cuda" else 512
    if args.spin_wait_ms is None:
        args.spin_wait_ms = 50.0 if args.device == "cuda" else 0.0
    if args.spin_wait_ms < 0:
        raise ValueError(f"--spin-wait-ms must be >= 0 (0: no spinning), got {args.spin_wait_ms}")
    if args.read_back_wait_ms is None:
        args.read_back_wait_ms = 3.0 if args.device == "cuda" else 0.0
    if args.read_back_wait_ms < 0:
        raise ValueError(f"--read-back-wait-ms must be >= 0 (0: never wait), got {args.read_back_wait_ms}")
    if args.layerwise_offload_chunk_size is None:
        args.layerwise_offload_chunk_size = args.chunked_prefill_size if args.chunked_prefill_size > 0 else 8192


def _check_layerwise_offload(args: ServerArgs) -> None:
    if args.hicache_size <= 0:
        raise ValueError(
            "--enable-layerwise-offload keeps long requests' KV in host memory: give its size with --hicache-size GB"
        )
    if args.tp_size > 1 or args.nnodes > 1:
        raise ValueError("--enable-layerwise-offload runs on one GPU (--tp-size 1) for now")
    if args.layerwise_offload_ring_size < 2:
        raise ValueError(f"--layerwise-offload-ring-size must be >= 2, got {args.layerwise_offload_ring_size}")
    for name in ("layerwise_offload_chunk_size", "layerwise_offload_buffer_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.layerwise_offload_units_per_step < 0:
        raise ValueError(
            f"--layerwise-offload-units-per-step must be >= 0, got {args.layerwise_offload_units_per_step}"
        )
