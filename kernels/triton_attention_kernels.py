"""The device side of kernels/triton_attention.py: the split-KV decode kernels (a split's partial, then the merge of a
row's partials, which the extend kernel's key splits use too) and the extend kernel (a prefix through req_to_token,
then causal over the new tokens). The launches, block configs and split policy are in triton_attention.py; what the
kernels share is in kernels/triton_common.py."""

import triton
import triton.language as tl

from kernels.triton_common import (
    attend_table_range,
    jit,
    let_next_kernel_start,
    load_rows,
    merge_partials_block,
    online_softmax_block,
    prefetch_kv_rows,
    wait_for_prior_kernel,
)
from kernels.triton_qkv import rotated_heads


@triton.jit
def decode_slicing(seq_len, num_splits, min_splits, MIN_SPLIT_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(slice length, live slices) of one request's context of seq_len tokens: slices of about MIN_SPLIT_TOKENS, but
    at least min_splits of them (enough programs to fill the device once) and at most num_splits (the grid's), each
    whole BLOCK_N blocks but the last. The grid is sized for the longest context a CUDA graph may meet, so most of it
    is dead at short contexts; live slices of a few blocks each are what keeps a short context fast."""
    want = tl.minimum(tl.maximum(tl.cdiv(seq_len, MIN_SPLIT_TOKENS), min_splits), num_splits)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, want), BLOCK_N), 1) * BLOCK_N
    return split_len, tl.cdiv(seq_len, split_len)


# The split counts are runtime ints: they follow the batch size and the longest context, and constexprs here made
# every new pair a compile in the middle of serving (bench/kernel_variants.py).
@jit(do_not_specialize=["num_splits", "min_splits"], unaligned=["Req_pool_indices", "Seq_lens", "Positions", "Loc"])
def _decode_split_kernel(
    Q,
    K_cache,
    V_cache,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_o,
    Mid_lse,
    O,
    K_new,
    V_new,
    Positions,
    Cos_sin,
    Q_weight,
    K_weight,
    Loc,
    qk_scale,
    eps,
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
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cs,
    num_splits,
    min_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    PREPARE_QKV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program = one request x one KV head x one slice of the context. All query heads of the KV
    # head ride along as the rows of the dot, so each K/V row is read from memory once per group.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The step's lengths and table predate the kernel before (which writes q and the new token's K/V), and so does
    # the KV of every earlier token: the bounds are read, and the first block's K/V rows asked of L2, before the wait.
    seq_len = tl.load(Seq_lens + req)
    pool_row = tl.load(Req_pool_indices + req)
    split_len, _ = decode_slicing(seq_len, num_splits, min_splits, MIN_SPLIT_TOKENS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:  # past the context: the merge recomputes these bounds and skips this split
        # A dead program ends at once, without waiting for the kernel before (PDL: triton_common.py): it reads and
        # writes nothing, and its request's split 0 waits (below, or here for a graph's padding row of no context),
        # so this kernel still ends after that one.
        if split == 0:
            wait_for_prior_kernel(PDL)
        return
    table = Req_to_token + pool_row.to(tl.int64) * stride_rt
    if PREFETCH:
        row_bytes: tl.constexpr = HEAD_DIM * K_cache.dtype.element_ty.primitive_bitwidth // 8
        prefetch_kv_rows(
            table, start, end, K_cache, V_cache, kv_head, stride_kh, stride_vh, stride_kn, stride_vn, BLOCK_N, row_bytes
        )
    wait_for_prior_kernel(PDL)
    let_next_kernel_start(PDL)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    head_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    if PREPARE_QKV:
        # Q and the new token's K/V come straight from the QKV projection: what kernels/triton_qkv.py would do to them
        # (per-head norm, RoPE, the K/V store) happens here, so that a decode step launches no kernel for it. Every
        # program rotates its group's Q rows itself; the program whose slice ends the context stores the new token's
        # K/V into their slot, and a barrier later its own loop reads them back with the rest of its slice (a CTA's
        # global stores are visible to its threads after bar.sync; no other program reads that slot in this launch).
        cos_sin = Cos_sin + tl.load(Positions + req).to(tl.int64) * stride_cs
        q_row = Q + req * stride_qb
        q = rotated_heads(q_row, heads, head_ok, stride_qh, dims, Q_weight, eps, cos_sin, HAS_NORM, HALF, HEAD_DIM)
        if end == seq_len:
            new_head = tl.full([1], 0, tl.int32) + kv_head
            k_row = K_new + req * stride_knb
            k = rotated_heads(
                k_row, new_head, new_head >= 0, stride_knh, dims, K_weight, eps, cos_sin, HAS_NORM, HALF, HEAD_DIM
            )
            v = tl.load(V_new + req * stride_vnb + new_head[:, None] * stride_vnh + dims[None, :], mask=dim_ok[None, :])
            slot = tl.load(Loc + req).to(tl.int64)
            tl.store(
                K_cache + slot * stride_kn + new_head[:, None] * stride_kh + dims[None, :],
                k.to(K_cache.dtype.element_ty),
                mask=dim_ok[None, :],
            )
            tl.store(
                V_cache + slot * stride_vn + new_head[:, None] * stride_vh + dims[None, :],
                v.to(V_cache.dtype.element_ty),
                mask=dim_ok[None, :],
            )
        tl.debug_barrier()
    else:
        q = tl.load(
            Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )

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
    if num_splits == 1:  # the whole context in this program: the output directly, no partials and no merge launch
        tl.store(
            O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            (acc / l_i[:, None]).to(O.dtype.element_ty),
            mask=head_ok[:, None] & dim_ok[None, :],
        )
        return
    out_ptr = Mid_o + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + dims[None, :]
    tl.store(out_ptr, acc / l_i[:, None], mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(Mid_lse + req * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=head_ok)


@jit(do_not_specialize=["num_splits", "min_splits"], unaligned=["Seq_lens"])
def _merge_splits_kernel(
    Mid_o,
    Mid_lse,
    O,
    Seq_lens,
    stride_mor,
    stride_moh,
    stride_mos,
    stride_mlr,
    stride_mlh,
    stride_or,
    stride_oh,
    num_splits,
    min_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    """O[row, head] from the num_splits partials of a split kernel, for both split kernels of this module. A row is
    a request of _decode_split_kernel: given its Seq_lens, the splits that start past its context were never written
    and stay out. Or a token of _extend_kernel (Seq_lens None): every split wrote its partial, empty ones with an
    lse of -inf, and the last is never empty. Rows of a CUDA graph's padding were never written: what lands in their
    O is never read."""
    wait_for_prior_kernel(PDL)  # kernels launched with PDL: triton_common.py
    let_next_kernel_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    live_splits = num_splits
    if Seq_lens is not None:  # the decode kernel's slicing
        _, live_splits = decode_slicing(tl.load(Seq_lens + row), num_splits, min_splits, MIN_SPLIT_TOKENS, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse_base = Mid_lse + row * stride_mlr + head * stride_mlh
    part_base = Mid_o + row * stride_mor + head * stride_moh
    # Split 0 (decode: seq_len >= 1) or the last (extend) is live, so the running max is finite once merged.
    m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, live_splits, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        m_i, l_i, acc = merge_partials_block(
            lse_base, part_base, stride_mos, splits, splits < live_splits, dims, dim_ok, m_i, l_i, acc
        )
    tl.store(O + row * stride_or + head * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty), mask=dim_ok)


# num_m_blocks (the longest extend of the batch in row blocks) and num_splits are runtime ints: specialised, a value
# of 1 or a multiple of 16 made a variant of its own, met or not according to the batch's makeup.
@jit(do_not_specialize=["num_m_blocks", "num_splits"])
def _extend_kernel(
    Q,
    K,
    V,
    O,
    Mid_o,
    Mid_lse,
    K_cache,
    V_cache,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    qk_scale,
    num_m_blocks,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kcn,
    stride_kch,
    stride_vcn,
    stride_vch,
    stride_rt,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlt,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program = one KV head x BLOCK_M // GROUP new tokens of one request, for all GROUP query heads that read
    # that KV head: its BLOCK_M query rows are (token, head) pairs, token-major, so each K/V block it gathers serves
    # the whole group in one tensor-core tile (read once, not GROUP times) and a short chunk (a cache hit's few new
    # tokens) still fills the tile. KV heads vary fastest in launch order, so the programs in flight together share
    # one request's K/V and find it in L2; the last row blocks (which see the most keys) are launched first so no
    # long program is left for the tail.
    # With num_splits > 1 (a grid too small to fill the device: a lone cache hit's few row blocks), num_splits programs
    # share a row block: each takes one slice of the keys before the block and writes a softmax-normalised partial
    # and its log-sum-exp; the last also takes the block's own tokens, so its softmax is never empty, and
    # _merge_splits_kernel folds the partials into O.
    kv_head = tl.program_id(0)
    m_block = num_m_blocks - 1 - tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    req = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # the host makes BLOCK_M >= GROUP

    extend_len = tl.load(Extend_lens + req)
    first_tok = m_block * TOKENS
    if first_tok >= extend_len:
        return  # the grid is sized for the longest request of the batch
    prefix_len = tl.load(Prefix_lens + req)
    token0 = tl.load(Extend_start + req).to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // GROUP  # the new token of each query row (rows past TOKENS * GROUP are padding)
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < extend_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    q_ptrs = Q + (token0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) Everything strictly before this block's first token: the cached prefix and the earlier new tokens, all
    #    visible to every row. store_kv already put the new tokens' K/V into the cache, so one gather through the
    #    table covers both. Whole blocks go unmasked; the ragged tail gets a mask.
    table = Req_to_token + tl.load(Req_pool_indices + req).to(tl.int64) * stride_rt
    seen = prefix_len + first_tok
    slice_len = tl.cdiv(tl.cdiv(seen, num_splits), BLOCK_N) * BLOCK_N  # whole blocks but the last slice's tail
    m_i, l_i, acc = attend_table_range(
        q,
        m_i,
        l_i,
        acc,
        table,
        tl.minimum(split * slice_len, seen),
        tl.minimum((split + 1) * slice_len, seen),
        K_cache + kv_head * stride_kch,
        V_cache + kv_head * stride_vch,
        stride_kcn,
        stride_vcn,
        dims,
        dim_ok,
        qk_scale,
        BLOCK_N,
        EVEN_D,
        DOT_PRECISION,
    )

    # 2) The block's own tokens, read from k/v directly: causal mask, and the request's last block may be ragged.
    #    Every row sees at least the block's first token, so no row's softmax is empty.
    k_new = K + token0 * stride_kt + kv_head * stride_kh
    v_new = V + token0 * stride_vt + kv_head * stride_vh
    diag_end = tl.minimum(first_tok + TOKENS, extend_len)
    if split < num_splits - 1:
        diag_end = first_tok  # the last split's work
    for n0 in range(first_tok, diag_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < diag_end
        k = load_rows(k_new, pos, stride_kt, dims, pos_ok, dim_ok, True, EVEN_D)
        v = load_rows(v_new, pos, stride_vt, dims, pos_ok, dim_ok, True, EVEN_D)
        causal = (pos[None, :] <= tok[:, None]) & pos_ok[None, :]
        m_i, l_i, acc = online_softmax_block(q, k, v, causal, m_i, l_i, acc, qk_scale, True, DOT_PRECISION)

    if num_splits == 1:
        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        o_ptrs = O + (token0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # An empty slice (a short prefix cut in many) leaves l_i = 0: its partial is 0 with a log-sum-exp of -inf,
        # which weighs nothing in the merge.
        live = l_i > 0
        part = tl.where(live[:, None], acc / tl.where(live, l_i, 1.0)[:, None], 0.0)
        rows = (token0 + tok).to(tl.int64)
        part_ptrs = Mid_o + rows[:, None] * stride_mot + head[:, None] * stride_moh + split * stride_mos + dims[None, :]
        tl.store(part_ptrs, part, mask=row_ok[:, None] & dim_ok[None, :])
        lse = tl.where(live, m_i + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
        tl.store(Mid_lse + rows * stride_mlt + head * stride_mlh + split, lse, mask=row_ok)
