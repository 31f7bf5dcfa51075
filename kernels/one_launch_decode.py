"""Decode attention in one launch, plain or with shared prefixes read once per group (cascade attention).

A decode step's attention is cut into work items, each one program's worth:
  suffix item (request, KV head, split): the request's own positions [suffix_start, seq_len) cut into `splits`
      slices (suffix_start is 0 without groups: then it is the plain split-KV decode);
  prefix item (group, slice, KV head, member block): one slice of a group's shared prefix for up to BLOCK_M query
      rows, whole members times the query heads of one KV head, in one tensor-core tile, so that each prefix K/V row
      is read once per group instead of once per member.
A query row (request, query head) is thus covered by the live suffix splits of its request plus the slices of its
group's prefix. Each item writes its partial (softmax-normalised output and log2-sum-exp) per row and counts itself
in, one int32 per row; the item that completes a row merges all of the row's partials and writes o, then sets the
count back to 0 for the next launch. A row covered by one item (an ungrouped request in one split, every request of a
large plain batch) skips all of that and writes o from registers. So there is no merge launch and no ordering between
items: prefix and suffix work share the machine, and one CUDA graph node serves every grouping.

The grid is prefix_programs + batch * KV heads * splits. The first prefix_programs programs walk the prefix items
(pid, pid + prefix_programs, ...), found by a scan of the group table (a few hundred bytes, read from L2); the rest
are one suffix item each. A plain step launches a binary compiled for suffix items alone; a grouped step can also
run as two launches, prefix items then suffix items (GROUPED_POLICY["launches"]), since no item waits for another.
The slicing of each prefix (about slice_tokens per slice, at most max_slices) is decided here per group, from the
real prefix lengths, so that a CUDA graph captured with padded bounds still splits a batch's prefixes as finely as an
eager step would (the split kernels sized it from the bounds: one slice per prefix under CUDA graphs).

Inputs beside the plain decode kernel's (all int32, on the device), as kernels.decode_attention_grouped takes them:
group_prefix_lens [G], group_prefix_rows [G] (the req_to_token row of each prefix), group_member_start [G+1],
group_members [M] (batch indices by group), req_group [B] (-1: none), req_suffix_start [B] (< seq_len).

This module launches the kernel and holds its block configs and arrival counts; the kernel is in
kernels/one_launch_kernel.py, the work items' slicing and finishing in kernels/one_launch_items.py.
"""

import torch
import triton

from kernels.launch_replay import recordable
from kernels import triton_attention
from kernels.one_launch_kernel import _decode_kernel
from kernels.triton_common import LOG2E, assert_last_dim_contiguous, dot_precision, sm_count


