"""The memory-bound kernels of a transformer layer: fused add + RMSNorm, in-place neox RoPE, SiLU-and-mul.

Each reads its inputs once and writes its outputs once; the math is fp32 in registers. Their value
over plain torch is fusion (torch runs add, square, mean, rsqrt, mul, mul as separate passes);
bench/kernel_bench.py compares them with eager torch and torch.compile.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_common import let_next_kernel_start, pdl_args, wait_for_prior_kernel


@triton.jit
def _rmsnorm_kernel(
    X,
    Residual,
    Weight,
    Out,
    Hidden_out,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    w = tl.load(Weight + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: read before the wait
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the storage dtype before normalising, as the unfused `x + residual` would:
        # the next layer adds to the stored h, so the norm must see the same h.
        x = x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(Hidden_out.dtype.element_ty)
        tl.store(Hidden_out + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    tl.store(Out + row * stride_o + cols, (xf * inv_rms * w).to(Out.dtype.element_ty), mask=ok)


def _row_warps(block):
    return max(1, min(16, block // 256))


def _rows_view(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x, weight, eps, residual=None):
    shape = x.shape
    x2 = _rows_view(x)
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if residual is None:
        if rows:
            _rmsnorm_kernel[(rows,)](
                x2,
                x2,
                weight,
                out,
                out,
                eps,
                x2.stride(0),
                0,
                out.stride(0),
                0,
                N=n,
                BLOCK=block,
                HAS_RESIDUAL=False,
                num_warps=_row_warps(block),
                **pdl_args(x.device, "norm"),
            )
        return out.view(shape)
    r2 = _rows_view(residual)
    hidden = torch.empty_like(out)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            hidden,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            hidden.stride(0),
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=True,
            num_warps=_row_warps(block),
            **pdl_args(x.device, "norm"),
        )
    return out.view(shape), hidden.view(shape)


@triton.jit
def _rotate_heads(X, stride_h, num_heads, cos, sin, halves, half_ok, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads[:, None] < num_heads) & half_ok[None, :]
    ptr1 = X + heads[:, None] * stride_h + halves[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    Positions,
    Cos_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    # One program per token: its cos/sin row is loaded once and applied to every q and k head.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    halves = tl.arange(0, BLOCK_HALF)
    half_ok = halves < HALF
    cos = tl.load(Cos_sin + pos * stride_cs + halves, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(Cos_sin + pos * stride_cs + HALF + halves, mask=half_ok, other=0.0).to(tl.float32)
    _rotate_heads(Q + token * stride_qt, stride_qh, num_q_heads, cos, sin, halves, half_ok, HALF, BLOCK_QH)
    _rotate_heads(K + token * stride_kt, stride_kh, num_kv_heads, cos, sin, halves, half_ok, HALF, BLOCK_KH)


def rope(q, k, positions, cos_sin_cache):
    """In place. q and k may be strided views (e.g. of a fused qkv output); only head_dim must be contiguous."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    half = cos_sin_cache.shape[-1] // 2
    if t == 0:
        return
    _rope_kernel[(t,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        hq,
        hkv,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(hq),
        BLOCK_KH=triton.next_power_of_2(hkv),
        num_warps=4 if hq * half >= 1024 else 1,
    )


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(x):
    shape = x.shape
    x2 = _rows_view(x)
    rows, width = x2.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=max(1, min(8, block // 128))
        )
    return out.view(*shape[:-1], inter)
