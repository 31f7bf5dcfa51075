"""The MLP's merged gate/up projection with SiLU-and-mul in its epilogue, for decode-sized batches.

At a few rows the projection streams its whole weight ([2I, H]) once, and the unfused path adds a SiLU-and-mul
kernel that reads [rows, 2I] back (plus, at small batches, cuBLAS's split-K reduction kernel): kernels per layer,
each a gap of a microsecond or two in a decode step. Here one program owns BLOCK_N columns of the gate half and the
same columns of the up half, streams both weight slabs over the hidden size (no split-K: enough programs already
fill the GPU at 2I / 2 / BLOCK_N), and writes silu(gate) * up. Larger batches keep cuBLAS and the separate
SiLU-and-mul kernel (kernels/__init__.py picks by row count: OPTIONS["gate_up_silu_max_rows"]).
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
    wait_for_prior_kernel,
)


@jit(do_not_specialize=["rows"])
def _gate_up_silu_kernel(
    X,
    W,
    Out,
    Squares,
    rows,
    eps,
    stride_xm,
    stride_wn,
    stride_om,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NORM_BLOCKS: tl.constexpr,
    NORM_BLOCKS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    EVEN_K: tl.constexpr = HIDDEN % BLOCK_K == 0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    n_ok = offs_n < INTER
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    gate_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + INTER * stride_wn
    inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM_BLOCKS > 0:  # x is the un-normalised residual stream: rmsnorm(x) W^T = (x W^T) / rms(x), weight in W
        # Read before the weight stream so that the load's latency hides under it.
        inv_rms = rows_inv_rms(Squares, offs_m, m_ok, eps, HIDDEN, NORM_BLOCKS, NORM_BLOCKS_P2)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if EVEN_K:  # row masks only: the loads stay 16 bytes wide along the hidden axis
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=n_ok[:, None], other=0.0)
            w_up = tl.load(up_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < HIDDEN
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w_up = tl.load(up_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_gate = tl.dot(x, tl.trans(w_gate), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if NORM_BLOCKS > 0:
        acc_gate = acc_gate * inv_rms[:, None]
        acc_up = acc_up * inv_rms[:, None]
    # Rounded to the storage dtype as the unfused projection's output is, so that SiLU-and-mul sees the same inputs.
    gate = acc_gate.to(Out.dtype.element_ty).to(tl.float32)
    up = acc_up.to(Out.dtype.element_ty).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(
        Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


# A weight-streaming tile: 16 rows (the smallest tensor-core tile), narrow column blocks so that 2I / 2 / BLOCK_N
# programs fill every SM a few times. Swept by bench/kernels_per_layer.py --sweep-gate-up.
GATE_UP_CONFIG = {
    "16bit": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    "fp32": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
    "interpret": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
}


def gate_up_config(dtype, device):
    if device.type != "cuda":
        return GATE_UP_CONFIG["interpret"]
    return GATE_UP_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


def gate_up_silu(x, weight, config=None, squares=None, eps=0.0):
    """[..., H] x [2I, H] -> [..., I] in one kernel. squares (with eps): x is the un-normalised residual stream, the
    projection's input is rmsnorm(x) (weight folded into W; as kernels/triton_skinny_linear.skinny_linear takes it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, hidden = x2.shape
    inter = weight.shape[0] // 2
    assert weight.stride(1) == 1 and weight.shape[1] == hidden
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        cfg = dict(gate_up_config(x.dtype, x.device), **(config or {}))
        _gate_up_silu_kernel[(triton.cdiv(inter, cfg["BLOCK_N"]), triton.cdiv(rows, cfg["BLOCK_M"]))](
            x2,
            weight,
            out,
            out if squares is None else squares,
            rows,
            eps,
            x2.stride(0),
            weight.stride(0),
            out.stride(0),
            INTER=inter,
            HIDDEN=hidden,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            DOT_PRECISION=dot_precision(x.dtype),
            NORM_BLOCKS=0 if squares is None else squares.shape[1],
            NORM_BLOCKS_P2=triton.next_power_of_2(1 if squares is None else squares.shape[1]),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_args(x.device, linear_kind(weight)),
        )
    return out.view(*shape[:-1], inter)
