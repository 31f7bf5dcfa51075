"""The one-launch decode kernel (kernels/one_launch_decode.py's docstring describes its work items; that module
launches it and holds its block configs): each program walks its prefix or suffix items, attends, and hands each
partial to kernels/one_launch_items.finish."""

import triton.language as tl

from kernels.one_launch_items import finish, group_tile, prefix_slicing, suffix_splitting
from kernels.triton_common import attend_table_range, jit


# Everything that follows the batch's makeup (its size, groups, split counts) is a runtime value exempt from
# specialisation, and the group tables' pointers from alignment specialisation: one binary for every step
# (kernels/triton_common.py, bench/kernel_variants.py).
@jit(
    do_not_specialize=["batch", "num_groups", "splits", "prefix_programs", "prefix_last", "slice_tokens", "max_slices"],
    unaligned=[
        "Req_pool_indices",
        "Seq_lens",
        "Suffix_start",
        "Req_group",
        "Group_prefix_lens",
        "Group_prefix_rows",
        "Group_member_start",
        "Group_members",
    ],
)
def _decode_kernel(
    Q,
    K_cache,
    V_cache,
    O,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Suffix_start,
    Req_group,
    Group_prefix_lens,
    Group_prefix_rows,
    Group_member_start,
    Group_members,
    Part_o,
    Part_lse,
    Arrivals,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    batch,
    num_groups,
    splits,
    prefix_programs,
    prefix_last,
    slice_tokens,
    max_slices,
    NUM_KV_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFIX_ITEMS: tl.constexpr,
    SUFFIX_ITEMS: tl.constexpr,
):
    # PREFIX_ITEMS / SUFFIX_ITEMS: which kinds of item this launch runs. Plain steps compile the suffix path alone (the
    # prefix tile's registers would cost the suffix items occupancy); a grouped step runs both, in one launch or two.
    # In one launch the prefix programs come first in launch order (they run longest), or last (prefix_last: the CPU
    # tests' way to have prefix items complete rows, since the interpreter runs programs one after another).
    pid = tl.program_id(0)
    suffix_programs = batch * NUM_KV_HEADS * splits
    prefix_pid = tl.where(prefix_last != 0, pid - suffix_programs, pid)
    suffix_idx = tl.where(prefix_last != 0, pid, pid - prefix_programs)
    NUM_Q_HEADS: tl.constexpr = NUM_KV_HEADS * GQA
    MEMBERS: tl.constexpr = BLOCK_M // GQA  # whole members per prefix tile: a row's count never spans two tiles
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    if PREFIX_ITEMS:
        if (prefix_pid >= 0) & (prefix_pid < prefix_programs):
            total = 0
            for g0 in range(0, num_groups, BLOCK_G):
                _, items = group_tile(
                    Group_prefix_lens,
                    Group_member_start,
                    g0,
                    num_groups,
                    slice_tokens,
                    max_slices,
                    MEMBERS,
                    NUM_KV_HEADS,
                    BLOCK_N,
                    BLOCK_G,
                )
                total += tl.sum(items, 0)
            for item in range(prefix_pid, total, prefix_programs):
                # Which group holds this item, and where in the group's (slice, KV head, member block) order.
                group = 0
                local = 0
                seen = 0
                for g0 in range(0, num_groups, BLOCK_G):
                    gs, items = group_tile(
                        Group_prefix_lens,
                        Group_member_start,
                        g0,
                        num_groups,
                        slice_tokens,
                        max_slices,
                        MEMBERS,
                        NUM_KV_HEADS,
                        BLOCK_N,
                        BLOCK_G,
                    )
                    upto = tl.cumsum(items, 0) + seen
                    hit = (upto - items <= item) & (item < upto)
                    group += tl.sum(tl.where(hit, gs, 0), 0)
                    local += tl.sum(tl.where(hit, item - (upto - items), 0), 0)
                    seen += tl.sum(items, 0)
                prefix_len = tl.load(Group_prefix_lens + group)
                member0 = tl.load(Group_member_start + group)
                size = tl.load(Group_member_start + group + 1) - member0
                prefix_slices, slice_len = prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
                blocks = tl.cdiv(size, MEMBERS)
                block = local % blocks  # member blocks of one slice and head are neighbours: their K/V is shared in L2
                kv_head = (local // blocks) % NUM_KV_HEADS
                slice_idx = local // blocks // NUM_KV_HEADS

                # Row r: query head (r % GQA) of this KV head, for the block's member (r // GQA).
                rows = tl.arange(0, BLOCK_M)
                member = block * MEMBERS + rows // GQA
                row_ok = (rows < MEMBERS * GQA) & (member < size)
                reqs = tl.load(Group_members + member0 + member, mask=row_ok, other=0).to(tl.int64)
                heads = kv_head * GQA + rows % GQA
                q = tl.load(
                    Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0,
                )
                table = Req_to_token + tl.load(Group_prefix_rows + group).to(tl.int64) * stride_rt
                start = slice_idx * slice_len
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                m_i, l_i, acc = attend_table_range(
                    q,
                    m_i,
                    l_i,
                    acc,
                    table,
                    start,
                    tl.minimum(start + slice_len, prefix_len),
                    K_cache + kv_head * stride_kh,
                    V_cache + kv_head * stride_vh,
                    stride_kn,
                    stride_vn,
                    dims,
                    dim_ok,
                    qk_scale,
                    BLOCK_N,
                    EVEN_D,
                    DOT_PRECISION,
                )
                own = tl.load(Seq_lens + reqs, mask=row_ok, other=1) - tl.load(
                    Suffix_start + reqs, mask=row_ok, other=0
                )
                suffix_live, _ = suffix_splitting(own, splits, BLOCK_N)
                finish(
                    acc,
                    m_i,
                    l_i,
                    reqs,
                    heads,
                    row_ok,
                    splits + slice_idx,
                    suffix_live + prefix_slices,
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
                    NUM_Q_HEADS,
                )
    if SUFFIX_ITEMS:
        if (suffix_idx >= 0) & (suffix_idx < suffix_programs):
            req = suffix_idx // (NUM_KV_HEADS * splits)
            kv_head = suffix_idx // splits % NUM_KV_HEADS
            split = suffix_idx % splits
            grouped = num_groups > 0
            first = tl.load(Suffix_start + req, mask=grouped, other=0)
            own = tl.load(Seq_lens + req) - first
            suffix_live, split_len = suffix_splitting(own, splits, BLOCK_N)
            start = first + split * split_len
            if split < suffix_live:  # dead splits (a short request in a batch split for a long one) count for nothing
                rows = tl.arange(0, BLOCK_H)
                row_ok = rows < GQA
                heads = kv_head * GQA + rows
                q = tl.load(
                    Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0,
                )
                table = Req_to_token + tl.load(Req_pool_indices + req).to(tl.int64) * stride_rt
                m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_H], tl.float32)
                acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
                m_i, l_i, acc = attend_table_range(
                    q,
                    m_i,
                    l_i,
                    acc,
                    table,
                    start,
                    tl.minimum(start + split_len, first + own),
                    K_cache + kv_head * stride_kh,
                    V_cache + kv_head * stride_vh,
                    stride_kn,
                    stride_vn,
                    dims,
                    dim_ok,
                    qk_scale,
                    BLOCK_N,
                    EVEN_D,
                    DOT_PRECISION,
                )
                group = tl.load(Req_group + req, mask=grouped, other=-1)
                prefix_len = tl.load(Group_prefix_lens + tl.maximum(group, 0), mask=group >= 0, other=0)
                prefix_slices, _ = prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
                if suffix_live + prefix_slices == 1:
                    tl.store(
                        O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                        (acc / l_i[:, None]).to(O.dtype.element_ty),
                        mask=row_ok[:, None] & dim_ok[None, :],
                    )
                else:
                    reqs = tl.full([BLOCK_H], 0, tl.int64) + req
                    finish(
                        acc,
                        m_i,
                        l_i,
                        reqs,
                        heads,
                        row_ok,
                        split,
                        tl.full([BLOCK_H], 0, tl.int32) + suffix_live + prefix_slices,
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
                        NUM_Q_HEADS,
                    )
