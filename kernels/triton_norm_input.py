"""A projection's input normalised in the projection's own kernel: RMSNorm (with the residual add) fused into the
weight-streaming kernels of decode-sized batches (triton_skinny_linear.py, triton_mlp.py).

A decode layer runs two RMSNorms, each a kernel of its own between two projections: at batch 1 a launch and a gap of
a few microseconds for a few kilobytes. Folded into the next projection they cost nothing, because the norm's scale
is one number per row: rmsnorm(h) W^T = inv_rms(h) * ((h * gamma) W^T). So each program streams its weight as
before, multiplies its x-tiles by gamma on the way into the dot, sums the squares of h alongside, and scales its
accumulator by inv_rms at the end. The residual add comes first, rounded to the storage dtype as the separate norm
rounds it (the next layer adds to the stored sum); the programs of the first column block store it.

Rounding differs from the separate norm's in one place: h * gamma is rounded to the storage dtype before the dot
instead of h * inv_rms * gamma; the same single rounding, of a value scaled differently (kernels/reference.py's twin
computes the unfused functions; tests/worker/test_kernels_fused.py bounds the difference)."""

import triton
import triton.language as tl


@triton.jit
def load_normed_tile(
    X, Residual, Hidden_out, NormW, x_offs, r_offs, h_offs, offs_k, mask, write_hidden, sum_sq,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_K] x-tile for the dot: x itself, or with NORM (x + residual) * gamma and the running
    per-row sum of squares of x + residual updated; returns (tile, sum_sq)."""
    x = tl.load(X + x_offs, mask=mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(Residual + r_offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            if write_hidden:
                tl.store(Hidden_out + h_offs, x, mask=mask)
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
        x = (xf * tl.load(NormW + offs_k).to(tl.float32)[None, :]).to(X.dtype.element_ty)
    return x, sum_sq


@triton.jit
def inv_rms(sum_sq, eps, K: tl.constexpr):
    return tl.rsqrt(sum_sq / K + eps)
