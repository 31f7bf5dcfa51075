"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.runtime.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        # Pad so every rank holds the same number of rows; padded rows are never looked up.
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)} vs vocab {self.vocab_size} x hidden {param.shape[1]}"
            )
        shard = loaded[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T over this rank's vocab slice, gathered so every rank holds the full row."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
