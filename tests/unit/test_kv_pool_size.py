"""How many KV slots a rank's pools get (radixserve/worker/kv_pool_size.py): --max-total-tokens when given, a fixed
default on the CPU, else what fits in --mem-fraction-static of the GPU (the GPU's free memory faked here, so the
arithmetic runs on the CPU), refused below the context length unless layer-wise offload serves longer requests; the
host tier from --hicache-size, only where something would be kept in it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.config import ServerArgs
from radixserve.worker import kv_pool_size
from radixserve.worker.kv_cache import KVCache

GIB = 1 << 30
CFG = SimpleNamespace(num_layers=4, head_dim=64, kv_heads_per_rank=lambda tp: 2)
CUDA = torch.device("cuda:0")
PER_SLOT = KVCache.bytes_per_slot(4, 2, 64, torch.bfloat16)


def slots(args: ServerArgs, device=CUDA, context_len=1024, offload=False) -> int:
    return kv_pool_size.device_kv_slots(args, CFG, torch.bfloat16, device, context_len, offload)


def fake_gpu(monkeypatch, total: int, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))


def test_max_total_tokens_and_the_cpu_default_come_first(monkeypatch):
    fake_gpu(monkeypatch, 0, 0)  # never read
    assert slots(ServerArgs(device="cuda", max_total_tokens=300)) == 300
    assert slots(ServerArgs(device="cpu"), device=torch.device("cpu")) == kv_pool_size.CPU_DEFAULT_KV_TOKENS


def test_the_gpu_pool_is_the_fraction_less_what_is_used(monkeypatch):
    fake_gpu(monkeypatch, total=80 * GIB, free=60 * GIB)
    budget = int(80 * GIB * 0.5) - 20 * GIB
    assert slots(ServerArgs(device="cuda", mem_fraction_static=0.5)) == budget // PER_SLOT - 1


def test_a_pool_shorter_than_the_context_is_refused_unless_offload_serves_it(monkeypatch):
    fake_gpu(monkeypatch, total=100 * PER_SLOT, free=100 * PER_SLOT)
    args = ServerArgs(device="cuda", mem_fraction_static=0.5)
    fit = 100 * PER_SLOT // 2 // PER_SLOT - 1
    assert slots(args, context_len=fit) == fit  # exactly the context length: served
    with pytest.raises(RuntimeError, match=f"only {fit} KV slots fit .* context length {fit + 1}"):
        slots(args, context_len=fit + 1)
    assert slots(args, context_len=fit + 1, offload=True) == fit
    fake_gpu(monkeypatch, total=100 * PER_SLOT, free=50 * PER_SLOT)  # nothing left at all
    with pytest.raises(RuntimeError, match="only 0 KV slots"):
        slots(args, context_len=fit, offload=True)


def test_the_host_tier_only_where_something_is_kept_in_it():
    cache = KVCache(4, 16, 2, 64, torch.float32, "cpu")
    gb = 1e-9 * 33 * KVCache.bytes_per_slot(4, 2, 64, torch.float32)  # 33 slots' bytes: 32 and the padding row
    assert kv_pool_size.host_kv_tier(ServerArgs(device="cpu"), cache, False) == (0, None)
    num, host = kv_pool_size.host_kv_tier(ServerArgs(device="cpu", hicache_size=gb), cache, False)
    assert num == host.num_slots == 32
    no_cache = ServerArgs(device="cpu", hicache_size=gb, disable_radix_cache=True)
    assert kv_pool_size.host_kv_tier(no_cache, cache, False) == (0, None)
    assert kv_pool_size.host_kv_tier(no_cache, cache, True)[0] == 32  # layer-wise offload keeps its KV there
    with pytest.raises(ValueError, match="holds no token of KV"):
        kv_pool_size.host_kv_tier(ServerArgs(device="cpu", hicache_size=1e-12), cache, False)
