"""A step's input ids with the overlapped loop's placeholders resolved, and a decode step's new slots written into
req_to_token, in one kernel.

The scheduler sends step N+1 before step N's tokens are known: N+1's input id for a request whose last token N samples
is a placeholder -(i + 1), where i is that token's place in the worker's future-token ring. Resolving it on the device
in torch took five elementwise kernels and a gather (lt, neg, sub, clamp, index, where), and the decode graph's table
write four more (a cast, a multiply, an add, index_put): ten launches of a few hundred bytes at the head of every
decode graph. Here one program per BLOCK requests does both: at batch 1 on Qwen3-0.6B through Engine, 0.894 against
0.902 ms a token on an H200 (bench/results/session27-h200.md).
"""

import triton
import triton.language as tl

from kernels.triton_common import jit

BLOCK = 128


@jit(do_not_specialize=["n"], unaligned=["Ids", "Out_ids", "Rows", "Positions", "Slots"])
def _step_inputs_kernel(
    Ids,
    Future,
    Out_ids,
    Table,
    Rows,
    Positions,
    Slots,
    n,
    stride_table,
    WRITE_TABLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(Ids + offs, mask=ok, other=0)
    placeholder = ids < 0
    sampled = tl.load(Future + (-ids - 1), mask=ok & placeholder, other=0)  # only placeholders read the ring
    tl.store(Out_ids + offs, tl.where(placeholder, sampled.to(ids.dtype), ids), mask=ok)
    if WRITE_TABLE:
        # A decode's new token goes at position seq_len - 1 of its row (padding rows write row 0, which is reserved).
        rows = tl.load(Rows + offs, mask=ok, other=0).to(tl.int64)
        positions = tl.load(Positions + offs, mask=ok, other=0).to(tl.int64)
        slots = tl.load(Slots + offs, mask=ok, other=0)
        tl.store(Table + rows * stride_table + positions, slots.to(Table.dtype.element_ty), mask=ok)


def step_input_ids(input_ids, future_tokens, table_write=None):
    """kernels.step_input_ids on the GPU (or the interpreter): see there."""
    out = input_ids.new_empty(input_ids.shape)
    n = input_ids.numel()
    if n == 0:
        return out
    assert input_ids.dim() == 1 and input_ids.stride(0) == 1 and future_tokens.stride(0) == 1
    if table_write is None:
        table = rows = positions = slots = input_ids  # placeholders: the kernel reads none of them
        stride = 0
    else:
        table, rows, positions, slots = table_write
        assert table.stride(1) == 1 and all(t.numel() == n and t.stride(0) == 1 for t in (rows, positions, slots))
        stride = table.stride(0)
    _step_inputs_kernel[(triton.cdiv(n, BLOCK),)](
        input_ids,
        future_tokens,
        out,
        table,
        rows,
        positions,
        slots,
        n,
        stride,
        WRITE_TABLE=table_write is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out
