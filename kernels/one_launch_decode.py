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
"""

import torch
import triton
import triton.language as tl

from kernels import triton_attention
from kernels.triton_common import (LOG2E, assert_last_dim_contiguous, attend_table_range, dot_precision, jit,
                                   sm_count)


@triton.jit
def _prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N: tl.constexpr):
    """(live slices, slice length) of prefixes: slices of about slice_tokens, at most max_slices, in whole blocks.
    Elementwise; the prefix items and the rows' arrival counts both derive from it."""
    wanted = tl.maximum(tl.minimum(tl.cdiv(prefix_len, slice_tokens), max_slices), 1)
    slice_len = tl.cdiv(tl.cdiv(prefix_len, wanted), BLOCK_N) * BLOCK_N
    return tl.where(prefix_len > 0, tl.cdiv(prefix_len, tl.maximum(slice_len, 1)), 0), slice_len


@triton.jit
def _suffix_splitting(own_len, splits, BLOCK_N: tl.constexpr):
    """(live splits, split length) of own contexts (own_len >= 1); as triton_attention's decode split policy."""
    split_len = tl.cdiv(tl.cdiv(own_len, splits), BLOCK_N) * BLOCK_N
    return tl.cdiv(own_len, split_len), split_len


@triton.jit
def _group_tile(Group_prefix_lens, Group_member_start, g0, num_groups, slice_tokens, max_slices,
                MEMBERS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """Groups g0 .. g0 + BLOCK_G - 1 and the number of prefix items of each (0 past the table or for empty groups)."""
    gs = g0 + tl.arange(0, BLOCK_G)
    ok = gs < num_groups
    prefix_len = tl.load(Group_prefix_lens + gs, mask=ok, other=0)
    first = tl.load(Group_member_start + gs, mask=ok, other=0)
    size = tl.load(Group_member_start + gs + 1, mask=ok, other=0) - first
    slices, _ = _prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
    return gs, slices * NUM_KV_HEADS * tl.cdiv(size, MEMBERS)


@triton.jit
def _finish(acc, m_i, l_i, reqs, heads, row_ok, slot, expected, suffix_live, splits, prefix_slices, O, Part_o,
            Part_lse, Arrivals, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, dims,
            dim_ok, NUM_Q_HEADS: tl.constexpr):
    """Publishes this item's partial for its rows, counts it in, and merges the rows it completes.

    A row's partials sit in slots 0 .. splits - 1 (its suffix splits, suffix_live of them written) and splits ..
    splits + prefix_slices - 1 (its group's prefix slices); `expected` is how many items cover the row."""
    part_rows = reqs * stride_pb + heads * stride_ph
    lse_rows = reqs * stride_lb + heads * stride_lh
    out_mask = row_ok[:, None] & dim_ok[None, :]
    tl.store(Part_o + part_rows[:, None] + slot * stride_ps + dims[None, :],
             (acc / l_i[:, None]).to(Part_o.dtype.element_ty), mask=out_mask)
    tl.store(Part_lse + lse_rows + slot, m_i + tl.log2(l_i), mask=row_ok)
    # Every thread's stores before the count (a release by the thread that issues it), as a CUTLASS semaphore does.
    tl.debug_barrier()
    # The count runs on a [rows, 16] tile with one live column, wide enough to span the CTA's threads, so that each
    # row's count is issued and read by one thread. Should a layout still hold a row twice, the copy that does not
    # issue the atomic reads 0 (Triton zeroes a predicated atomic's result, seen in the sm_90 PTX), and 0 never
    # completes a row here: rows that reach this point have expected >= 2.
    cols = tl.arange(0, 16)
    counted = row_ok[:, None] & (cols[None, :] == 0)
    before = tl.atomic_add(Arrivals + (reqs * NUM_Q_HEADS + heads)[:, None] + cols[None, :] * 0, 1, mask=counted,
                           sem="acq_rel", scope="gpu")
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
            part = tl.load(Part_o + part_rows[:, None] + s * stride_ps + dims[None, :],
                           mask=live[:, None] & dim_ok[None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, lse)
            alpha = tl.exp2(m_run - m_new)
            beta = tl.exp2(lse - m_new)
            acc_run = acc_run * alpha[:, None] + part.to(tl.float32) * beta[:, None]
            l_run = l_run * alpha + beta
            m_run = m_new
        tl.store(O + reqs[:, None] * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 (acc_run / tl.where(last, l_run, 1.0)[:, None]).to(O.dtype.element_ty),
                 mask=last[:, None] & dim_ok[None, :])
        tl.store(Arrivals + reqs * NUM_Q_HEADS + heads, 0, mask=last)  # every count is 0 between launches


# Everything that follows the batch's makeup (its size, groups, split counts) is a runtime value exempt from
# specialisation, and the group tables' pointers from alignment specialisation: one binary for every step
# (kernels/triton_common.py, bench/kernel_variants.py).
@jit(do_not_specialize=["batch", "num_groups", "splits", "prefix_programs", "prefix_last", "slice_tokens",
                         "max_slices"],
     unaligned=["Req_pool_indices", "Seq_lens", "Suffix_start", "Req_group", "Group_prefix_lens", "Group_prefix_rows",
                "Group_member_start", "Group_members"])
def _decode_kernel(Q, K_cache, V_cache, O, Req_to_token, Req_pool_indices, Seq_lens, Suffix_start, Req_group,
                   Group_prefix_lens, Group_prefix_rows, Group_member_start, Group_members, Part_o, Part_lse,
                   Arrivals, qk_scale,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
                   stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   batch, num_groups, splits, prefix_programs, prefix_last, slice_tokens, max_slices,
                   NUM_KV_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PREFIX_ITEMS: tl.constexpr, SUFFIX_ITEMS: tl.constexpr):
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
                _, items = _group_tile(Group_prefix_lens, Group_member_start, g0, num_groups, slice_tokens, max_slices,
                                       MEMBERS, NUM_KV_HEADS, BLOCK_N, BLOCK_G)
                total += tl.sum(items, 0)
            for item in range(prefix_pid, total, prefix_programs):
                # Which group holds this item, and where in the group's (slice, KV head, member block) order.
                group = 0
                local = 0
                seen = 0
                for g0 in range(0, num_groups, BLOCK_G):
                    gs, items = _group_tile(Group_prefix_lens, Group_member_start, g0, num_groups, slice_tokens,
                                            max_slices, MEMBERS, NUM_KV_HEADS, BLOCK_N, BLOCK_G)
                    upto = tl.cumsum(items, 0) + seen
                    hit = (upto - items <= item) & (item < upto)
                    group += tl.sum(tl.where(hit, gs, 0), 0)
                    local += tl.sum(tl.where(hit, item - (upto - items), 0), 0)
                    seen += tl.sum(items, 0)
                prefix_len = tl.load(Group_prefix_lens + group)
                member0 = tl.load(Group_member_start + group)
                size = tl.load(Group_member_start + group + 1) - member0
                prefix_slices, slice_len = _prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
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
                q = tl.load(Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                            mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
                table = Req_to_token + tl.load(Group_prefix_rows + group).to(tl.int64) * stride_rt
                start = slice_idx * slice_len
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                m_i, l_i, acc = attend_table_range(q, m_i, l_i, acc, table, start,
                                                   tl.minimum(start + slice_len, prefix_len),
                                                   K_cache + kv_head * stride_kh, V_cache + kv_head * stride_vh,
                                                   stride_kn, stride_vn, dims, dim_ok, qk_scale, BLOCK_N, EVEN_D,
                                                   DOT_PRECISION)
                own = (tl.load(Seq_lens + reqs, mask=row_ok, other=1)
                       - tl.load(Suffix_start + reqs, mask=row_ok, other=0))
                suffix_live, _ = _suffix_splitting(own, splits, BLOCK_N)
                _finish(acc, m_i, l_i, reqs, heads, row_ok, splits + slice_idx, suffix_live + prefix_slices,
                        suffix_live, splits, prefix_slices, O, Part_o, Part_lse, Arrivals, stride_ob, stride_oh,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, dims, dim_ok, NUM_Q_HEADS)
    if SUFFIX_ITEMS:
        if (suffix_idx >= 0) & (suffix_idx < suffix_programs):
            req = suffix_idx // (NUM_KV_HEADS * splits)
            kv_head = suffix_idx // splits % NUM_KV_HEADS
            split = suffix_idx % splits
            grouped = num_groups > 0
            first = tl.load(Suffix_start + req, mask=grouped, other=0)
            own = tl.load(Seq_lens + req) - first
            suffix_live, split_len = _suffix_splitting(own, splits, BLOCK_N)
            start = first + split * split_len
            if split < suffix_live:  # dead splits (a short request in a batch split for a long one) count for nothing
                rows = tl.arange(0, BLOCK_H)
                row_ok = rows < GQA
                heads = kv_head * GQA + rows
                q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                            mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
                table = Req_to_token + tl.load(Req_pool_indices + req).to(tl.int64) * stride_rt
                m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_H], tl.float32)
                acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
                m_i, l_i, acc = attend_table_range(q, m_i, l_i, acc, table, start,
                                                   tl.minimum(start + split_len, first + own),
                                                   K_cache + kv_head * stride_kh, V_cache + kv_head * stride_vh,
                                                   stride_kn, stride_vn, dims, dim_ok, qk_scale, BLOCK_N, EVEN_D,
                                                   DOT_PRECISION)
                group = tl.load(Req_group + req, mask=grouped, other=-1)
                prefix_len = tl.load(Group_prefix_lens + tl.maximum(group, 0), mask=group >= 0, other=0)
                prefix_slices, _ = _prefix_slicing(prefix_len, slice_tokens, max_slices, BLOCK_N)
                if suffix_live + prefix_slices == 1:
                    tl.store(O + req * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
                else:
                    reqs = tl.full([BLOCK_H], 0, tl.int64) + req
                    _finish(acc, m_i, l_i, reqs, heads, row_ok, split, tl.full([BLOCK_H], 0, tl.int32) + suffix_live
                            + prefix_slices, suffix_live, splits, prefix_slices, O, Part_o, Part_lse, Arrivals,
                            stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, dims, dim_ok,
                            NUM_Q_HEADS)


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
GROUPED_POLICY = {"slice_tokens": 256, "max_slices": 16, "programs_per_sm": 2, "partials": "float32",
                  "prefix_last": False, "launches": 1}


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


def _launch(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, tables, sm_scale, splits,
            prefix_programs, items, parts, cfg, pol):
    """items: "both" (grid: the prefix programs, then one program per suffix item), "prefix" or "suffix"."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert_last_dim_contiguous(q, k_cache, v_cache, o)
    assert req_to_token.stride(1) == 1
    suffix_start, req_group, prefix_lens, prefix_rows, member_start, members = tables
    part_o, part_lse = parts
    group = hq // hkv
    grid = (prefix_programs if items != "suffix" else 0) + (bsz * hkv * splits if items != "prefix" else 0)
    _decode_kernel[(grid,)](
        q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, suffix_start, req_group, prefix_lens,
        prefix_rows, member_start, members, part_o, part_lse, arrival_counts(bsz * hq, q.device), sm_scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), req_to_token.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        bsz, prefix_lens.shape[0], splits, prefix_programs if items != "suffix" else 0,
        int(pol["prefix_last"] and items == "both"), pol["slice_tokens"], pol["max_slices"],
        NUM_KV_HEADS=hkv, GQA=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_M=max(cfg["BLOCK_M"], triton.next_power_of_2(group)),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_G=cfg["BLOCK_G"], DOT_PRECISION=dot_precision(q.dtype),
        PREFIX_ITEMS=items != "suffix", SUFFIX_ITEMS=items != "prefix",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def decode_attention(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len,
                     num_kv_splits=None, config=None):
    """kernels.decode_attention in one launch: the split count follows triton_attention's policy, and the last split
    of a request to finish merges it."""
    bsz = q.shape[0]
    if bsz == 0:
        return
    splits = num_kv_splits or triton_attention.decode_num_splits(bsz, k_cache.shape[1], max_seq_len, q.device)
    cfg = dict(decode_config(q.dtype, q.device), **(config or {}))
    # Group-table pointers are never read without groups; seq_lens stands in for each of them.
    tables = (seq_lens, seq_lens, seq_lens[:0], seq_lens, seq_lens, seq_lens)
    _launch(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, tables, sm_scale, splits, 0, "suffix",
            _partials(q, splits, "float32"), cfg, GROUPED_POLICY)


def decode_attention_grouped(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens,
                             group_prefix_lens, group_prefix_rows, group_member_start, group_members,
                             req_group, req_suffix_start, sm_scale, max_seq_len, max_prefix_len, max_group_size,
                             num_suffix_splits=None, prefix_programs=None, config=None, policy=None):
    """kernels.decode_attention_grouped in one launch (or two: policy launches=2, the prefix items then the suffix
    items). max_prefix_len and max_group_size are not needed: the prefix work is found on the device.
    prefix_programs: how many programs walk it (default programs_per_sm per SM)."""
    bsz, _, _ = q.shape
    hkv = k_cache.shape[1]
    if bsz == 0:
        return
    if group_prefix_lens.shape[0] == 0:
        decode_attention(q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, sm_scale, max_seq_len,
                         num_suffix_splits, config)
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
