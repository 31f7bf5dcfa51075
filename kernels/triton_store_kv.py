"""store_kv in Triton: each new token's K and V rows written into the KV cache at its slot (out_cache_loc), one
program per token for every KV head. Part of the attention backend's API (kernels/__init__.py calls
triton_attention.store_kv, which is this), in a module of its own: the attention launches and their policies fill
kernels/triton_attention.py."""

import triton
import triton.language as tl

from kernels.triton_common import assert_last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kch,
    stride_vcn,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(Loc + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(K + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(V + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(
        K_cache + slot * stride_kcn + heads[:, None] * stride_kch + dims[None, :],
        k.to(K_cache.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        V_cache + slot * stride_vcn + heads[:, None] * stride_vch + dims[None, :],
        v.to(V_cache.dtype.element_ty),
        mask=mask,
    )


def store_kv(k, v, k_cache, v_cache, out_cache_loc):
    n, hkv, d = k.shape
    if n == 0:
        return
    assert_last_dim_contiguous(k, v, k_cache, v_cache)
    _store_kv_kernel[(n,)](
        k,
        v,
        k_cache,
        v_cache,
        out_cache_loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=4 if hkv * d >= 1024 else 1,
    )
