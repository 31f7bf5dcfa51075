"""Decode attention that reads each shared prefix once per step (cascade attention), in Triton.

When many decoding requests share a system prompt, the plain decode kernel reads that prompt's K/V
once per request. Here the batch is described as G groups: a group is >= 1 requests whose first
P_g context positions are the same KV slots (the radix cache hands every such request the same
slots). Its prefix is attended by all members together and the rest of each request alone:

1. prefix kernel. One work item = one group x one KV head x one slice of the prefix, walking the
   group's rows BLOCK_M at a time; a fixed number of programs walk the step's live items
   (prefix_programs). The rows are the group's members times the query heads of that
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
  live_groups [1]           (optional) how many of the table's groups are real: those past it are padding
Host ints size the grids without a device sync: max_seq_len bounds every suffix, max_prefix_len
every P_g, max_group_size every group. Under CUDA graphs pass fixed bounds and pad the group table
with empty groups (equal member_start entries) after the live ones: no program visits them.

Precision and block policy follow triton_attention (fp32 accumulation, IEEE dots for fp32). This module holds the
launches and their policy; the kernels are in kernels/shared_prefix_kernels.py.
"""

import torch
import triton

import kernels
from kernels.launch_replay import recordable
from kernels import triton_attention
from kernels.shared_prefix_kernels import _merge_kernel, _prefix_kernel, _suffix_split_kernel
from kernels.triton_common import (
    LOG2E,
    MERGE_BLOCK_S,
    assert_last_dim_contiguous,
    dot_precision,
    pdl_args,
    power_of_two_at_most,
    sm_count,
    split_capacity,
)


# The prefix tile is a prefill tile with few rows. Its BLOCK_M is the same for every group size: sized to the
# rows of the batch's largest group (members x GQA heads), each size class met mid-run was a compile there
# (bench/kernel_variants.py), while the rows a small group leaves empty cost MMA work that a memory-bound tile hides
# (estimated on an H100: a 64 x 64 x 128 bf16 tile is ~0.3-0.5 us of MMA per SM, streaming its 32 KB of K/V ~1.3 us).
# The 16-bit blocks, the slices, the partials' dtype and the suffix's blocks below come from
# `python -m bench.shared_prefix_tune` on an H100 (bench/results/shared-prefix-tune-h100.md; W1 and gsp geometries,
# Qwen3-8B and -0.6B attention shapes, padded as a decode graph runs them): W1 8B 67.3 -> 57-59 us a layer.
PREFIX_CONFIG = {
    "16bit": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    "fp32": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
    "interpret": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}
# The suffix kernel's blocks: the plain decode kernel's (triton_attention.DECODE_CONFIG), with these overrides by
# dtype class ("16bit", "fp32"). A suffix is a request's own tokens, often far shorter than a plain decode's context:
# short programs are latency-bound, and the smallest tiles keep the most of them in flight per SM (W1's 128 own
# tokens: 38.9 -> 34.0 us for 8B; as fast as the default from 512 own tokens up, 97% of copy bandwidth at 4,096).
SUFFIX_CONFIG = {"16bit": {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2}, "fp32": {}}
# The dtype of the partial outputs that slices and splits hand to the merge, for 16-bit inputs: float32, or the
# inputs' own dtype (half the bytes written and read again; each partial is a softmax-normalised average of V rows,
# rounded once more before the merge weighs it). fp32 inputs keep fp32.
PARTIALS_16BIT = "input"  # or "float32"
# Prefix slices: enough programs for a few per SM, never slices shorter than min_split_tokens, at most max_splits (the
# grid's slice dimension under a CUDA graph, where most programs of a padded table exit at once). Four slices per
# prefix measured best on both W1 (1,024 tokens) and gsp (2,048) with 8 groups.
PREFIX_SPLITS = {"programs_per_sm": 2, "min_split_tokens": 256, "max_splits": 8}
# How many prefix slices the fused suffix kernel folds in one unrolled, masked pass (the rest in a loop): W1 steps
# have 4 slices, gsp's 2. The full 8 (max_splits) issued every slice's loads and arithmetic, masked or not, in every
# program (the same registers, compiled offline): a fold of 4.3 us a program, timed per program in the decode step.
# In the whole decode step on an H200 (CUDA graph, rounds alternating, bench/results/session26-h200.md), 2 against 8:
# Qwen3-0.6B W1 -1.8%, gsp -4.0%; Qwen3-8B W1 -0.7%, gsp -1.9%. 4 times as 2 on W1 and 0.5-1.1% slower on gsp.
FOLD_UNROLL_SLICES = 2


