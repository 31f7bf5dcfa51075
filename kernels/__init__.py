"""Kernels of radixserve: Triton on the GPU, a plain-torch twin of each for the CPU and for ablations.

This module is the one dispatch point. The backend is "auto" (Triton for CUDA tensors, the torch
reference otherwise), "triton" (always Triton: on CPU tensors that needs TRITON_INTERPRET=1, which is
how CI tests the kernels) or "reference" (the torch twins even on the GPU). The environment variable
RADIXSERVE_KERNEL_BACKEND sets the default; set_backend() changes it at run time.

Triton is imported on first use only: a CPU server never pays for it, and TRITON_INTERPRET is read
when triton is imported, so importing this package early must not freeze that choice.
"""

import os

from kernels import reference

BACKENDS = ("auto", "triton", "reference")

_backend = "auto"
_triton_modules = None


def set_backend(name):
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    _backend = name


def get_backend():
    return _backend


set_backend(os.environ.get("RADIXSERVE_KERNEL_BACKEND", "auto"))


def _triton():
    global _triton_modules
    if _triton_modules is None:
        from kernels import triton_attention, triton_elementwise
        _triton_modules = (triton_attention, triton_elementwise)
    return _triton_modules


def _attention_impl(tensor):
    if _backend == "reference" or (_backend == "auto" and not tensor.is_cuda):
        return reference
    return _triton()[0]


def _elementwise_impl(tensor):
    if _backend == "reference" or (_backend == "auto" and not tensor.is_cuda):
        return reference
    return _triton()[1]


def store_kv(k, v, k_cache, v_cache, out_cache_loc):
    """k_cache[out_cache_loc[i]] = k[i] (and v). k, v: [N, Hkv, D]; caches: [num_slots, Hkv, D]."""
    _attention_impl(k).store_kv(k, v, k_cache, v_cache, out_cache_loc)


def extend_attention(q, k, v, o, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                     extend_start_loc, sm_scale, max_extend_len):
    """Prefill/extend for a batch of requests; writes o [T, Hq, D] in place.

    New token j of request i sees its prefix positions [0, prefix_lens[i]) through
    req_to_token[req_pool_indices[i]] and new tokens 0..j. q/k/v/o rows of request i are
    extend_start_loc[i] : extend_start_loc[i] + extend_lens[i]. GQA: query head h uses KV head
    h // (Hq // Hkv). max_extend_len (a python int) sizes the grid without a device sync.
    The new tokens' K/V must already be in the caches (store_kv first): the Triton kernel reads the
    new tokens before a query block through req_to_token, and only its diagonal block from k/v.
    Decode requests (extend 1) cost far more here than in decode_attention; split them out when the
    host knows which they are.
    """
    _attention_impl(q).extend_attention(q, k, v, o, k_cache, v_cache, req_to_token, req_pool_indices,
                                        prefix_lens, extend_lens, extend_start_loc, sm_scale, max_extend_len)


def decode_attention(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len):
    """One query token per request over positions 0..seq_lens[i]-1 (its own K/V already stored); o in place.

    max_seq_len (a python int, >= every seq_len) fixes the number of KV splits; under CUDA graphs pass a
    constant (e.g. the context length) so that the captured grid stays valid.
    """
    _attention_impl(q).decode_attention(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens,
                                        sm_scale, max_seq_len)


def rmsnorm(x, weight, eps, residual=None):
    """x * rsqrt(mean(x^2) + eps) * weight in fp32; with residual returns (norm(x + residual), x + residual)."""
    return _elementwise_impl(x).rmsnorm(x, weight, eps, residual)


def rope(q, k, positions, cos_sin_cache):
    """Neox-style rotary embedding applied in place to q [T, Hq, D] and k [T, Hkv, D] (strided views allowed).

    cos_sin_cache: fp32 [max_pos, rotary_dim], cos in the first half, sin in the second.
    """
    _elementwise_impl(q).rope(q, k, positions, cos_sin_cache)


def silu_and_mul(x):
    """[..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    return _elementwise_impl(x).silu_and_mul(x)


__all__ = ["BACKENDS", "set_backend", "get_backend", "store_kv", "extend_attention", "decode_attention",
           "rmsnorm", "rope", "silu_and_mul"]
