"""Rotary position embedding: builds the cos/sin table once (with the rope_scaling variant of the config) and
applies it in place through kernels.rope (neox layout: the two halves of each head are rotated together)."""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels


def _inverse_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq = _inverse_frequencies(rotary_dim, base)
        kind = (rope_scaling or {}).get("rope_type", "default")
        if kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_scaled(inv_freq, rope_scaling)
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(torch.float32), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        kernels.rope(q, k, positions, self.cos_sin_cache)
