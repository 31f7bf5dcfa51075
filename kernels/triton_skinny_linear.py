"""y = x W^T for decode-sized batches (a few rows): one kernel that streams the weight at the copy bandwidth.

At a few rows a projection is a weight read: the FLOPs are nothing, the bytes are the weight. cuBLAS picks tiles for
it that leave a small projection latency-bound (Qwen3-0.6B's 4 MB output projection: 5.4 us on an H100, a third of
the copy bandwidth) and splits the inner dimension of the larger ones into two kernels, the GEMM and a split-K
reduction. Here the grid is (column blocks, inner-dimension splits), sized so that every SM streams its share of the
weight; each program multiplies its 16-row x-tile (the smallest tensor-core tile; rows past the batch are masked)
by a BLOCK_N x (K / SPLITS) slab of W. With one split it writes y. With more, each writes its fp32 partial to a
scratch buffer and bumps its column block's counter; the program that brings the counter to SPLITS sums the
partials in split order (deterministic), writes y and puts the counter back to 0, so that the next call (a CUDA
graph replay included) finds it zeroed. Larger batches keep cuBLAS (kernels/__init__.py picks by row count).
"""

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    dot_precision,
    jit,
    let_next_kernel_start,
    linear_kind,
    pdl_args,
    rows_inv_rms,
    sm_count,
    wait_for_prior_kernel,
    zeroed_counters,
)


@jit(do_not_specialize=["rows"])
def _skinny_linear_kernel(
    X,
    W,
    Out,
    Partials,
    Counters,
    Squares_in,
    Residual,
    Squares_out,
    rows,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    N: tl.constexpr,
    K: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NORM_BLOCKS: tl.constexpr,
    NORM_BLOCKS_P2: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    K_PER_SPLIT: tl.constexpr = K // SPLITS  # the host picks SPLITS that divide K into whole BLOCK_K steps
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    n_ok = offs_n < N
    out_mask = m_ok[:, None] & n_ok[None, :]
    # The epilogue's inputs, read before the weight stream so that their latency hides under it.
    inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM_BLOCKS > 0:  # x is the un-normalised residual stream: rmsnorm(x) W^T = (x W^T) / rms(x), weight in W
        inv_rms = rows_inv_rms(Squares_in, offs_m, m_ok, eps, K, NORM_BLOCKS, NORM_BLOCKS_P2)
    res = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ADD_RESIDUAL:
        res = tl.load(Residual + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=out_mask, other=0.0)
        res = res.to(tl.float32)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    squares_ptrs = Squares_out + offs_m * tl.num_programs(0) + pid_n
    if SPLITS == 1:
        _finish(acc, inv_rms, res, out_ptrs, squares_ptrs, m_ok, out_mask, NORM_BLOCKS > 0, ADD_RESIDUAL)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(Partials + split * BLOCK_M * N + tile, acc, mask=out_mask)
        # acq_rel: this program's partial is visible before its count, and the last one sees every partial.
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLITS):  # split order, whoever arrives last: the same sum every time
                total += tl.load(Partials + s * BLOCK_M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            _finish(total, inv_rms, res, out_ptrs, squares_ptrs, m_ok, out_mask, NORM_BLOCKS > 0, ADD_RESIDUAL)
            tl.atomic_xchg(Counters + pid_n, 0)


@triton.jit
def _finish(y, inv_rms, res, out_ptrs, squares_ptrs, m_ok, out_mask, NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """y (fp32, the tile's x W^T) stored: scaled first by each row's 1/rms when x was the un-normalised residual
    stream (NORM), or added to the residual (res), with the stored rows' sums of squares for the next projection."""
    if NORM:
        y = y * inv_rms[:, None]
    y = y.to(out_ptrs.dtype.element_ty)
    if ADD_RESIDUAL:  # rounded as the unfused projection's output and `+ residual` are, so the stream is the same
        y = (y.to(tl.float32) + res).to(out_ptrs.dtype.element_ty)
        yf = tl.where(out_mask, y.to(tl.float32), 0.0)
        tl.store(squares_ptrs, tl.sum(yf * yf, 1), mask=m_ok)
    tl.store(out_ptrs, y, mask=out_mask)


# From the sweep of bench/skinny_linear_bench.py --sweep on an H100 (bench/results/skinny-linear-h100.md): narrow
# column blocks, a deep pipeline, and as many splits as keep about one program per SM.
SKINNY_CONFIG = {
    "16bit": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5, "programs_per_sm": 1},
    "fp32": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2},
    "interpret": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "programs_per_sm": 2},
}
MAX_SPLITS = 16


