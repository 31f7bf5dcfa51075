"""Decode attention that reads each shared prefix once per step (cascade attention), in Triton.

When many decoding requests share a system prompt, the plain decode kernel reads that prompt's K/V
once per request. Here the batch is described as G groups: a group is >= 1 requests whose first
P_g context positions are the same KV slots (the radix cache hands every such request the same
slots). Its prefix is attended by all members together and the rest of each request alone:

1. prefix kernel. One program = one group x one KV head x one slice of the prefix, walking the
   group's rows BLOCK_M at a time. The rows are the group's members times the query heads of that
   KV head (GQA), so a tile is a small prefill-shaped problem (tiled like the extend kernel) and
   each prefix K/V row is read once per group instead of once per member. The prefix is split along
   its length when groups are few, so that the SMs fill up: the step's slice count is a device int
   the host sets from the real groups (group_prefix_splits), so a CUDA graph captured for padded
   bounds slices as an eager step would. Each slice writes a softmax-normalised partial output and
   its log-sum-exp per query row.
2. suffix kernel. The split-KV decode kernel over each request's own positions only,
   [suffix_start, seq_len): suffix_start is P_g for a member, 0 for an ungrouped request (which
   then gets exactly the plain decode computation).
3. merge by log-sum-exp, fused when it can be. In a large batch the suffix takes one split per
   (request, KV head) and the prefix kernel runs first: the suffix program then folds the group's
   prefix slices into its own running softmax and writes o, so neither a merge launch nor the
   suffix partials touch memory. Otherwise (few requests, long own contexts) both kernels write
   partials into one scratch buffer, suffix splits first, and the decode kernel's log-sum-exp
   reduction merges all of them in one pass.

Inputs beside the plain decode kernel's (all int32, on the device):
  group_prefix_lens [G]     P_g, the length of group g's shared prefix
  group_prefix_rows [G]     the req_to_token row its prefix slots are read from (any member's row)
  group_member_start [G+1]  members of group g are group_members[group_member_start[g]:...[g+1]]
  group_members [M]         batch indices; members need not be contiguous in the batch
  req_group [B]             the group of each request, -1 for none (consistent with group_members)
  req_suffix_start [B]      P_g of its group, or 0; must be < seq_len (the new token is its own)
  prefix_splits [1]         (optional) the slices per prefix this step, at most num_prefix_splits
Host ints size the grids without a device sync: max_seq_len bounds every suffix, max_prefix_len
every P_g, max_group_size every group. Under CUDA graphs pass fixed bounds and pad the group table
with empty groups (equal member_start entries): their programs exit at once.

Precision and block policy follow triton_attention (fp32 accumulation, IEEE dots for fp32).
"""

import torch
import triton
import triton.language as tl

from kernels import triton_attention
from kernels.triton_common import (LOG2E, MERGE_BLOCK_S, assert_last_dim_contiguous, attend_table_range,
                                   dot_precision, jit, merge_partials_block, power_of_two_at_most, sm_count,
                                   split_capacity)


# Split counts, offsets and whether the merge is fused are runtime ints, exempt from Triton's specialisation on value;
# the group tables' pointers are exempt from alignment specialisation. All of these change with the batch's size, its
# groups and the longest context, and each new combination would be a compile of a second or more in the middle of
# serving (suspected cause of H100 W1 runs taking up to 3x their median: bench/results/; bench/kernel_variants.py).
@triton.jit
def prefix_slicing(prefix_len, Prefix_splits, max_splits, PREFIX_BLOCK_N: tl.constexpr):
    """(slice length, live slices) of a prefix this step: the step's slice count (a device int the host sets from
    the real groups, so that a CUDA graph captured for padded bounds slices as finely as an eager step), at most the
    grid's max_splits, and no more slices than the prefix has BLOCK_N tiles."""
    splits = tl.maximum(tl.minimum(tl.load(Prefix_splits), max_splits), 1)
    slice_len = tl.cdiv(tl.cdiv(prefix_len, splits), PREFIX_BLOCK_N) * PREFIX_BLOCK_N
    live = tl.where(prefix_len > 0, tl.cdiv(prefix_len, tl.maximum(slice_len, 1)), 0)
    return slice_len, live


@triton.jit
def _fold_slice(m_i, l_i, acc, Lse_row, Part_rows, s, stride_mos, live, dim_ok):
    """Prefix slice s's normalised output and lse, a running state (lse, 1, out), folded into (m_i, l_i, acc). A
    slice that is not live loads lse -inf: weight 0 against the finite max of the request's own tokens."""
    lse = tl.load(Lse_row + s, mask=live, other=float("-inf"))
    part = tl.load(Part_rows + s * stride_mos, mask=live[:, None] & dim_ok[None, :], other=0.0)
    m_new = tl.maximum(m_i, lse)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(lse - m_new)
    return m_new, l_i * alpha + beta, acc * alpha[:, None] + part * beta[:, None]


