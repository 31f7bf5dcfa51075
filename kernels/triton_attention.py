"""Paged attention in Triton over a token-granular KV cache.

The KV cache is [num_slots, Hkv, D] per layer and a request's context is wherever `req_to_token`
says, one slot per position, so every kernel gathers K/V rows through that table instead of
reading a contiguous range. A row of one head is D contiguous elements (256 bytes for bf16 D=128):
that is the unit of every gather and it keeps loads coalesced even when slots are scattered.

Softmax runs in base 2 (exp2/log2) with sm_scale * log2(e) applied inside the exponent, one FMA
per score. Accumulation is fp32; for fp32 inputs the dots are asked for IEEE precision, since
Triton would otherwise use tf32 and miss the 1e-4 tolerance.

Block sizes, warps, stages and the decode split policy were chosen by the sweeps of
bench/kernel_bench.py on an H100 (bench/results/kernels-h100*.md). What the attention kernels share
(the online-softmax step, the split merge, the jit decorator that keeps values following the batch's
makeup out of Triton's specialization key) is in kernels/triton_common.py. This module holds the launches and
their policy; the decode and extend kernels themselves are in kernels/triton_attention_kernels.py, store_kv (which
this module passes on as the backend's) in kernels/triton_store_kv.py.
"""

import torch
import triton

import kernels

from kernels.launch_replay import recordable
from kernels.triton_store_kv import store_kv  # noqa: F401 (the backend's API: kernels/__init__.py)
from kernels.triton_attention_kernels import (
    _decode_split_kernel,
    _extend_kernel,
    _merge_splits_kernel,
)
from kernels.triton_common import (
    LOG2E,
    MERGE_BLOCK_S,
    assert_last_dim_contiguous,
    dot_precision,
    pdl_args,
    power_of_two_at_most,
    prefetches,
    sm_count,
    split_capacity,
)


# ---------------------------------------------------------------------------------------------
# decode_attention: split-KV flash-decoding
# ---------------------------------------------------------------------------------------------


# Tuned on the H100 (bench/kernel_bench.py). fp32 takes narrower blocks: its IEEE dots run on FMA units
# and hold their operands in registers. The interpreter only cares that blocks are small.
DECODE_CONFIG = {
    "16bit": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "fp32": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
    "interpret": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
}
# Split policy: a grid of a few programs per SM, at most max_splits and max_seq_len / min_split_tokens slices; under
# CUDA graphs (max_seq_len the context length) each request cuts its own context (decode_slicing): ~min_split_tokens a
# slice, at least enough to fill the device once (min_programs_per_sm). H100 measurements: decode-step-h100-session18.
DECODE_SPLITS = {"programs_per_sm": 4, "min_programs_per_sm": 1, "min_split_tokens": 512, "max_splits": 32}


def decode_config(dtype, device):
    if device.type != "cuda":
        return DECODE_CONFIG["interpret"]
    return DECODE_CONFIG["fp32" if dtype == torch.float32 else "16bit"]


def decode_num_splits(batch, num_kv_heads, max_seq_len, device):
    """How many context slices per (request, KV head): enough programs to fill every SM a few times.

    Decided on the host from max_seq_len alone (no device sync); each request then cuts its own
    context into that many slices, so short requests in a batch with a long one simply get short slices.
    """
    cfg = DECODE_SPLITS
    target = cfg["programs_per_sm"] * sm_count(device)
    splits = triton.cdiv(target, max(1, batch * num_kv_heads))
    splits = min(splits, triton.cdiv(max(1, max_seq_len), cfg["min_split_tokens"]), cfg["max_splits"])
    return power_of_two_at_most(splits)


def decode_min_splits(batch, num_kv_heads, splits, device):
    """The fewest slices each request's context is cut into, whatever its length (at most the grid's splits): enough
    programs to fill every SM min_programs_per_sm times."""
    target = DECODE_SPLITS["min_programs_per_sm"] * sm_count(device)
    return min(splits, power_of_two_at_most(triton.cdiv(target, max(1, batch * num_kv_heads))))


