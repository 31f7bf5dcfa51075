"""The device side of kernels/shared_prefix_attention.py (whose docstring describes the three steps): the suffix
split kernel (each request's own tokens, with the merge fused when it is the row's last), the prefix kernel (a
group's shared prefix, all members' rows as one tile) and the merge kernel. The launches and their block and slice
policy are in shared_prefix_attention.py."""

import triton
import triton.language as tl

from kernels.triton_common import (
    attend_table_range,
    jit,
    let_next_kernel_start,
    merge_partials_block,
    wait_for_prior_kernel,
)


# Split counts, offsets and whether the merge is fused are runtime ints, exempt from Triton's specialisation on value;
# the group tables' pointers are exempt from alignment specialisation. All of these change with the batch's size, its
# groups and the longest context, and each new combination would be a compile of a second or more in the middle of
# serving (suspected cause of H100 W1 runs taking up to 3x their median: bench/results/; bench/kernel_variants.py).
@triton.jit
def prefix_slicing(prefix_len, step_splits, max_splits, PREFIX_BLOCK_N: tl.constexpr):
    """(slice length, live slices) of a prefix this step: the step's slice count step_splits (loaded from a device
    int the host sets from the real groups, so that a CUDA graph captured for padded bounds slices as finely as an
    eager step), at most the grid's max_splits, and no more slices than the prefix has BLOCK_N tiles."""
    splits = tl.maximum(tl.minimum(step_splits, max_splits), 1)
    slice_len = tl.cdiv(tl.cdiv(prefix_len, splits), PREFIX_BLOCK_N) * PREFIX_BLOCK_N
    live = tl.where(prefix_len > 0, tl.cdiv(prefix_len, tl.maximum(slice_len, 1)), 0)
    return slice_len, live


@triton.jit
def _fold_slice(m_i, l_i, acc, Lse_row, Part_rows, s, stride_mos, live, dim_ok):
    """Prefix slice s's normalised output and lse, a running state (lse, 1, out), folded into (m_i, l_i, acc). A
    slice that is not live loads lse -inf: weight 0 against the finite max of the request's own tokens."""
    lse = tl.load(Lse_row + s, mask=live, other=float("-inf"))
    part = tl.load(Part_rows + s * stride_mos, mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, lse)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(lse - m_new)
    return m_new, l_i * alpha + beta, acc * alpha[:, None] + part * beta[:, None]