@jit(do_not_specialize=["num_splits", "prefix_splits", "fused"],
     unaligned=["Req_pool_indices", "Seq_lens", "Suffix_start", "Req_group", "Group_prefix_lens", "Prefix_splits"])
def _suffix_split_kernel(Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Suffix_start,
                         Mid_o, Mid_lse, O, Req_group, Group_prefix_lens, Prefix_splits, qk_scale,
                         stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
                         stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                         num_splits, prefix_splits, fused,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr,
                         MAX_PREFIX_SPLITS: tl.constexpr):
    # triton_attention's decode split kernel, shifted to start at the request's own tokens.
    # fused (one split only): the prefix kernel has already run, and this program folds the group's
    # prefix slices into its own running softmax and writes o itself: no merge launch, and the suffix
    # part never goes through memory. A runtime branch, not a constexpr: which path a step takes
    # follows its batch size, and one binary serves both.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    first = tl.load(Suffix_start + req)
    own_len = tl.load(Seq_lens + req) - first
    split_len = tl.cdiv(tl.cdiv(own_len, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, first + own_len)
    if start >= end:
        return  # the merge recomputes these bounds and skips this split (never the one split of a fused step)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    head_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    table = Req_to_token + tl.load(Req_pool_indices + req).to(tl.int64) * stride_rt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    m_i, l_i, acc = attend_table_range(q, m_i, l_i, acc, table, start, end, K_cache + kv_head * stride_kh,
                                       V_cache + kv_head * stride_vh, stride_kn, stride_vn, dims, dim_ok, qk_scale,
                                       BLOCK_N, EVEN_D, DOT_PRECISION)

    if fused != 0:
        group = tl.load(Req_group + req)
        prefix_len = tl.load(Group_prefix_lens + tl.maximum(group, 0))
        prefix_len = tl.where(group >= 0, prefix_len, 0)
        # The prefix kernel skipped the slices that start past the prefix; so do these loops. The first is unrolled
        # to the most slices a serving step has, masked past the live ones, so that the slices' loads, independent
        # of each other, issue together instead of one round trip per slice; the second takes any beyond.
        _, live_slices = prefix_slicing(prefix_len, Prefix_splits, prefix_splits, PREFIX_BLOCK_N)
        lse_row = Mid_lse + req * stride_mlb + heads * stride_mlh
        part_rows = Mid_o + req * stride_mob + heads[:, None] * stride_moh + dims[None, :]
        for s in tl.static_range(MAX_PREFIX_SPLITS):
            m_i, l_i, acc = _fold_slice(m_i, l_i, acc, lse_row, part_rows, s, stride_mos,
                                        head_ok & (tl.full([BLOCK_H], s, tl.int32) < live_slices), dim_ok)
        for s in range(MAX_PREFIX_SPLITS, live_slices):
            m_i, l_i, acc = _fold_slice(m_i, l_i, acc, lse_row, part_rows, s, stride_mos, head_ok, dim_ok)
        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        tl.store(O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :], out,
                 mask=head_ok[:, None] & dim_ok[None, :])
    else:
        out_ptr = Mid_o + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos + dims[None, :]
        tl.store(out_ptr, acc / l_i[:, None], mask=head_ok[:, None] & dim_ok[None, :])
        tl.store(Mid_lse + req * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=head_ok)


@jit(do_not_specialize=["first_split", "num_splits"],
     unaligned=["Group_prefix_lens", "Group_prefix_rows", "Group_member_start", "Group_members", "Prefix_splits"])