def prefetches_kv(k_cache, v_cache) -> bool:
    """Whether the decode kernel asks L2 for its first block's K/V rows before its PDL wait (triton_common.prefetches):
    only where every row is whole 16-byte units at 16-byte-aligned addresses, as the bulk prefetch needs."""
    size = k_cache.element_size()
    aligned = all(
        t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0 and t.stride(1) * size % 16 == 0
        for t in (k_cache, v_cache)
    )
    return aligned and k_cache.shape[-1] * size % 16 == 0 and prefetches(k_cache.device, "attention")


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
    pending=None,
):
    """pending (kernels.PendingQKV): q and the new tokens' K/V as the QKV projection left them; the kernel does what
    kernels.qk_norm_rope_store would have (the program that ends a context stores the new token's K/V, then reads
    them back with its slice after a barrier)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    if bsz == 0:
        return
    assert_last_dim_contiguous(q, k_cache, v_cache, o)
    p = pending
    if p is None:  # placeholders: the kernel reads none of them
        new, new_strides = (q, q, seq_lens, q, q, q, seq_lens, 0.0), (0,) * 5
    else:
        assert p.k.stride(-1) == p.v.stride(-1) == p.cos_sin_cache.stride(-1) == 1
        weights = [q if w is None else w for w in (p.q_weight, p.k_weight)]
        new = (p.k, p.v, p.positions, p.cos_sin_cache, *weights, p.out_cache_loc, p.eps)
        new_strides = (*p.k.stride()[:2], *p.v.stride()[:2], p.cos_sin_cache.stride(0))
    assert req_to_token.stride(1) == 1
    cfg = dict(decode_config(q.dtype, q.device), **(config or {}))
    group = hq // hkv
    splits = num_kv_splits or decode_num_splits(bsz, hkv, max_seq_len, q.device)
    min_splits = num_kv_splits or decode_min_splits(bsz, hkv, splits, q.device)
    block_d = triton.next_power_of_2(d)
    mid_o = torch.empty((bsz, hq, splits, d) if splits > 1 else (1, 1, 1, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, hq, split_capacity(splits)), dtype=torch.float32, device=q.device)
    recordable(_decode_split_kernel)[(bsz, hkv, splits)](
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        o,
        *new[:7],
        sm_scale * LOG2E,
        new[7],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        *new_strides,
        splits,
        min_splits,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=cfg["BLOCK_N"],
        MIN_SPLIT_TOKENS=DECODE_SPLITS["min_split_tokens"],
        DOT_PRECISION=dot_precision(q.dtype),
        PREFETCH=prefetches_kv(k_cache, v_cache),
        PREPARE_QKV=p is not None,
        HAS_NORM=p is not None and p.q_weight is not None,
        HALF=1 if p is None else p.cos_sin_cache.shape[-1] // 2,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(q.device, "attention"),
    )
    if splits == 1:
        return
    # A second kernel merges the splits. Merging them in the last split's program instead (a count per request and
    # KV head) removed this launch but measured slower at batch 1 on an H100 (Qwen3-0.6B 1.30 -> 1.33 ms a step,
    # Qwen3-8B 6.38 -> 6.46: bench/results/kernels-h100-2026-11-24b/).
    merge_splits(mid_o, mid_lse, o, seq_lens, cfg["BLOCK_N"], pdl_args(q.device, "attention"), min_splits)


def merge_splits(mid_o, mid_lse, o, seq_lens, block_n, pdl, min_splits=1):
    """o[row, head] from the split kernels' partials (mid_o [rows, heads, splits, d]): decode's rows are requests whose
    seq_lens say which splits were written (decode_slicing, with the decode kernel's min_splits and block_n); extend's
    are tokens (seq_lens None: every split written)."""
    rows, hq, splits, d = mid_o.shape
    block_d = triton.next_power_of_2(d)
    recordable(_merge_splits_kernel)[(rows, hq)](
        mid_o,
        mid_lse,
        o,
        seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        splits,
        min_splits,
        HEAD_DIM=d,
        BLOCK_S=MERGE_BLOCK_S,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        MIN_SPLIT_TOKENS=DECODE_SPLITS["min_split_tokens"],
        num_warps=1 if block_d <= 64 else 2,
        **pdl,
    )


# ---------------------------------------------------------------------------------------------
# extend_attention: prefix through the table, then causal over the new tokens
# ---------------------------------------------------------------------------------------------


# Per (dtype width, head_dim, chunk length) on the GPU. BLOCK_M counts query rows, (token, head) pairs of one KV
# head's group. Chosen by a sweep of the GQA-packed kernel on an H100 over cache-hit bursts, short chunks, W1's
# chunks and cold prompts of 1,152-8,192 tokens at the Qwen3-0.6B and 8B shapes (bench/results/extend-gqa-h100/).
EXTEND_CONFIG = {
    "16bit": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    # Long chunks (>= EXTEND_LONG_TOKENS new tokens): compute-bound, the bigger tile wins (8,192 cold: 388 against
    # 335 TFLOP/s).
    "16bit_long": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    "16bit_small_d": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    # A few rows per KV head (decodes, short chunks): rows past a request's extend are pure waste, so use few.
    "16bit_short": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "fp32": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2},
    "interpret": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}
EXTEND_LONG_TOKENS = 2048
# Key splits of a grid too small for the device (extend_num_splits); at most one merge tile of partials, so that the
# merge's first tile always holds the last split, never empty.
EXTEND_MAX_SPLITS = 8
assert EXTEND_MAX_SPLITS <= MERGE_BLOCK_S


def extend_num_splits(programs: int, device) -> int:
    """Programs per row block: 1 when the grid fills the device twice, else enough to. A lone cache hit is a small
    grid whose every program reads the whole prefix: 128 new tokens over 1,024 cached on Qwen3-0.6B are 8 KV heads x
    4 row blocks, 32 programs on 132 SMs. Inside a CUDA graph on an H100 (bench/results/extend-split-h100.md) that
    call took 25.4 us unsplit and 15.0 in 8 splits, Qwen3-8B's (64 programs) 25.9 and 20.6 in 4; 20 new tokens over
    1,520 (0.6B, 8 programs) 31.7 and 12.7 in 8. Twice the SMs rather than once: 4 splits of the 0.6B hit, 15.4 us;
    2 of the 8B one, 24.1."""
    target = 2 * sm_count(device)
    if programs >= target:
        return 1
    return power_of_two_at_most(min(EXTEND_MAX_SPLITS, target // programs))


def extend_config(dtype, head_dim, device, max_extend_len=None, group=1):
    """BLOCK_M counts query rows: (token, query head) pairs of one KV head's group (_extend_kernel), so a block holds
    BLOCK_M // group tokens. Narrower blocks for grids too small to fill the device measured no faster with the packed
    rows (a cache hit's 128 new tokens over 1,024 cached, one request: 35 us in 64-row blocks, 37-53 in 16 or 32):
    each program reads the whole prefix whatever its rows."""
    if device.type != "cuda":
        return EXTEND_CONFIG["interpret"]
    if dtype == torch.float32:
        return EXTEND_CONFIG["fp32"]
    if max_extend_len is not None and max_extend_len * group <= EXTEND_CONFIG["16bit_short"]["BLOCK_M"]:
        return EXTEND_CONFIG["16bit_short"]
    if head_dim <= 64:
        return EXTEND_CONFIG["16bit_small_d"]
    if max_extend_len is not None and max_extend_len >= EXTEND_LONG_TOKENS:
        return EXTEND_CONFIG["16bit_long"]
    return EXTEND_CONFIG["16bit"]


def extend_attention(
    q,
    k,
    v,
    o,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    extend_start_loc,
    sm_scale,
    max_extend_len,
    config=None,
):
    t, hq, d = q.shape
    bsz = extend_lens.shape[0]
    hkv = k.shape[1]
    if t == 0 or bsz == 0:
        return
    assert_last_dim_contiguous(q, k, v, o, k_cache, v_cache)
    assert req_to_token.stride(1) == 1
    group = hq // hkv
    cfg = dict(extend_config(q.dtype, d, q.device, max_extend_len, group), **(config or {}))
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))  # a block holds at least one token's heads
    num_m_blocks = triton.cdiv(max_extend_len, block_m // group)
    splits = cfg.get("num_splits") or extend_num_splits(hkv * num_m_blocks * bsz, q.device)
    if not kernels.OPTIONS["extend_key_splits"] and not cfg.get("num_splits"):
        splits = 1
    block_d = triton.next_power_of_2(d)
    if splits > 1:  # the split programs' partials, for the merge
        mid_o = torch.empty((t, hq, splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((t, hq, split_capacity(splits)), dtype=torch.float32, device=q.device)
    else:  # placeholders, never touched (strides of the same divisibility: the same binary)
        mid_o = torch.empty((1, 1, 1, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((1, 1, split_capacity(1)), dtype=torch.float32, device=q.device)
    recordable(_extend_kernel)[(hkv, num_m_blocks * splits, bsz)](
        q,
        k,
        v,
        o,
        mid_o,
        mid_lse,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        sm_scale * LOG2E,
        num_m_blocks,
        splits,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if splits > 1:
        merge_splits(mid_o, mid_lse, o, None, 1, {"PDL": False})


def extend_variants(dtype, head_dim, device, group=1):
    """Every config extend_config can pick for this dtype, head_dim and GQA group, over any longest extend (its
    thresholds are powers of two)."""
    configs = []
    for length in (None, *(2**i for i in range(17))):
        cfg = extend_config(dtype, head_dim, device, length, group)
        if cfg not in configs:
            configs.append(cfg)
    return configs


def compile_extend_variants(
    num_heads, dtype, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc
):
    """The extend kernel launched once in each variant a step can select (extend_variants), over one 1-token request
    whose metadata the caller laid out as a step's: all compile at start-up. Which one a step selects follows its
    makeup (longest extend, requests), which arrival timing decides; a variant first selected in the middle of
    serving was a compile there (~1.4 s on an H100, in one W1 run of three)."""
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    q = torch.zeros(1, num_heads, d, dtype=dtype, device=k_cache.device)
    k = torch.zeros(1, hkv, d, dtype=k_cache.dtype, device=k_cache.device)
    for cfg in extend_variants(dtype, d, k_cache.device, num_heads // hkv):
        extend_attention(
            q,
            k,
            k,
            torch.empty_like(q),
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            prefix_lens,
            extend_lens,
            extend_start_loc,
            1.0,
            1,
            config=cfg,
        )