@jit(
    do_not_specialize=["num_splits", "prefix_splits", "fused"],
    unaligned=["Req_pool_indices", "Seq_lens", "Suffix_start", "Prefix_splits"],
)
def _suffix_split_kernel(
    Q,
    K_cache,
    V_cache,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Suffix_start,
    Mid_o,
    Mid_lse,
    O,
    Prefix_splits,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    num_splits,
    prefix_splits,
    fused,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    FOLD_UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    # triton_attention's decode split kernel, shifted to start at the request's own tokens.
    # fused (one split only): the prefix kernel has already run, and this program folds the group's
    # prefix slices into its own running softmax and writes o itself: no merge launch, and the suffix
    # part never goes through memory. A runtime branch, not a constexpr: which path a step takes
    # follows its batch size, and one binary serves both.
    # A request's suffix starts where its group's prefix ends (0 outside any group), so Suffix_start is also the
    # length of the prefix whose slices a fused program folds in. Every load of metadata is issued here, together,
    # so that the fold after the loop waits on nothing but the slices themselves.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    first = tl.load(Suffix_start + req)
    seq_len = tl.load(Seq_lens + req)
    pool_row = tl.load(Req_pool_indices + req)
    step_prefix_splits = tl.load(Prefix_splits)
    own_len = seq_len - first
    split_len = tl.cdiv(tl.cdiv(own_len, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, first + own_len)
    if start >= end:
        wait_for_prior_kernel(PDL)
        return  # the merge recomputes these bounds and skips this split (never the one split of a fused step)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    head_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    table = Req_to_token + pool_row.to(tl.int64) * stride_rt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    m_i, l_i, acc = attend_table_range(
        q,
        m_i,
        l_i,
        acc,
        table,
        start,
        end,
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
    # Under PDL this kernel started beside the prefix kernel: the loop above read only the request's own tokens
    # and q (written before the prefix kernel began); what follows reads the prefix's slices or ends the kernel.
    wait_for_prior_kernel(PDL)
    let_next_kernel_start(PDL)

    if fused != 0:
        # The prefix kernel skipped the slices that start past the prefix; so do these loops. The first is unrolled
        # to FOLD_UNROLL slices (shared_prefix_attention.FOLD_UNROLL_SLICES), masked past the live ones, so that the
        # slices' loads, independent of each other, issue together instead of one round trip per slice; the second
        # takes any beyond.
        _, live_slices = prefix_slicing(first, step_prefix_splits, prefix_splits, PREFIX_BLOCK_N)
        lse_row = Mid_lse + req * stride_mlb + heads * stride_mlh
        part_rows = Mid_o + req * stride_mob + heads[:, None] * stride_moh + dims[None, :]
        for s in tl.static_range(FOLD_UNROLL):
            m_i, l_i, acc = _fold_slice(
                m_i,
                l_i,
                acc,
                lse_row,
                part_rows,
                s,
                stride_mos,
                head_ok & (tl.full([BLOCK_H], s, tl.int32) < live_slices),
                dim_ok,
            )
        for s in range(FOLD_UNROLL, live_slices):
            m_i, l_i, acc = _fold_slice(m_i, l_i, acc, lse_row, part_rows, s, stride_mos, head_ok, dim_ok)
        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        tl.store(
            O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out,
            mask=head_ok[:, None] & dim_ok[None, :],
        )
    else:
        out_ptr = Mid_o + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + dims[None, :]
        part = (acc / l_i[:, None]).to(Mid_o.dtype.element_ty)
        tl.store(out_ptr, part, mask=head_ok[:, None] & dim_ok[None, :])
        tl.store(Mid_lse + req * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=head_ok)


@jit(
    do_not_specialize=["first_split", "num_splits"],
    unaligned=[
        "Group_prefix_lens",
        "Group_prefix_rows",
        "Group_member_start",
        "Group_members",
        "Prefix_splits",
        "Live_groups",
    ],
)
def _prefix_kernel(
    Q,
    K_cache,
    V_cache,
    Req_to_token,
    Group_prefix_lens,
    Group_prefix_rows,
    Group_member_start,
    Group_members,
    Prefix_splits,
    Live_groups,
    Mid_o,
    Mid_lse,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    first_split,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # q comes from the kernel before. Once that is done, the suffix kernel may start: it reads nothing this kernel
    # writes until it has waited for it, and q and the own tokens' KV are complete by then. (Asking L2 for the first
    # tiles of each program's first item before the wait measured no faster: bench/results/session25-h200.md.)
    wait_for_prior_kernel(PDL)
    let_next_kernel_start(PDL)
    # Work items are (group, KV head, slice) of the step's live groups (the table's first Live_groups entries: the
    # rest pads a CUDA graph's table) and its slice count, walked by a fixed number of programs, item after item.
    # A grid of one program per padded item instead made a CUDA graph's step dispatch thousands of programs that
    # exit at once, and held the suffix kernel's start (PDL) until the last of them had run. Measured on an H200 in
    # a decode-step-like graph (bench/results/prefix-items-h200.md): Qwen3-8B gsp attention 143.7 -> 133.2 us a
    # layer, W1 53.7 -> 51.5; Qwen3-0.6B W1 55.1 -> 53.0.
    # A group with more rows than one tile walks its row blocks in turn, the second finding the slice's K/V in L2.
    step_splits = tl.maximum(tl.minimum(tl.load(Prefix_splits), num_splits), 1)
    num_items = tl.load(Live_groups) * NUM_KV_HEADS * step_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        split = item % step_splits
        group = item // step_splits // NUM_KV_HEADS
        kv_head = item // step_splits % NUM_KV_HEADS
        # The group's metadata in one round trip (independent loads, issued before any of them is used).
        member0 = tl.load(Group_member_start + group)
        member_end = tl.load(Group_member_start + group + 1)
        prefix_len = tl.load(Group_prefix_lens + group)
        prefix_row = tl.load(Group_prefix_rows + group)
        num_rows = (member_end - member0) * GROUP
        split_len, live = prefix_slicing(prefix_len, step_splits, num_splits, BLOCK_N)
        if num_rows > 0 and split < live:  # else an empty group, or a slice past a short prefix's end
            start = split * split_len
            end = tl.minimum(start + split_len, prefix_len)
            table = Req_to_token + prefix_row.to(tl.int64) * stride_rt
            slot = first_split + split
            for first_row in range(0, num_rows, BLOCK_M):
                # Row r of the tile is query head (r % GROUP) of this KV head, for member (r // GROUP).
                rows = first_row + tl.arange(0, BLOCK_M)
                row_ok = rows < num_rows
                reqs = tl.load(Group_members + member0 + rows // GROUP, mask=row_ok, other=0).to(tl.int64)
                heads = kv_head * GROUP + rows % GROUP
                q = tl.load(
                    Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0,
                )
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
                    end,
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
                out_ptr = (
                    Mid_o + reqs[:, None] * stride_mob + heads[:, None] * stride_moh + slot * stride_mos + dims[None, :]
                )
                out = (acc / l_i[:, None]).to(Mid_o.dtype.element_ty)
                tl.store(out_ptr, out, mask=row_ok[:, None] & dim_ok[None, :])
                tl.store(Mid_lse + reqs * stride_mlb + heads * stride_mlh + slot, m_i + tl.log2(l_i), mask=row_ok)


@jit(
    do_not_specialize=["suffix_splits", "prefix_splits"],
    unaligned=["Seq_lens", "Suffix_start", "Prefix_splits"],
)
def _merge_kernel(
    Mid_o,
    Mid_lse,
    O,
    Seq_lens,
    Suffix_start,
    Prefix_splits,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    suffix_splits,
    prefix_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUFFIX_BLOCK_N: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    # One log-sum-exp reduction over the suffix splits and the group's prefix slices together, BLOCK_S at a time.
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)
    # As in the suffix kernel, the suffix's start is the group's prefix length (0 outside any group).
    req = tl.program_id(0)
    head = tl.program_id(1)
    prefix_len = tl.load(Suffix_start + req)
    own_len = tl.load(Seq_lens + req) - prefix_len
    step_prefix_splits = tl.load(Prefix_splits)

    suffix_split_len = tl.cdiv(tl.cdiv(own_len, suffix_splits), SUFFIX_BLOCK_N) * SUFFIX_BLOCK_N
    _, prefix_live = prefix_slicing(prefix_len, step_prefix_splits, prefix_splits, PREFIX_BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse_base = Mid_lse + req * stride_mlb + head * stride_mlh
    part_base = Mid_o + req * stride_mob + head * stride_moh
    # Suffix split 0 is never empty (own_len >= 1), so the running max is finite after the first tile.
    m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, suffix_splits + prefix_splits, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        live = tl.where(
            splits < suffix_splits, splits * suffix_split_len < own_len, splits - suffix_splits < prefix_live
        )
        m_i, l_i, acc = merge_partials_block(lse_base, part_base, stride_mos, splits, live, dims, dim_ok, m_i, l_i, acc)
    tl.store(O + req * stride_ob + head * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty), mask=dim_ok)
