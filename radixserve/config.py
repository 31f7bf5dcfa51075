"""Every server flag (ServerArgs): the kernel and attention ones in its base class (kernel_args.py), the rest here.
Their rules are in server_args_rules.py, the model shape read from an HF config.json (ModelConfig) in model_config.py.

torch is imported only inside the functions that need it: the HTTP process parses these flags too, and loading
torch there would cost it ~1 s of startup and hundreds of MB for nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.kernel_args import KernelArgs, flag
from radixserve.server_args_rules import apply_rules

if TYPE_CHECKING:
    import torch


@dataclass
class ServerArgs(KernelArgs):
    # Model and weights
    model: str | None = flag(None, "HF model directory (config.json + safetensors). Default: the SmolLM2 demo model.")
    tokenizer: str | None = flag(None, "Tokenizer directory (default: the model directory).")
    served_model_name: str | None = flag(None, "Model name reported by /v1/models (default: the directory name).")
    load_format: str = flag(
        "auto",
        "auto|safetensors|dummy (random weights from config.json alone).",
        choices=["auto", "safetensors", "dummy"],
    )
    dtype: str = flag(
        "auto",
        "auto|float32|float16|bfloat16 (auto: bf16 on GPU, fp32 on CPU).",
        choices=["auto", "float32", "float16", "bfloat16"],
    )
    device: str = flag("auto", "auto|cpu|cuda.", choices=["auto", "cpu", "cuda"])
    context_length: int | None = flag(None, "Override the model's max_position_embeddings.")
    seed: int = flag(0, "Seed for dummy weights and unseeded sampling.")
    # Parallelism
    tp_size: int = flag(1, "Tensor-parallel degree (one worker process per rank).")
    nnodes: int = flag(1, "Number of nodes for multi-node tensor parallelism.")
    node_rank: int = flag(0, "This node's rank among --nnodes.")
    dp_size: int = flag(
        1,
        "Data-parallel replicas: scheduler + --tp-size workers each, with its own radix cache, "
        "behind the one front end.",
    )
    load_balance_method: str = flag(
        "cache_aware",
        "How the front end picks a replica (--dp-size > 1): cache_aware (longest cached prefix, unless load is too "
        "uneven) | round_robin | shortest_queue.",
        choices=["cache_aware", "round_robin", "shortest_queue"],
    )
    base_gpu_id: int = flag(0, "First GPU to use; replica i's rank r runs on GPU base + i * tp_size + r.")
    dist_init_addr: str | None = flag(
        None,
        "host:port of the torch.distributed rendezvous (multi-node); node 0 "
        "also binds the next ports for its links to the other nodes.",
    )
    dist_timeout: float | None = flag(
        None,
        "Multi-node: seconds a node may take to join, and may go silent before "
        "the server stops (default 600 to join, 30 silent).",
    )
    dist_secret_file: str | None = flag(
        None,
        "Multi-node: file whose first line is the secret every node shares "
        "(else $RADIXSERVE_DIST_SECRET); links between nodes need it.",
    )
    # Memory
    max_total_tokens: int | None = flag(
        None, "KV cache size in tokens (default: from --mem-fraction-static on GPU, 16384 on CPU)."
    )
    mem_fraction_static: float = flag(0.85, "Fraction of GPU memory for weights + KV cache.")
    max_running_requests: int = flag(256, "Most requests decoding at once (rows of req_to_token).")
    hicache_size: float = flag(
        0.0,
        "GB of host memory per tensor-parallel rank for a second KV tier: prefixes "
        "evicted from the device pool are copied there and copied back on a later hit "
        "instead of being computed again (pinned memory on CUDA). 0 turns it off.",
    )
    # Contexts longer than the GPU KV pool (radixserve/worker/layerwise_offload.py, scheduler_service/long_context.py)
    enable_layerwise_offload: bool = flag(
        False,
        "Serve requests whose prompt + max_tokens exceed the GPU KV pool, up to --context-length, with their KV in "
        "the host pool of --hicache-size: the model runs them one layer at a time, streaming each layer's KV between "
        "host and GPU, in steps interleaved with the ordinary ones.",
    )
    layerwise_offload_chunk_size: int | None = flag(
        None, "Tokens of a long prompt per chunk of its layer-at-a-time prefill (default --chunked-prefill-size)."
    )
    layerwise_offload_ring_size: int = flag(
        2,
        "GPU buffers of one layer's KV each (>= 2): while one computes, the next layers' KV streams in from the host.",
    )
    layerwise_offload_buffer_tokens: int | None = flag(
        None,
        "Tokens each ring buffer holds (default the context length): long requests decode together when their "
        "contexts fit one buffer side by side.",
    )
    layerwise_offload_units_per_step: int = flag(
        4,
        "Bound on a long request's step, in units of one chunk (or one decode batch) through one layer: ordinary "
        "requests wait at most one such step between two of theirs. 0: a whole layer of a prefill, a whole decode "
        "token.",
    )
    # Scheduling
    chunked_prefill_size: int | None = flag(
        None, "Most new prompt tokens per step (default 8192 on GPU, 512 on CPU; -1 disables chunking)."
    )
    disable_mixed_batch: bool = flag(False, "Do not mix prefill chunks with decodes in one forward.")
    disable_overlap_schedule: bool = flag(
        False,
        "Build and send step N+1 only after step N's tokens are back "
        "(serial loop; by default N+1 is built while N runs).",
    )
    spin_wait_ms: float | None = flag(
        None,
        "After work, the scheduler, the workers and Engine's caller poll their sockets without sleeping for up to "
        "this long before they block, so a message is taken at once instead of after a wake-up (default 50 on "
        "GPU, 0 on CPU, where the cores are the model's; 0 disables).",
    )
    read_back_wait_ms: float | None = flag(
        None,
        "How long a worker waits for a prefill or mixed step's tokens to report them before it launches another such "
        "step (radixserve/worker/step_pipeline.py says why; default 3 on GPU, 0 on CPU; 0 disables).",
    )
    disable_incremental_decode_batch: bool = flag(
        False,
        "Rebuild every decode batch from its requests instead of advancing the last one's arrays while the running "
        "set stays the same (ablation, debugging).",
    )
    disable_radix_cache: bool = flag(False, "No prefix reuse (ablation).")
    schedule_policy: str = flag("lpm", "lpm (longest cached prefix first) | fcfs.", choices=["lpm", "fcfs"])
    max_wait_steps: int = flag(64, "A waiting request older than this many steps goes first (no starvation).")
    enable_priority_scheduling: bool = flag(
        False,
        "Admit waiting requests by their `priority` field, higher values first (SGLang's order), but one waiting more "
        "than --max-wait-steps steps before any fresher one (the aging bound). Without it a non-zero priority is "
        "refused with a 400, as vLLM does.",
    )
    init_new_token_ratio: float = flag(0.7, "Initial share of max_new_tokens reserved for decoding at admission.")
    min_new_token_ratio: float = flag(0.1, "Floor of that share as observed outputs let it shrink.")
    new_token_ratio_decay: float = flag(0.001, "How much the share shrinks per step without retraction.")
    # Cache control (pins: scheduler_service/cache_control.py; salts: the requests' cache_salt)
    radix_eviction_policy: str = flag(
        "lru",
        "Which unlocked cached prefixes go first when KV is needed: lru (least recently used) | lfu (fewest hits) | "
        "priority (lowest request priority, then LRU).",
        choices=["lru", "lfu", "priority"],
    )
    pin_prompts: str | None = flag(
        None,
        "JSON-lines file of prompts pinned at start-up, one object a line, as the body of POST /v1/cache/pin: "
        "messages | prompt | input_ids, optional ttl_seconds and cache_salt.",
    )
    max_pinned_tokens: int | None = flag(
        None,
        "Most KV tokens that pins may hold (a pin beyond it is a 409). Default: half the KV pool; 0 turns pinning off.",
    )
    require_cache_salt: bool = flag(
        False,
        "Refuse (400) generating and pinning requests without a cache_salt, so "
        "that no tenant shares cached KV with another by accident.",
    )
    # HTTP
    host: str = flag(
        "127.0.0.1",
        "Address to bind (loopback by default; python -m radixserve.dynamo: its "
        "request plane and system server, advertised to the frontend).",
    )
    port: int = flag(
        30000,
        "HTTP port (python -m radixserve.dynamo: its Dynamo system server's, for /health, "
        "/metrics and /engine/control/...).",
    )
    api_server_count: int | None = flag(
        None,
        "HTTP front-end processes (as vLLM's --api-server-count): each parses, tokenizes and streams on its own "
        "event loop, all on --port (the kernel spreads connections over them), one scheduler behind them. /metrics "
        "and stored /v1/responses are shared; --max-queued-requests and the chat segment cache are per process. "
        "Default: on a GPU one per 2 CPUs this process may use, at most 8; on the CPU device 1. "
        "launch.py only (Engine and the Dynamo worker are one front end).",
    )
    api_key: str | None = flag(
        None,
        "If set, every route but /health wants 'Authorization: Bearer <key>'. "
        "Visible in ps: prefer $RADIXSERVE_API_KEY or --api-key-file.",
    )
    api_key_file: str | None = flag(None, "Read the API key from this file (first line), instead of --api-key.")
    max_request_bytes: int = flag(8 * 1024 * 1024, "Largest accepted request body (413 above).")
    max_queued_requests: int = flag(
        4096,
        "Most sequences in flight before 503 + Retry-After (one request with "
        "more sequences than this by itself gets a 400); per HTTP process with --api-server-count > 1.",
    )
    max_sequences_per_request: int = flag(
        128, "Most sequences (prompts x n) in one request; more is a 400 (OpenAI's limit on n is 128)."
    )
    max_header_bytes: int = flag(64 * 1024, "Largest accepted request line + headers (431 above).")
    tokenizer_workers: int | None = flag(
        None,
        "Threads that tokenize prompts and render chat templates, off the HTTP event loop (a huge prompt does not "
        "stall other clients); they encode in parallel, outside the GIL. Default: one per CPU this process may use "
        "(in each HTTP process).",
    )
    chat_segment_cache_mib: int = flag(
        64,
        "MiB of token ids of chat prompt pieces (each message between the template's special tokens) kept by their "
        "text, so a repeated system prompt or earlier turn is not tokenized again.",
    )
    disable_chat_segment_cache: bool = flag(
        False, "Tokenize every chat prompt whole, as rendered, instead of per message with cached pieces (ablation)."
    )
    inline_tokenize_chars: int = flag(
        2048,
        "A chat prompt whose pieces are all cached but for at most this many new characters is tokenized on the HTTP "
        "event loop, not in the tokenizer pool (cheaper than the trip to a pool thread and back); 0: always the pool.",
    )
    allowed_origins: str | None = flag(
        None,
        "Comma-separated browser origins allowed to call the API (CORS), e.g. "
        "http://localhost:5173; '*' for any. Default: none (CORS off).",
    )
    allowed_hosts: str | None = flag(
        None,
        "Comma-separated extra Host names accepted without --api-key (the bound "
        "address and localhost always are; '*' for any). Blocks DNS rebinding.",
    )
    log_level: str = flag("info", "Logging level.")
    # Structured outputs and tool calls
    grammar_backend: str = flag(
        "xgrammar",
        "xgrammar|none: constrained decoding (response_format, regex, ebnf, "
        "tool_choice required/named); none refuses such requests with a 400.",
        choices=["xgrammar", "none"],
    )
    disable_grammar_string_unrolling: bool = flag(
        False,
        "Keep xgrammar's own EBNF for strings with a maxLength (slower token masks; radixserve/grammar_rewrites.py).",
    )
    tool_call_parser: str = flag(
        "auto",
        "Tool-call format of the model: auto (from the chat template) | qwen | qwen25 | qwen3 | hermes | llama3.",
        choices=["auto", "qwen", "qwen25", "qwen3", "hermes", "llama3"],
    )
    # Reasoning models and the Responses API (tokenizer_service/reasoning.py, routes_responses.py)
    reasoning_parser: str | None = flag(
        None,
        "Split the <think>...</think> block of a reasoning model from its answer: reasoning_content on "
        "/v1/chat/completions, a reasoning item on /v1/responses (qwen3 | deepseek-r1, the names vLLM and SGLang "
        "use). Default: none, the block stays in the content.",
        choices=["qwen3", "deepseek-r1"],
    )
    responses_store_size: int = flag(
        1024,
        "Most responses of /v1/responses kept for previous_response_id and GET per API key (the oldest go first; each "
        "holds its conversation's text and last token ids). 0 keeps none.",
    )
    responses_store_ttl: float = flag(3600.0, "Seconds a stored response of /v1/responses is kept.")
    # NVIDIA Dynamo backend (python -m radixserve.dynamo: radixserve/dynamo/; README "Scaling out")
    kv_events_block_size: int | None = flag(
        None,
        "Publish the radix tree's inserts and evictions as KV events of full blocks of this many tokens, chained by "
        "parent, for Dynamo's KV router (and register it as the model's KV block size). Default: 16 under python -m "
        "radixserve.dynamo, none under launch.py; 0 turns them off.",
    )
    dynamo_namespace: str = flag("dynamo", "Dynamo namespace the worker registers in.")
    dynamo_component: str = flag(
        "radixserve", "Dynamo component of the worker: it serves dyn://NAMESPACE.COMPONENT.generate."
    )
    discovery_backend: str | None = flag(
        None,
        "Dynamo discovery: etcd | kubernetes | file (one host: a directory, "
        "$DYN_FILE_KV) | mem. Default: $DYN_DISCOVERY_BACKEND, else etcd.",
        choices=["etcd", "kubernetes", "file", "mem"],
    )
    request_plane: str | None = flag(
        None,
        "Dynamo request plane, router to worker: tcp (no broker) | nats. Default: $DYN_REQUEST_PLANE, else tcp.",
        choices=["tcp", "nats"],
    )
    event_plane: str | None = flag(
        None,
        "Dynamo event plane, for KV events and load: zmq (no broker) | nats. Default: $DYN_EVENT_PLANE, else zmq.",
        choices=["zmq", "nats"],
    )
    # Supervision
    watchdog_timeout: float | None = flag(
        None,
        "Seconds a busy worker or scheduler may go without progress before the server fails its requests and exits "
        "(default 300; 0 disables). The first batch after startup is not timed.",
    )

    def __post_init__(self):
        apply_rules(self)

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        kernel_flags = parser.add_argument_group("kernels and attention")
        kernel_names = {f.name for f in dataclasses.fields(KernelArgs)}
        for f in dataclasses.fields(cls):
            group = kernel_flags if f.name in kernel_names else parser
            option = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", "")
            if f.type in ("bool", bool):
                group.add_argument(option, action="store_true", help=help_text)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            group.add_argument(option, type=kind, default=f.default, help=help_text, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
