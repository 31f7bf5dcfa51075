"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that copies this rank's shard of a
checkpoint tensor into it, so the loader never needs to know how a layer is sharded."""

from __future__ import annotations

import torch
from torch import nn

import kernels

from radixserve.runtime.distributed import all_reduce, get_tp_rank, get_tp_size
from radixserve.layers.norm import Normed
from radixserve.loader import copy_whole_tensor


_BLAS_DEFAULTS: dict = {}


def set_gemm_split_k(allowed: bool) -> None:
    """Whether cuBLAS may split a 16-bit GEMM's inner dimension and reduce the parts in a second kernel. At decode
    batches it does for the QKV and down projections: two more kernels per layer (and their gaps). Disallowing it
    needs cuBLASLt (torch >= 2.10's (allow_reduced_precision, allow_splitk) setting); it is process-wide, so the
    worker sets it once at start. True restores torch's settings as they were."""
    matmul = torch.backends.cuda.matmul
    if not _BLAS_DEFAULTS:
        _BLAS_DEFAULTS.update(
            library=torch.backends.cuda.preferred_blas_library(),
            bf16=matmul.allow_bf16_reduced_precision_reduction,
            fp16=matmul.allow_fp16_reduced_precision_reduction,
        )
    if allowed:
        torch.backends.cuda.preferred_blas_library(_BLAS_DEFAULTS["library"])
        matmul.allow_bf16_reduced_precision_reduction = _BLAS_DEFAULTS["bf16"]
        matmul.allow_fp16_reduced_precision_reduction = _BLAS_DEFAULTS["fp16"]
        return
    torch.backends.cuda.preferred_blas_library("cublaslt")
    matmul.allow_bf16_reduced_precision_reduction = (False, False)
    matmul.allow_fp16_reduced_precision_reduction = (False, False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows: each rank computes a slice of y, no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_size_per_rank = output_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        if loaded.shape[0] != n * self.tp_size:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)} cannot be split into "
                f"{self.tp_size} shards of {tuple(param.shape)}"
            )
        copy_whole_tensor(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        if isinstance(x, Normed):  # the norm runs in the projection's kernel
            return kernels.linear(x.x, self.weight, self.bias, x.squares, x.eps)
        return kernels.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one GEMM (gate_proj + up_proj); shard_id picks the block."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if loaded.shape[0] != size * self.tp_size:
            raise ValueError(
                f"shape mismatch: checkpoint block {shard_id} has {loaded.shape[0]} rows, "
                f"expected {size * self.tp_size}"
            )
        block = param.data.narrow(0, offset, size)
        shard = loaded.narrow(0, self.tp_rank * size, size)
        if block.shape != shard.shape:
            raise ValueError(f"shape mismatch: checkpoint shard {tuple(shard.shape)} vs {tuple(block.shape)}")
        block.copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one GEMM. With more ranks than KV heads, KV heads are replicated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank_block = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        shard = loaded.narrow(0, rank_block * size, size) if loaded.shape[0] >= (rank_block + 1) * size else loaded
        block = param.data.narrow(0, offset, size)
        if block.shape != shard.shape:
            raise ValueError(
                f"shape mismatch: checkpoint {shard_id}_proj {tuple(loaded.shape)} vs expected shard "
                f"{tuple(block.shape)}"
            )
        block.copy_(shard)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns: each rank holds a partial sum, all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = input_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = copy_whole_tensor

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[1]
        if loaded.dim() != 2 or loaded.shape[1] != n * self.tp_size:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)} cannot be split into "
                f"{self.tp_size} shards of {tuple(param.shape)}"
            )
        copy_whole_tensor(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(kernels.linear(x, self.weight))
        # The bias is added after the reduction so that it counts once, not once per rank.
        return y if self.bias is None else y + self.bias

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + this projection of x, that sum's row sums of squares): the residual add and the next norm's
        statistic in the projection's epilogue (kernels.linear_add). One rank and no bias only: an epilogue sees
        the whole sum only there (LlamaForCausalLM.fold_norm_weights checks)."""
        return kernels.linear_add(x, self.weight, residual)