def skinny_config(dtype, device):
    if device.type != "cuda":
        return SKINNY_CONFIG["interpret"]
    return SKINNY_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


def num_splits(n: int, k: int, cfg: dict, device) -> int:
    """The most inner-dimension splits (a power of two dividing K into whole BLOCK_K steps) that keep the programs
    within programs_per_sm per SM."""
    column_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    target = cfg["programs_per_sm"] * sm_count(device)  # (4 "SMs" for the interpreter)
    splits = 1
    while splits * 2 <= MAX_SPLITS and column_blocks * splits * 2 <= target and k % (splits * 2 * cfg["BLOCK_K"]) == 0:
        splits *= 2
    return splits


def supports(weight) -> bool:
    """Whether the kernel takes this weight: K in whole BLOCK_K steps and rows contiguous."""
    cfg = skinny_config(weight.dtype, weight.device)
    return weight.stride(1) == 1 and weight.shape[1] % cfg["BLOCK_K"] == 0


def skinny_linear(x, weight, config=None, splits=None, squares=None, eps=0.0, residual=None):
    """[..., K] x [N, K] -> [..., N] for at most BLOCK_M (16) rows, in one kernel. squares (with eps): x is the
    un-normalised residual stream and the result is rmsnorm(x) W^T, the norm's weight folded into W (squares: the
    row sums of squares by column block that the projection which wrote x gave back). residual: returns
    (residual + x W^T, its row sums of squares [rows, column blocks], fp32) instead."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, k = x2.shape
    n = weight.shape[0]
    cfg = dict(skinny_config(x.dtype, x.device), **(config or {}))
    assert rows <= cfg["BLOCK_M"] and weight.shape[1] == k and weight.stride(1) == 1
    assert k % cfg["BLOCK_K"] == 0, "K must be a whole number of BLOCK_K steps (kernels.skinny_linear checks)"
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    column_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    squares_out = None
    if residual is not None:
        residual = residual.reshape(rows, n)
        assert residual.stride(-1) == 1
        squares_out = torch.empty((rows, column_blocks), dtype=torch.float32, device=x.device)
    if rows:
        splits = splits or num_splits(n, k, cfg, x.device)
        partials = torch.empty(
            (splits, cfg["BLOCK_M"], n) if splits > 1 else (1,), dtype=torch.float32, device=x.device
        )
        norm_blocks = 0 if squares is None else squares.shape[1]
        _skinny_linear_kernel[(column_blocks, splits)](
            x2,
            weight,
            out,
            partials,
            zeroed_counters(x.device, column_blocks),
            out if squares is None else squares,
            out if residual is None else residual,
            out if squares_out is None else squares_out,
            rows,
            eps,
            x2.stride(0),
            weight.stride(0),
            out.stride(0),
            0 if residual is None else residual.stride(0),
            N=n,
            K=k,
            SPLITS=splits,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            DOT_PRECISION=dot_precision(x.dtype),
            NORM_BLOCKS=norm_blocks,
            NORM_BLOCKS_P2=triton.next_power_of_2(max(1, norm_blocks)),
            ADD_RESIDUAL=residual is not None,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_args(x.device, linear_kind(weight)),
        )
    out = out.view(*shape[:-1], n)
    return out if residual is None else (out, squares_out)
