"""The batch layout of the forward in flight, set by the model runner and read by the attention layers, so that
model forward signatures stay (input_ids, positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Requests [0, num_extend_reqs) compute prompt chunks (the extend kernel); the rest are decodes, one token over
    a cached context each, which the split-KV decode kernel does several times faster than the extend kernel. The
    scheduler puts decodes last, so one split point suffices."""
    num_extend_reqs: int
    num_extend_tokens: int
    req_to_token: torch.Tensor  # int32 [rows, context_len]
    req_pool_indices: torch.Tensor  # int32 [B]
    prefix_lens: torch.Tensor  # int32 [B]: tokens already in the KV cache before this step
    extend_lens: torch.Tensor  # int32 [B]: new tokens this step
    extend_start_loc: torch.Tensor  # int32 [B]: row of each request's first new token in the flat batch
    seq_lens: torch.Tensor  # int32 [B]: prefix + extend
    out_cache_loc: torch.Tensor  # int32 [T]: KV slot of each new token
    max_extend_len: int  # over the extend requests
    max_seq_len: int  # over the decode requests


_current: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _current
    _current = ctx


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside a model-runner forward")
    return _current