def prefix_config(dtype, device):
    if device.type != "cuda":
        return PREFIX_CONFIG["interpret"]
    return PREFIX_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


def prefix_num_splits(num_groups, num_kv_heads, m_blocks, max_prefix_len, device):
    cfg = PREFIX_SPLITS
    # Two programs an SM under PDL too. One (which left the suffix kernel room beside it) measured faster on an H100
    # when the grid had a program per padded item; since the programs walk the live items only (prefix_programs), two
    # measure faster on an H200 (bench/results/prefix-slices-h200.md): decode step at 8 prompts of 2,048 tokens x 4
    # members, Qwen3-0.6B 2.23 -> 1.96 ms, Qwen3-8B 6.38 -> 6.07; W1 Qwen3-8B 1.528 -> 1.509 s.
    target = cfg["programs_per_sm"] * sm_count(device)
    splits = triton.cdiv(target, max(1, num_groups * num_kv_heads * m_blocks))
    splits = min(splits, triton.cdiv(max(1, max_prefix_len), cfg["min_split_tokens"]), cfg["max_splits"])
    return power_of_two_at_most(splits)


def prefix_programs(items_bound, device):
    """The prefix kernel's programs: one per work item up to the bound of the programs that run at once (the slice
    policy's per SM); past it each program walks several items. Fixed by host bounds, so a CUDA graph keeps it."""
    return max(1, min(items_bound, PREFIX_SPLITS["programs_per_sm"] * sm_count(device)))