# 16-bit blocks follow the suffix kernel's H100 sweep (bench/results/shared-prefix-kernel-h100.md) until
# bench/shared_prefix_kernel_bench.py --sweep measures this kernel; fp32 takes narrow blocks (its IEEE dots run on FMA
# units); the interpreter only needs small ones. BLOCK_M rows hold whole members of a prefix tile; BLOCK_G groups are
# scanned per step of the group-table walk (2 in the interpreter, so that small tests cross tiles).
DECODE_CONFIG = {
    "16bit": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_G": 64, "num_warps": 4, "num_stages": 2},
    "fp32": {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_G": 64, "num_warps": 4, "num_stages": 2},
    "interpret": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_G": 2, "num_warps": 4, "num_stages": 1},
}
# Prefix slices of about slice_tokens (at most max_slices; beyond that they grow), walked by programs_per_sm programs
# per SM; partials in fp32 ("float32") or in the inputs' dtype ("input": half the bytes, as FlashInfer's cascade);
# the prefix and suffix items in one launch or in two (the suffix-only binary holds fewer registers).
GROUPED_POLICY = {
    "slice_tokens": 256,
    "max_slices": 16,
    "programs_per_sm": 2,
    "partials": "float32",
    "prefix_last": False,
    "launches": 1,
}


def decode_config(dtype, device):
    if device.type != "cuda":
        return DECODE_CONFIG["interpret"]
    return DECODE_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


_arrivals: dict = {}  # device -> int32 counts, zero between launches; grown, never freed (captured graphs hold it)


def arrival_counts(rows: int, device) -> torch.Tensor:
    """The per-row counts the launches of one device share (launches on a device run one at a time, in stream
    order). Sized before the first CUDA graph capture by the warm-up runs; a capture that needed more would bake a
    zeroing into the graph, so it is refused."""
    counts = _arrivals.get(device)
    if counts is None or counts.numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode attention needs its arrival counts sized before CUDA graph capture")
        size = max(rows, 1 << 16)
        _arrivals.setdefault(("kept", device), []).append(counts)
        counts = _arrivals[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts


def _partials(q, slots, partials):
    """Scratch for the rows' partials (slots per row) and their log-sum-exps; a plain single-split step writes none,
    and gets buffers shaped so that their strides keep the variant's divisibility."""
    bsz, hq, d = q.shape
    dtype = torch.float32 if partials == "float32" else q.dtype
    if slots <= 1:
        bsz, hq, slots = 1, 1, 1
    part_o = torch.empty((bsz, hq, slots, d), dtype=dtype, device=q.device)
    part_lse = torch.empty((bsz, hq, triton.cdiv(slots, 16) * 16), dtype=torch.float32, device=q.device)
    return part_o, part_lse


def _launch(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    tables,
    sm_scale,
    splits,
    prefix_programs,
    items,
    parts,
    cfg,
    pol,
):
    """items: "both" (grid: the prefix programs, then one program per suffix item), "prefix" or "suffix"."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert_last_dim_contiguous(q, k_cache, v_cache, o)
    assert req_to_token.stride(1) == 1
    suffix_start, req_group, prefix_lens, prefix_rows, member_start, members = tables
    part_o, part_lse = parts
    group = hq // hkv
    grid = (prefix_programs if items != "suffix" else 0) + (bsz * hkv * splits if items != "prefix" else 0)
    recordable(_decode_kernel)[(grid,)](
        q,
        k_cache,
        v_cache,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        suffix_start,
        req_group,
        prefix_lens,
        prefix_rows,
        member_start,
        members,
        part_o,
        part_lse,
        arrival_counts(bsz * hq, q.device),
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        bsz,
        prefix_lens.shape[0],
        splits,
        prefix_programs if items != "suffix" else 0,
        int(pol["prefix_last"] and items == "both"),
        pol["slice_tokens"],
        pol["max_slices"],
        NUM_KV_HEADS=hkv,
        GQA=group,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_M=max(cfg["BLOCK_M"], triton.next_power_of_2(group)),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_G=cfg["BLOCK_G"],
        DOT_PRECISION=dot_precision(q.dtype),
        PREFIX_ITEMS=items != "suffix",
        SUFFIX_ITEMS=items != "prefix",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def decode_attention(
    q,
    k_cache,
    v_cache,
    o,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    max_seq_len,
    num_kv_splits=None,
    config=None,
):
    """kernels.decode_attention in one launch: the split count follows triton_attention's policy, and the last split
    of a request to finish merges it."""
    bsz = q.shape[0]
    if bsz == 0:
        return
    splits = num_kv_splits or triton_attention.decode_num_splits(bsz, k_cache.shape[1], max_seq_len, q.device)
    cfg = dict(decode_config(q.dtype, q.device), **(config or {}))
    # Group-table pointers are never read without groups; seq_lens stands in for each of them.
    tables = (seq_lens, seq_lens, seq_lens[:0], seq_lens, seq_lens, seq_lens)
    _launch(
        q,
        k_cache,
        v_cache,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        tables,
        sm_scale,
        splits,
        0,
        "suffix",
        _partials(q, splits, "float32"),
        cfg,
        GROUPED_POLICY,
    )


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
    prefix_programs=None,
    config=None,
    policy=None,
):
    """kernels.decode_attention_grouped in one launch (or two: policy launches=2, the prefix items then the suffix
    items). max_prefix_len and max_group_size are not needed: the prefix work is found on the device.
    prefix_programs: how many programs walk it (default programs_per_sm per SM)."""
    bsz, _, _ = q.shape
    hkv = k_cache.shape[1]
    if bsz == 0:
        return
    if group_prefix_lens.shape[0] == 0:
        decode_attention(
            q,
            k_cache,
            v_cache,
            o,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            max_seq_len,
            num_suffix_splits,
            config,
        )
        return
    splits = num_suffix_splits or triton_attention.decode_num_splits(bsz, hkv, max_seq_len, q.device)
    cfg = dict(decode_config(q.dtype, q.device), **(config or {}))
    pol = dict(GROUPED_POLICY, **(policy or {}))
    programs = prefix_programs or pol["programs_per_sm"] * sm_count(q.device)
    tables = (req_suffix_start, req_group, group_prefix_lens, group_prefix_rows, group_member_start, group_members)
    parts = _partials(q, splits + pol["max_slices"], pol["partials"])
    args = (q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, tables, sm_scale, splits, programs)
    if pol["launches"] == 1:
        _launch(*args, "both", parts, cfg, pol)
    else:  # the rows' counts do not care which launch completes them
        _launch(*args, "prefix", parts, cfg, pol)
        _launch(*args, "suffix", parts, cfg, pol)
