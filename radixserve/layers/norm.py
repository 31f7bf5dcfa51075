from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it first adds it (fused) and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rmsnorm(x, self.weight, self.eps, residual)


class Normed(NamedTuple):
    """rmsnorm(x), left to the projection that takes it (kernels.fuses_norms): x is the residual stream, squares its
    rows' sums of squares by column block (kernels.linear_add wrote them with x), and the norm's weight is folded into
    that projection's (LlamaForCausalLM.fold_norm_weights)."""

    x: torch.Tensor
    squares: torch.Tensor
    eps: float