def _prefix_kernel(Q, K_cache, V_cache, Req_to_token, Group_prefix_lens, Group_prefix_rows, Group_member_start,
                   Group_members, Prefix_splits, Mid_o, Mid_lse, qk_scale,
                   stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
                   stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, first_split, num_splits,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    # One program per (group, KV head, slice); a group with more rows than one tile walks its row blocks in turn,
    # the second finding the slice's K/V in L2. The grid is sized by group count and slices alone, so the padding
    # of a CUDA graph's table (empty groups, a group-size bound of the whole batch) costs one early exit per group
    # and slice, not per row block as well.
    group = tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    split = tl.program_id(1)

    member0 = tl.load(Group_member_start + group)
    num_rows = (tl.load(Group_member_start + group + 1) - member0) * GROUP
    if num_rows == 0:
        return  # a padding group
    prefix_len = tl.load(Group_prefix_lens + group)
    split_len, live = prefix_slicing(prefix_len, Prefix_splits, num_splits, BLOCK_N)
    if split >= live:
        return
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    table = Req_to_token + tl.load(Group_prefix_rows + group).to(tl.int64) * stride_rt
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    slot = first_split + split
    for first_row in range(0, num_rows, BLOCK_M):
        # Row r of the tile is query head (r % GROUP) of this KV head, for member (r // GROUP).
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        reqs = tl.load(Group_members + member0 + rows // GROUP, mask=row_ok, other=0).to(tl.int64)
        heads = kv_head * GROUP + rows % GROUP
        q = tl.load(Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        m_i, l_i, acc = attend_table_range(q, m_i, l_i, acc, table, start, end, K_cache + kv_head * stride_kh,
                                           V_cache + kv_head * stride_vh, stride_kn, stride_vn, dims, dim_ok,
                                           qk_scale, BLOCK_N, EVEN_D, DOT_PRECISION)
        out_ptr = (Mid_o + reqs[:, None] * stride_mob + heads[:, None] * stride_moh + slot * stride_mos
                   + dims[None, :])
        tl.store(out_ptr, acc / l_i[:, None], mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(Mid_lse + reqs * stride_mlb + heads * stride_mlh + slot, m_i + tl.log2(l_i), mask=row_ok)


@jit(do_not_specialize=["suffix_splits", "prefix_splits"],
     unaligned=["Seq_lens", "Suffix_start", "Req_group", "Group_prefix_lens", "Prefix_splits"])
def _merge_kernel(Mid_o, Mid_lse, O, Seq_lens, Suffix_start, Req_group, Group_prefix_lens, Prefix_splits,
                  stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                  suffix_splits, prefix_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  SUFFIX_BLOCK_N: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr):
    # One log-sum-exp reduction over the suffix splits and the group's prefix slices together, BLOCK_S at a time.
    req = tl.program_id(0)
    head = tl.program_id(1)
    own_len = tl.load(Seq_lens + req) - tl.load(Suffix_start + req)
    group = tl.load(Req_group + req)
    prefix_len = tl.load(Group_prefix_lens + tl.maximum(group, 0))
    prefix_len = tl.where(group >= 0, prefix_len, 0)

    suffix_split_len = tl.cdiv(tl.cdiv(own_len, suffix_splits), SUFFIX_BLOCK_N) * SUFFIX_BLOCK_N
    _, prefix_live = prefix_slicing(prefix_len, Prefix_splits, prefix_splits, PREFIX_BLOCK_N)
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
        live = tl.where(splits < suffix_splits, splits * suffix_split_len < own_len,
                        splits - suffix_splits < prefix_live)
        m_i, l_i, acc = merge_partials_block(lse_base, part_base, stride_mos, splits, live, dims, dim_ok,
                                             m_i, l_i, acc)
    tl.store(O + req * stride_ob + head * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty), mask=dim_ok)


# The prefix tile is a prefill tile with few rows. Its BLOCK_M is the same for every group size: sized to the
# rows of the batch's largest group (members x GQA heads), each size class met mid-run was a compile there
# (bench/kernel_variants.py), while the rows a small group leaves empty cost MMA work that a memory-bound tile hides
# (estimated on an H100: a 64 x 64 x 128 bf16 tile is ~0.3-0.5 us of MMA per SM, streaming its 32 KB of K/V ~1.3 us).
# 16-bit values and the 512-token slices below come from the sweep of bench/shared_prefix_kernel_bench.py --tune on
# an H100 (bench/results/shared-prefix-kernel-h100.md): fewer, longer slices halve the partials written and read.
PREFIX_CONFIG = {
    "16bit": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    "fp32": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
    "interpret": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}
# Prefix slices: enough programs for a few per SM, never slices shorter than min_split_tokens, at most max_splits (the
# grid's slice dimension under a CUDA graph, where most programs of a padded table exit at once).
PREFIX_SPLITS = {"programs_per_sm": 4, "min_split_tokens": 512, "max_splits": 8}


def prefix_config(dtype, device):
    if device.type != "cuda":
        return PREFIX_CONFIG["interpret"]
    return PREFIX_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


def prefix_num_splits(num_groups, num_kv_heads, m_blocks, max_prefix_len, device):
    cfg = PREFIX_SPLITS
    target = cfg["programs_per_sm"] * sm_count(device)
    splits = triton.cdiv(target, max(1, num_groups * num_kv_heads * m_blocks))
    splits = min(splits, triton.cdiv(max(1, max_prefix_len), cfg["min_split_tokens"]), cfg["max_splits"])
    return power_of_two_at_most(splits)


def prefix_slices(num_groups, max_group_size, max_prefix_len, num_q_heads, num_kv_heads, dtype, device):
    """How many slices each prefix is cut into in a step of these real bounds: the host's choice, which the group
    table carries to the kernels (forward_context.pack_decode_groups)."""
    m_blocks = triton.cdiv(max(1, max_group_size * (num_q_heads // num_kv_heads)),
                           prefix_config(dtype, device)["BLOCK_M"])
    return prefix_num_splits(num_groups, num_kv_heads, m_blocks, max_prefix_len, device)


def prefix_slices_bound(max_prefix_len):
    """Room for any step's slice count under this prefix bound: the grid's slice dimension for a CUDA graph."""
    cfg = PREFIX_SPLITS
    return power_of_two_at_most(min(cfg["max_splits"], triton.cdiv(max(1, max_prefix_len), cfg["min_split_tokens"])))


def decode_attention_grouped(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens,
                             group_prefix_lens, group_prefix_rows, group_member_start, group_members,
                             req_group, req_suffix_start, sm_scale, max_seq_len, max_prefix_len, max_group_size,
                             num_suffix_splits=None, num_prefix_splits=None, fuse_merge=None, config=None,
                             prefix_splits=None):
    """fuse_merge (default: whenever the suffix takes one split) merges inside the suffix kernel. prefix_splits: the
    step's slice count as a device int32 [1] (the group table's; default num_prefix_splits, or the policy's for these
    bounds); num_prefix_splits then bounds it (the grid's slice dimension)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    num_groups = group_prefix_lens.shape[0]
    if bsz == 0:
        return
    if num_groups == 0:  # nothing shared: today's kernel, at today's cost
        triton_attention.decode_attention(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens,
                                          sm_scale, max_seq_len)
        return
    assert_last_dim_contiguous(q, k_cache, v_cache, o)
    assert req_to_token.stride(1) == 1
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    precision = dot_precision(q.dtype)
    suffix_cfg = triton_attention.decode_config(q.dtype, q.device)
    pcfg = dict(prefix_config(q.dtype, q.device), **(config or {}))
    m_blocks = triton.cdiv(max(1, max_group_size * group), pcfg["BLOCK_M"])
    s_splits = num_suffix_splits or triton_attention.decode_num_splits(bsz, hkv, max_seq_len, q.device)
    p_splits = num_prefix_splits or prefix_num_splits(num_groups, hkv, m_blocks, max_prefix_len, q.device)
    if prefix_splits is None:
        prefix_splits = torch.full((1,), p_splits, dtype=torch.int32, device=q.device)
    fused = s_splits == 1 if fuse_merge is None else fuse_merge
    assert not fused or s_splits == 1, "the merge fuses into the suffix kernel only when it takes one split"
    first_prefix_split = 0 if fused else s_splits
    total = first_prefix_split + p_splits

    mid_o = torch.empty((bsz, hq, total, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, hq, split_capacity(total)), dtype=torch.float32, device=q.device)
    mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    qk_scale = sm_scale * LOG2E

    # The prefix goes first: a fused suffix kernel reads its slices.
    _prefix_kernel[(num_groups * hkv, p_splits)](
        q, k_cache, v_cache, req_to_token, group_prefix_lens, group_prefix_rows, group_member_start,
        group_members, prefix_splits, mid_o, mid_lse, qk_scale,
        q.stride(0), q.stride(1), *cache_strides, req_to_token.stride(0), *mid_strides, first_prefix_split, p_splits,
        NUM_KV_HEADS=hkv, GROUP=group, HEAD_DIM=d,
        BLOCK_M=pcfg["BLOCK_M"], BLOCK_D=block_d, BLOCK_N=pcfg["BLOCK_N"], DOT_PRECISION=precision,
        num_warps=pcfg["num_warps"], num_stages=pcfg["num_stages"],
    )
    _suffix_split_kernel[(bsz, hkv, s_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, req_suffix_start, mid_o, mid_lse,
        o, req_group, group_prefix_lens, prefix_splits, qk_scale,
        q.stride(0), q.stride(1), *cache_strides, req_to_token.stride(0), *mid_strides, o.stride(0), o.stride(1),
        s_splits, p_splits, int(fused), GROUP=group, HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=suffix_cfg["BLOCK_N"],
        DOT_PRECISION=precision, PREFIX_BLOCK_N=pcfg["BLOCK_N"], MAX_PREFIX_SPLITS=PREFIX_SPLITS["max_splits"],
        num_warps=suffix_cfg["num_warps"], num_stages=suffix_cfg["num_stages"],
    )
    if fused:
        return
    _merge_kernel[(bsz, hq)](
        mid_o, mid_lse, o, seq_lens, req_suffix_start, req_group, group_prefix_lens, prefix_splits,
        *mid_strides, o.stride(0), o.stride(1), s_splits, p_splits,
        HEAD_DIM=d, BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d, SUFFIX_BLOCK_N=suffix_cfg["BLOCK_N"],
        PREFIX_BLOCK_N=pcfg["BLOCK_N"],
        num_warps=1 if block_d <= 64 else 2,
    )