def prefix_slices(num_groups, max_group_size, max_prefix_len, num_q_heads, num_kv_heads, dtype, device):
    """How many slices each prefix is cut into in a step of these real bounds: the host's choice, which the group
    table carries to the kernels (forward_context.pack_decode_groups)."""
    m_blocks = triton.cdiv(
        max(1, max_group_size * (num_q_heads // num_kv_heads)), prefix_config(dtype, device)["BLOCK_M"]
    )
    return prefix_num_splits(num_groups, num_kv_heads, m_blocks, max_prefix_len, device)


def prefix_slices_bound(max_prefix_len):
    """Room for any step's slice count under this prefix bound: the grid's slice dimension for a CUDA graph."""
    cfg = PREFIX_SPLITS
    return power_of_two_at_most(min(cfg["max_splits"], triton.cdiv(max(1, max_prefix_len), cfg["min_split_tokens"])))


def decode_attention_grouped(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    group_prefix_lens,
    group_prefix_rows,
    group_member_start,
    group_members,
    req_group,
    req_suffix_start,
    sm_scale,
    max_seq_len,
    max_prefix_len,
    max_group_size,
    num_suffix_splits=None,
    num_prefix_splits=None,
    fuse_merge=None,
    config=None,
    prefix_splits=None,
    live_groups=None,
):
    """fuse_merge (default: whenever the suffix takes one split) merges inside the suffix kernel. prefix_splits: the
    step's slice count as a device int32 [1] (the group table's; default num_prefix_splits, or the policy's for these
    bounds); num_prefix_splits then bounds it. live_groups: how many of the table's groups are real, a device int32
    [1] (default: all of them); the groups past it pad a CUDA graph's table and are never read."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    num_groups = group_prefix_lens.shape[0]
    if bsz == 0:
        return
    if num_groups == 0:  # nothing shared: today's kernel, at today's cost
        triton_attention.decode_attention(
            q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len
        )
        return
    assert_last_dim_contiguous(q, k_cache, v_cache, o)
    assert req_to_token.stride(1) == 1
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    precision = dot_precision(q.dtype)
    suffix_cfg = dict(triton_attention.decode_config(q.dtype, q.device))
    if q.device.type == "cuda":
        suffix_cfg.update(SUFFIX_CONFIG["fp32" if q.dtype == torch.float32 else "16bit"])
    pcfg = dict(prefix_config(q.dtype, q.device), **(config or {}))
    m_blocks = triton.cdiv(max(1, max_group_size * group), pcfg["BLOCK_M"])
    s_splits = num_suffix_splits or triton_attention.decode_num_splits(bsz, hkv, max_seq_len, q.device)
    p_splits = num_prefix_splits or prefix_num_splits(num_groups, hkv, m_blocks, max_prefix_len, q.device)
    if prefix_splits is None:
        prefix_splits = torch.full((1,), p_splits, dtype=torch.int32, device=q.device)
    # OPTIONS["prefix_live_items"] off: every group of the table counts as live and each item gets its own program,
    # padding included (the grid before).
    live_only = kernels.OPTIONS["prefix_live_items"]
    if live_groups is None or not live_only:
        live_groups = torch.full((1,), num_groups, dtype=torch.int32, device=q.device)
    items_bound = num_groups * hkv * p_splits
    fused = s_splits == 1 if fuse_merge is None else fuse_merge
    assert not fused or s_splits == 1, "the merge fuses into the suffix kernel only when it takes one split"
    first_prefix_split = 0 if fused else s_splits
    total = first_prefix_split + p_splits

    partials = q.dtype if q.dtype != torch.float32 and PARTIALS_16BIT == "input" else torch.float32
    mid_o = torch.empty((bsz, hq, total, d), dtype=partials, device=q.device)
    mid_lse = torch.empty((bsz, hq, split_capacity(total)), dtype=torch.float32, device=q.device)
    mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    qk_scale = sm_scale * LOG2E

    # The prefix goes first: a fused suffix kernel reads its slices. With PDL the suffix kernel starts beside it and
    # waits for it only after the request's own tokens (triton_common.wait_for_prior_kernel). Timed per program in a
    # Qwen3-0.6B decode step on an H200, most suffix programs start before the prefix kernel's last one ends (W1 88%,
    # gsp 50%), and this launch without PDL makes the step 8.1% (W1) and 4.4% (gsp) slower
    # (bench/results/session27-h200.md).
    pdl = pdl_args(q.device, "attention")
    recordable(_prefix_kernel)[(prefix_programs(items_bound, q.device) if live_only else items_bound,)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        group_prefix_lens,
        group_prefix_rows,
        group_member_start,
        group_members,
        prefix_splits,
        live_groups,
        mid_o,
        mid_lse,
        qk_scale,
        q.stride(0),
        q.stride(1),
        *cache_strides,
        req_to_token.stride(0),
        *mid_strides,
        first_prefix_split,
        p_splits,
        NUM_KV_HEADS=hkv,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=pcfg["BLOCK_M"],
        BLOCK_D=block_d,
        BLOCK_N=pcfg["BLOCK_N"],
        DOT_PRECISION=precision,
        num_warps=pcfg["num_warps"],
        num_stages=pcfg["num_stages"],
        **pdl,
    )
    recordable(_suffix_split_kernel)[(bsz, hkv, s_splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        req_suffix_start,
        mid_o,
        mid_lse,
        o,
        prefix_splits,
        qk_scale,
        q.stride(0),
        q.stride(1),
        *cache_strides,
        req_to_token.stride(0),
        *mid_strides,
        o.stride(0),
        o.stride(1),
        s_splits,
        p_splits,
        int(fused),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=suffix_cfg["BLOCK_N"],
        DOT_PRECISION=precision,
        PREFIX_BLOCK_N=pcfg["BLOCK_N"],
        FOLD_UNROLL=FOLD_UNROLL_SLICES,
        num_warps=suffix_cfg["num_warps"],
        num_stages=suffix_cfg["num_stages"],
        **pdl,
    )
    if fused:
        return
    recordable(_merge_kernel)[(bsz, hq)](
        mid_o,
        mid_lse,
        o,
        seq_lens,
        req_suffix_start,
        prefix_splits,
        *mid_strides,
        o.stride(0),
        o.stride(1),
        s_splits,
        p_splits,
        HEAD_DIM=d,
        BLOCK_S=MERGE_BLOCK_S,
        BLOCK_D=block_d,
        SUFFIX_BLOCK_N=suffix_cfg["BLOCK_N"],
        PREFIX_BLOCK_N=pcfg["BLOCK_N"],
        num_warps=1 if block_d <= 64 else 2,
        **pdl,
    )
