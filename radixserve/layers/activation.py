from __future__ import annotations

import torch

import kernels
from radixserve.layers.norm import Normed


def gate_up_silu(x: torch.Tensor | Normed, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the merged gate/up projection (its weight without bias, [gate; up] by rows), the
    SiLU-and-mul fused into the projection where that pays (kernels.gate_up_silu), and x's norm too if it is Normed."""
    if isinstance(x, Normed):
        return kernels.gate_up_silu(x.x, gate_up_weight, x.squares, x.eps)
    return kernels.gate_up_silu(x, gate_up_weight)
