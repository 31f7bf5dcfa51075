"""The tensor-parallel process group: NCCL on the GPU, gloo on the CPU. With one rank every collective is a no-op."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_tp_rank = 0
_tp_size = 1


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: str) -> None:
    """Join the TP group. init_method is a torch.distributed URL: file://<private dir>/dist_store on one node (the
    launcher's default: a TCPStore would listen on every interface), tcp://host:port with --dist-init-addr."""
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, world_size
    if world_size == 1:
        return
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10)
    )


def destroy_tensor_parallel() -> None:
    global _tp_rank, _tp_size
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp_rank, _tp_size = 0, 1


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (the vocab shards of the LM head)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
