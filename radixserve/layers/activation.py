from __future__ import annotations

import torch
from torch import nn

import kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of the merged gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)
