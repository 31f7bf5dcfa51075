"""How many KV slots a rank's two pools get, decided once at start-up: the device pool (--max-total-tokens, a default
on the CPU, or what fits in --mem-fraction-static of the GPU, the smallest over the tensor-parallel ranks) and the host
tier (--hicache-size GB of the device pool's slot size).

Apart from model_runner.py because it is start-up arithmetic over flags and free memory, read by nothing of a step:
the runner asks for the numbers and allocates the pools (radixserve/worker/kv_cache.py) with them."""

from __future__ import annotations

import torch

from radixserve.config import ServerArgs
from radixserve.model_config import ModelConfig
from radixserve.runtime.distributed import get_tp_size
from radixserve.worker.kv_cache import HostKVCache, KVCache

CPU_DEFAULT_KV_TOKENS = 16384


def device_kv_slots(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    layerwise_offload: bool,
) -> int:
    """Slots of the device KV pool. layerwise_offload: requests longer than the pool are served (one layer at a time
    through the host tier), so a pool shorter than the context length is allowed."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    if device.type == "cpu":
        return CPU_DEFAULT_KV_TOKENS
    slots = _slots_that_fit(args, cfg, dtype, device, context_len, layerwise_offload)
    if get_tp_size() > 1:
        # Ranks may have different free memory; all must agree on the smallest pool.
        t = torch.tensor([slots], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        slots = int(t.item())
    return slots


def _slots_that_fit(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    layerwise_offload: bool,
) -> int:
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * args.mem_fraction_static) - used
    slots = KVCache.num_slots_for_budget(
        budget, cfg.num_layers, cfg.kv_heads_per_rank(get_tp_size()), cfg.head_dim, dtype
    )
    if slots < context_len and (not layerwise_offload or slots < 1):
        raise RuntimeError(
            f"only {slots} KV slots fit in --mem-fraction-static {args.mem_fraction_static}; "
            f"need at least the context length {context_len}"
        )
    return slots


def host_kv_tier(args: ServerArgs, kv_cache: KVCache, layerwise_offload: bool) -> tuple[int, HostKVCache | None]:
    """(slots, buffer) of the host KV tier (--hicache-size), (0, None) without one."""
    # Nothing to keep without a cache, but layer-wise offload keeps its requests' KV there.
    if args.hicache_size <= 0 or (args.disable_radix_cache and not layerwise_offload):
        return 0, None
    num_slots = HostKVCache.num_slots_for_gb(args.hicache_size, kv_cache)
    if num_slots < 1:
        raise ValueError(f"--hicache-size {args.hicache_size} GB holds no token of KV")
    return num_slots, HostKVCache(kv_cache, num_slots)
