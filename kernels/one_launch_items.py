"""The one-launch decode kernel's work items (kernels/one_launch_decode.py's docstring describes them): how a prefix
is cut into slices and an own context into splits, how many prefix items a tile of the group table holds, and what an
item does when its attention is done (publish its partial, count itself in, merge the rows it completes). Called from
the kernel in kernels/one_launch_kernel.py."""

import triton
import triton.language as tl


@triton.jit
def prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N: tl.constexpr):
    """(live slices, slice length) of prefixes: slices of about slice_tokens, at most max_slices, in whole blocks.
    Elementwise; the prefix items and the rows' arrival counts both derive from it."""
    wanted = tl.maximum(tl.minimum(tl.cdiv(prefix_len, slice_tokens), max_slices), 1)
    slice_len = tl.cdiv(tl.cdiv(prefix_len, wanted), BLOCK_N) * BLOCK_N
    return tl.where(prefix_len > 0, tl.cdiv(prefix_len, tl.maximum(slice_len, 1)), 0), slice_len


@triton.jit
def suffix_splitting(own_len, splits, BLOCK_N: tl.constexpr):
    """(live splits, split length) of own contexts (own_len >= 1); as triton_attention's decode split policy."""
    split_len = tl.cdiv(tl.cdiv(own_len, splits), BLOCK_N) * BLOCK_N
    return tl.cdiv(own_len, split_len), split_len


@triton.jit
def group_tile(
    Group_prefix_lens,
    Group_member_start,
    g0,
    num_groups,
    slice_tokens,
    max_slices,
    MEMBERS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Groups g0 .. g0 + BLOCK_G - 1 and the number of prefix items of each (0 past the table or for empty groups)."""
    gs = g0 + tl.arange(0, BLOCK_G)
    ok = gs < num_groups
    prefix_len = tl.load(Group_prefix_lens + gs, mask=ok, other=0)
    first = tl.load(Group_member_start + gs, mask=ok, other=0)
    size = tl.load(Group_member_start + gs + 1, mask=ok, other=0) - first
    slices, _ = prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
    return gs, slices * NUM_KV_HEADS * tl.cdiv(size, MEMBERS)


@triton.jit
def finish(
    acc,
    m_i,
    l_i,
    reqs,
    heads,
    row_ok,
    slot,
    expected,
    suffix_live,
    splits,
    prefix_slices,
    O,
    Part_o,
    Part_lse,
    Arrivals,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    dims,
    dim_ok,
    NUM_Q_HEADS: tl.constexpr,
):
    """Publishes this item's partial for its rows, counts it in, and merges the rows it completes.

    A row's partials sit in slots 0 .. splits - 1 (its suffix splits, suffix_live of them written) and splits ..
    splits + prefix_slices - 1 (its group's prefix slices); `expected` is how many items cover the row."""
    part_rows = reqs * stride_pb + heads * stride_ph
    lse_rows = reqs * stride_lb + heads * stride_lh
    out_mask = row_ok[:, None] & dim_ok[None, :]
    tl.store(
        Part_o + part_rows[:, None] + slot * stride_ps + dims[None, :],
        (acc / l_i[:, None]).to(Part_o.dtype.element_ty),
        mask=out_mask,
    )
    tl.store(Part_lse + lse_rows + slot, m_i + tl.log2(l_i), mask=row_ok)
    # Every thread's stores before the count (a release by the thread that issues it), as a CUTLASS semaphore does.
    tl.debug_barrier()
    # The count runs on a [rows, 16] tile with one live column, wide enough to span the CTA's threads, so that each
    # row's count is issued and read by one thread. Should a layout still hold a row twice, the copy that does not
    # issue the atomic reads 0 (Triton zeroes a predicated atomic's result, seen in the sm_90 PTX), and 0 never
    # completes a row here: rows that reach this point have expected >= 2.
    cols = tl.arange(0, 16)
    counted = row_ok[:, None] & (cols[None, :] == 0)
    before = tl.atomic_add(
        Arrivals + (reqs * NUM_Q_HEADS + heads)[:, None] + cols[None, :] * 0,
        1,
        mask=counted,
        sem="acq_rel",
        scope="gpu",
    )
    last = tl.max(tl.where(counted & (before == expected[:, None] - 1), 1, 0), axis=1) > 0
    tl.debug_barrier()
    if tl.max(last.to(tl.int32), 0) > 0:
        m_run = tl.full(m_i.shape, -1.0e30, tl.float32)  # finite: no inf - inf before the first live slot
        l_run = tl.zeros(l_i.shape, tl.float32)
        acc_run = tl.zeros(acc.shape, tl.float32)
        for s in range(0, splits + prefix_slices):
            live = tl.where(tl.where(s < splits, s < suffix_live, s - splits < prefix_slices), last, False)
            # .cg: other SMs wrote these in this launch; read them from L2, never from a stale L1 line.
            lse = tl.load(Part_lse + lse_rows + s, mask=live, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(
                Part_o + part_rows[:, None] + s * stride_ps + dims[None, :],
                mask=live[:, None] & dim_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m_run, lse)
            alpha = tl.exp2(m_run - m_new)
            beta = tl.exp2(lse - m_new)
            acc_run = acc_run * alpha[:, None] + part.to(tl.float32) * beta[:, None]
            l_run = l_run * alpha + beta
            m_run = m_new
        tl.store(
            O + reqs[:, None] * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            (acc_run / tl.where(last, l_run, 1.0)[:, None]).to(O.dtype.element_ty),
            mask=last[:, None] & dim_ok[None, :],
        )
        tl.store(Arrivals + reqs * NUM_Q_HEADS + heads, 0, mask=last)  # every count is 0 between launches
