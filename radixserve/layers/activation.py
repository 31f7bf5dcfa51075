from __future__ import annotations

import torch

import kernels


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the merged gate/up projection (its weight without bias, [gate; up] by rows), the
    SiLU-and-mul fused into the projection where that pays (kernels.gate_up_silu)."""
    return kernels.gate_up_silu(x, gate_up_weight)
