"""Paged attention over the token-granular KV cache: stores the new K/V into their slots, then attends through
req_to_token: the extend kernel for prompt chunks, the split-KV decode kernel for the decodes of the batch (its
grouped form when decodes share a prefix: kernels/shared_prefix_attention.py)."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from radixserve.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
        self.store(k, v)
        return self.attend(q, k, v)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K/V into their slots (k/v: [T, Hkv, D])."""
        kernels.store_kv(k, v, self.k_cache, self.v_cache, get_forward_context().out_cache_loc)

    def store_rotated(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> kernels.PendingQKV | None:
        """store() after the per-head RMSNorm of Q and K (weights q_norm / k_norm, None for none) and RoPE
        (cos_sin_cache of a layers.rotary.RotaryEmbedding), all in place on q/k, as one kernel. Except in a decode step
        of the plain path: there it is returned, pending, for attend() to hand to the decode kernel, which does it in
        its own launch (kernels.decode_attention); None once done."""
        ctx = get_forward_context()
        pending = kernels.PendingQKV(k, v, positions, cos_sin_cache, q_norm, k_norm, eps, ctx.out_cache_loc)
        if ctx.plain_decode:
            return pending
        kernels.qk_norm_rope_store(*pending.store_args(q, self.k_cache, self.v_cache))
        return None

    def attend(self, q, k, v, pending: kernels.PendingQKV | None = None, out: torch.Tensor | None = None):
        """Attention of the new tokens' queries (q: [T, Hq, D]) over their cached context and the new tokens (k/v:
        [T, Hkv, D], already stored, or pending: store_rotated's); into `out` when given (a piecewise CUDA graph's
        static buffer of T rows or more). Returns the output [T, Hq, D]."""
        ctx = get_forward_context()
        o = torch.empty_like(q) if out is None else out[: q.shape[0]]
        n, t = ctx.num_extend_reqs, ctx.num_extend_tokens
        if n:
            kernels.extend_attention(
                q[:t],
                k[:t],
                v[:t],
                o[:t],
                self.k_cache,
                self.v_cache,
                ctx.req_to_token,
                ctx.req_pool_indices[:n],
                ctx.prefix_lens[:n],
                ctx.extend_lens[:n],
                ctx.extend_start_loc[:n],
                self.scale,
                ctx.max_extend_len,
            )
        g = ctx.decode_groups
        if t < q.shape[0] and g is None:
            kernels.decode_attention(
                q[t:],
                self.k_cache,
                self.v_cache,
                o[t:],
                ctx.req_to_token,
                ctx.req_pool_indices[n:],
                ctx.seq_lens[n:],
                self.scale,
                ctx.max_seq_len,
                pending,
            )
        elif t < q.shape[0]:
            # Decodes that share a prefix: its K/V is read once per group instead of once per member.
            kernels.decode_attention_grouped(
                q[t:],
                self.k_cache,
                self.v_cache,
                o[t:],
                ctx.req_to_token,
                ctx.req_pool_indices[n:],
                ctx.seq_lens[n:],
                g.prefix_lens,
                g.prefix_rows,
                g.member_start,
                g.members,
                g.req_group,
                g.req_suffix_start,
                self.scale,
                ctx.max_seq_len,
                g.max_prefix_len,
                g.max_group_size,
                prefix_splits=g.prefix_splits,
                max_prefix_splits=g.max_prefix_splits,
                live_groups=g.live_groups,
            )
        return o
