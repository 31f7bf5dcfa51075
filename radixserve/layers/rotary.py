"""Rotary position embedding: builds the cos/sin table once (with the rope_scaling variant of the config) and
applies it in place through kernels.rope (neox layout: the two halves of each head are rotated together).

The table is shared: every layer of a model asks for the same one, and at long contexts it is large (a 512K-token
table of head_dim 128 is 256 MiB in fp32; one per layer would be 9 GiB for a 36-layer model)."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

import kernels

# (rotary_dim, max_position, base, scaling, device) -> the table; entries go when no module holds them any more.
_TABLES: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF transformers computes it (_compute_yarn_parameters), op for op so that the
    fp32 tables agree bit for bit: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that turn more than beta_fast times are kept, a linear ramp between.
    Returns (inverse frequencies, attention factor); the factor multiplies cos and sin, as HF applies it."""
    factor = scaling.get("factor")
    if factor is None:  # (HF would derive it from max_position_embeddings; no config we serve leaves it out)
        raise ValueError("rope_scaling yarn needs a factor")
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # (HF's guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def rope_table(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """The fp32 [max_position, rotary_dim] table (cos in the first half, sin in the second) on the current default
    device, shared with every other module that asks for the same one."""
    kind = (rope_scaling or {}).get("rope_type", "default")
    device = torch.get_default_device()
    key = (rotary_dim, max_position, base, repr(sorted((rope_scaling or {}).items())), str(device))
    table = _TABLES.get(key)
    if table is not None:
        return table
    inv_freq, scale = _inverse_frequencies(rotary_dim, base), 1.0
    if kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    elif kind == "yarn":
        inv_freq, scale = _yarn(rotary_dim, base, rope_scaling)
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    # YaRN's attention factor lives in the table (HF multiplies cos and sin by it, so q.k grows by its square):
    # every kernel that reads the table (kernels.rope, kernels.qk_norm_rope_store) applies it with no change.
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    table = torch.cat([cos, sin], dim=-1).to(torch.float32)
    _TABLES[key] = table
    return table


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        table = rope_table(rotary_dim or head_dim, max_position, base, rope_scaling)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        kernels.rope(q, k, positions, self.cos_sin_cache)
