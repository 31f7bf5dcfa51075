"""Q/K per-head RMSNorm (Qwen3), neox RoPE and the KV store of the new tokens, in one kernel.

Unfused, a layer runs four kernels over the freshly projected Q/K/V (two norms, RoPE, the store), plus a copy of Q
and K out of the fused QKV output for each norm. Here one program per token reads its Q/K/V row once, normalises and
rotates Q and K in place (they stay strided views of the QKV output: the extend kernel reads the new K/V from there)
and writes K and V into their KV slots. The math is fp32, rounded where the unfused kernels round (the norm's output
to the storage dtype before the rotation), so it matches kernels/reference.py's twin, which is the unfused
composition itself. A decode step's tokens get the same from the plain decode kernel itself when
OPTIONS["qkv_in_decode_max_rows"] lets it (rotated_heads: whole-head tiles in registers, kernels/triton_attention.py).
"""

import triton
import triton.language as tl

from kernels.triton_common import jit, let_next_kernel_start, pdl_args, wait_for_prior_kernel


@triton.jit
def _norm_and_rotate(
    X,
    stride_h,
    num_heads,
    Weight,
    eps,
    cos,
    sin,
    halves,
    half_ok,
    rest,
    rest_ok,
    HAS_NORM: tl.constexpr,
    HAS_REST: tl.constexpr,
    HALF: tl.constexpr,
    ROT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """The heads of one token, normalised (HAS_NORM) and rotated: (first halves, second halves, unrotated rest) in
    the storage dtype, and the head mask. The rotated halves are loaded as two tiles so that each element meets its
    rotation partner in the same thread."""
    heads = tl.arange(0, BLOCK_HEADS)
    head_ok = heads < num_heads
    base = X + heads[:, None] * stride_h
    mask = head_ok[:, None] & half_ok[None, :]
    x1 = tl.load(base + halves[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + halves[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.zeros([BLOCK_HEADS, 1], tl.float32)
    if HAS_REST:
        x3 = tl.load(base + ROT + rest[None, :], mask=head_ok[:, None] & rest_ok[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if HAS_REST:
            squares += tl.sum(x3 * x3, 1)
        inv_rms = tl.rsqrt(squares / HEAD_DIM + eps)
        w1 = tl.load(Weight + halves, mask=half_ok, other=0.0).to(tl.float32)
        w2 = tl.load(Weight + HALF + halves, mask=half_ok, other=0.0).to(tl.float32)
        # Rounded to the storage dtype as the unfused norm's output is, then rotated from that.
        x1 = (x1 * inv_rms[:, None] * w1[None, :]).to(X.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms[:, None] * w2[None, :]).to(X.dtype.element_ty).to(tl.float32)
        if HAS_REST:
            w3 = tl.load(Weight + ROT + rest, mask=rest_ok, other=0.0).to(tl.float32)
            x3 = x3 * inv_rms[:, None] * w3[None, :]
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty)
    return out1, out2, x3.to(X.dtype.element_ty), head_ok


@triton.jit
def _store_heads(
    Base,
    stride_h,
    out1,
    out2,
    out3,
    head_ok,
    halves,
    half_ok,
    rest,
    rest_ok,
    HAS_REST: tl.constexpr,
    HALF: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    base = Base + heads[:, None] * stride_h
    mask = head_ok[:, None] & half_ok[None, :]
    tl.store(base + halves[None, :], out1.to(Base.dtype.element_ty), mask=mask)
    tl.store(base + HALF + halves[None, :], out2.to(Base.dtype.element_ty), mask=mask)
    if HAS_REST:
        tl.store(base + ROT + rest[None, :], out3.to(Base.dtype.element_ty), mask=head_ok[:, None] & rest_ok[None, :])


@triton.jit
def rotated_heads(
    X,
    heads,
    head_ok,
    stride_h,
    dims,
    Weight,
    eps,
    Cos_sin,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Heads `heads` of one token's row X ([heads, HEAD_DIM] at stride_h), each RMS-normalised with Weight (HAS_NORM)
    and rotated neox-style over its first 2 * HALF dims by the position's cos/sin (Cos_sin: its row of the table, cos
    then sin), as a [len(heads), len(dims)] tile in X's dtype. The math is fp32, the norm's output rounded to X's dtype
    before the rotation as _norm_and_rotate rounds it. Each dim meets its rotation partner (d + HALF in the first half,
    d - HALF in the second) through a second load of the same row, so the tile stays whole for the decode kernel's dot
    (kernels/triton_attention_kernels.py). Not for a result written back over X, as this module's kernel writes its
    own: a partner may belong to another thread, which _norm_and_rotate's halves never do."""
    ROT: tl.constexpr = 2 * HALF
    dim_ok = dims < HEAD_DIM
    first = dims < HALF
    rotated = dims < ROT
    partner = tl.where(first, dims + HALF, tl.where(rotated, dims - HALF, dims))
    mask = head_ok[:, None] & dim_ok[None, :]
    base = X + heads[:, None] * stride_h
    x = tl.load(base + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        w = tl.load(Weight + dims, mask=dim_ok, other=0.0).to(tl.float32)
        w_partner = tl.load(Weight + partner, mask=dim_ok, other=0.0).to(tl.float32)
        x = (x * inv_rms[:, None] * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        x_partner = (x_partner * inv_rms[:, None] * w_partner[None, :]).to(X.dtype.element_ty).to(tl.float32)
    angle = tl.where(first, dims, dims - HALF)
    cos = tl.load(Cos_sin + angle, mask=rotated, other=1.0)  # dims past the rotary ones: x as it is
    sin = tl.load(Cos_sin + HALF + angle, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)  # first half: x cos - partner sin; second: x cos + partner sin
    return (x * cos[None, :] + x_partner * sin[None, :]).to(X.dtype.element_ty)


# Positions and slots arrive as slices of per-step buffers: exempt from alignment specialisation.
@jit(unaligned=["Positions", "Loc"])
def _qk_norm_rope_store_kernel(
    Q,
    K,
    V,
    Positions,
    Cos_sin,
    Q_weight,
    K_weight,
    K_cache,
    V_cache,
    Loc,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kcn,
    stride_kch,
    stride_vcn,
    stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    ROT: tl.constexpr = 2 * HALF
    HAS_REST: tl.constexpr = ROT < HEAD_DIM
    pos = tl.load(Positions + token).to(tl.int64)
    halves = tl.arange(0, BLOCK_HALF)
    half_ok = halves < HALF
    rest = tl.arange(0, BLOCK_REST)
    rest_ok = rest < HEAD_DIM - ROT
    cos = tl.load(Cos_sin + pos * stride_cs + halves, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(Cos_sin + pos * stride_cs + HALF + halves, mask=half_ok, other=0.0).to(tl.float32)
    # The step's positions and the cos/sin table predate the kernel before (the QKV projection): read before the
    # wait, q/k/v after it.
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)

    q1, q2, q3, q_ok = _norm_and_rotate(
        Q + token * stride_qt,
        stride_qh,
        NUM_Q_HEADS,
        Q_weight,
        eps,
        cos,
        sin,
        halves,
        half_ok,
        rest,
        rest_ok,
        HAS_NORM,
        HAS_REST,
        HALF,
        ROT,
        HEAD_DIM,
        BLOCK_QH,
    )
    _store_heads(
        Q + token * stride_qt,
        stride_qh,
        q1,
        q2,
        q3,
        q_ok,
        halves,
        half_ok,
        rest,
        rest_ok,
        HAS_REST,
        HALF,
        ROT,
        BLOCK_QH,
    )
    k1, k2, k3, k_ok = _norm_and_rotate(
        K + token * stride_kt,
        stride_kh,
        NUM_KV_HEADS,
        K_weight,
        eps,
        cos,
        sin,
        halves,
        half_ok,
        rest,
        rest_ok,
        HAS_NORM,
        HAS_REST,
        HALF,
        ROT,
        HEAD_DIM,
        BLOCK_KH,
    )
    _store_heads(
        K + token * stride_kt,
        stride_kh,
        k1,
        k2,
        k3,
        k_ok,
        halves,
        half_ok,
        rest,
        rest_ok,
        HAS_REST,
        HALF,
        ROT,
        BLOCK_KH,
    )
    # int64: slot * stride overflows int32 once the pool holds more than ~2M head-rows.
    slot = tl.load(Loc + token).to(tl.int64)
    _store_heads(
        K_cache + slot * stride_kcn,
        stride_kch,
        k1,
        k2,
        k3,
        k_ok,
        halves,
        half_ok,
        rest,
        rest_ok,
        HAS_REST,
        HALF,
        ROT,
        BLOCK_KH,
    )
    heads = tl.arange(0, BLOCK_KH)
    dims = tl.arange(0, BLOCK_D)
    v_mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    v = tl.load(V + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=v_mask)
    tl.store(
        V_cache + slot * stride_vcn + heads[:, None] * stride_vch + dims[None, :],
        v.to(V_cache.dtype.element_ty),
        mask=v_mask,
    )


def qk_norm_rope_store(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, out_cache_loc):
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    for x in (q, k, v, k_cache, v_cache, cos_sin_cache):
        assert x.stride(-1) == 1, "the head_dim axis must be contiguous"
    half = cos_sin_cache.shape[-1] // 2
    has_norm = q_weight is not None
    _qk_norm_rope_store_kernel[(t,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        k_cache,
        v_cache,
        out_cache_loc,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_Q_HEADS=hq,
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(max(1, d - 2 * half)),
        BLOCK_QH=triton.next_power_of_2(hq),
        BLOCK_KH=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
        HAS_NORM=has_norm,
        num_warps=4 if hq * d >= 2048 else 1,
        **pdl_args(q.device, "qkv"),
    )
