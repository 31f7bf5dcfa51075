"""What the Triton attention kernels share: the jit decorator that keeps batch metadata out of the specialization key,
the online-softmax step and the split-KV loop around it (attend_table_range), dot precision, the log-sum-exp merge of
split partials, and the split-count helpers.

Triton compiles one binary per specialization key: every constexpr value, whether each int argument is 1 or
divisible by 16, and whether each pointer is 16-byte aligned. A key first met in the middle of serving is a compile
there (a second or more). So anything that follows the batch's makeup (its size, its groups, the longest context,
where the decode part starts) must enter a kernel as a runtime value that is not specialised: split counts and
trip counts are ints named in do_not_specialize, metadata slices are pointers named in `unaligned`, and split
scratch buffers are laid out so that their strides keep one class whatever the split count (split_capacity).
bench/kernel_variants.py (keys by bench/kernel_variant_keys.py) checks it: a second run of a workload, in another
batch makeup, launches no new variant.
"""

import inspect

import torch
import triton
import triton.language as tl

import kernels

LOG2E = 1.4426950408889634

# Partials of one query are merged this many splits at a time (a fixed tile, so that one binary serves every count).
MERGE_BLOCK_S = 16


def jit(do_not_specialize=(), unaligned=()):
    """triton.jit that specialises neither the named ints on their value nor the named pointers on 16-byte alignment.
    Batch metadata (request rows, lengths, group tables) arrives as slices at offsets that follow the batch's makeup,
    and each new alignment pattern was a new compiled variant: a compile of a second or more in the middle of serving.
    Older Triton releases without alignment control just specialise as before."""
    kwargs = {"do_not_specialize": list(do_not_specialize)} if do_not_specialize else {}
    if unaligned and "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = list(unaligned)
    return triton.jit(**kwargs)


@triton.jit
def rows_inv_rms(Squares, offs_m, m_ok, eps, K: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr):
    """1 / rms of each row of x [rows, K] from its partial sums of squares Squares [rows, BLOCKS] (fp32, one per
    column block of the projection that wrote x: kernels.linear_add), summed in block order."""
    blocks = tl.arange(0, BLOCKS_P2)
    ok = m_ok[:, None] & (blocks < BLOCKS)[None, :]
    squares = tl.load(Squares + offs_m[:, None] * BLOCKS + blocks[None, :], mask=ok, other=0.0)
    return tl.rsqrt(tl.sum(squares, 1) / K + eps)


def dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def assert_last_dim_contiguous(*tensors):
    for t in tensors:
        assert t.stride(-1) == 1, "kernels need the head_dim axis contiguous (stride 1)"


def split_capacity(splits: int) -> int:
    """Slots per (request, head) of a log-sum-exp scratch buffer: the split count rounded up to 16, so that its
    strides stay divisible by 16 (one Triton variant) whatever the count; the output partials' strides already are
    (they are multiples of head_dim)."""
    return triton.cdiv(max(1, splits), 16) * 16


@triton.jit
def online_softmax_block(q, k, v, valid, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of keys folded into the running (max, sum, acc) of an online softmax, in base 2."""
    # k arrives as [BLOCK_N, D]; the transposed operand is a layout choice for the compiler, not a copy.
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        qk = tl.where(valid, qk, float("-inf"))
    # The scale is applied inside the exponent (one FMA per score) rather than to the scores first;
    # qk_scale > 0, so the running max can be taken on the unscaled scores.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_rows(Base, rows, stride_row, dims, row_ok, dim_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """[len(rows), BLOCK_D] from row offsets; masks only what can be out of range (each mask costs selects)."""
    ptrs = Base + rows[:, None] * stride_row + dims[None, :]
    if MASK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=dim_ok[None, :], other=0.0)


@triton.jit
def attend_table_range(
    q,
    m_i,
    l_i,
    acc,
    table,
    start,
    end,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    dims,
    dim_ok,
    qk_scale,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The split-KV loop of every attention kernel: context positions [start, end) of one table row (a request's, or
    a shared prefix's), gathered through their KV slots for one KV head (k_base, v_base), folded into the running
    softmax (m_i, l_i, acc) of the query rows q. Whole blocks go unmasked; only the ragged tail pays for a mask."""
    offs = tl.arange(0, BLOCK_N)
    whole_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, whole_end, BLOCK_N):
        # int64: slot * stride overflows int32 once the pool holds more than ~2M head-rows.
        slots = tl.load(table + n0 + offs).to(tl.int64)
        k = load_rows(k_base, slots, stride_kn, dims, None, dim_ok, False, EVEN_D)
        v = load_rows(v_base, slots, stride_vn, dims, None, dim_ok, False, EVEN_D)
        m_i, l_i, acc = online_softmax_block(q, k, v, None, m_i, l_i, acc, qk_scale, False, DOT_PRECISION)
    if whole_end < end:
        pos = whole_end + offs
        pos_ok = pos < end
        slots = tl.load(table + pos, mask=pos_ok, other=0).to(tl.int64)
        k = load_rows(k_base, slots, stride_kn, dims, pos_ok, dim_ok, True, EVEN_D)
        v = load_rows(v_base, slots, stride_vn, dims, pos_ok, dim_ok, True, EVEN_D)
        m_i, l_i, acc = online_softmax_block(q, k, v, pos_ok[None, :], m_i, l_i, acc, qk_scale, True, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def merge_partials_block(Lse, Part, stride_s, splits, live, dims, dim_ok, m_i, l_i, acc):
    """Folds the partials of one tile of splits into a running (max lse, sum of weights, weighted sum of outputs).
    Each split holds softmax-normalised partial output and its log-sum-exp; weighting by exp(lse - max lse) turns
    them back into one softmax over the whole context. Dead splits were never written (this step or any other):
    masked loads keep them out of the sum, and a tile with no live split leaves the state as it was."""
    lse = tl.load(Lse + splits, mask=live, other=float("-inf"))
    part = tl.load(Part + splits[:, None] * stride_s + dims[None, :], mask=live[:, None] & dim_ok[None, :], other=0.0)
    part = part.to(tl.float32)  # partials may be stored in 16 bits (kernels/shared_prefix_attention.py)
    m_new = tl.maximum(m_i, tl.max(lse, 0))
    alpha = tl.exp2(m_i - m_new)
    weight = tl.exp2(lse - m_new)
    return m_new, l_i * alpha + tl.sum(weight, 0), acc * alpha + tl.sum(weight[:, None] * part, 0)


# Programmatic dependent launch (PDL, Hopper and later). A kernel launched with launch_pdl=True may start while the
# kernel before it in the stream still runs, once every program of that one has called let_next_kernel_start (or
# finished); it must call wait_for_prior_kernel before it reads what the earlier kernel writes, and before it ends,
# so that its own completion still implies the earlier kernel's for whatever comes next in the stream. Work that
# does not depend on the earlier kernel (reading cached KV, weights) overlaps it: a short kernel's fixed cost of
# launch, first loads and drain (~10 us measured on an H100, bench/results/) hides behind the one before.
@triton.jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, nbytes):
    """Asks for nbytes from each pointer (16-byte aligned; nbytes a multiple of 16) to be copied into L2 and returns at
    once (Hopper's bulk prefetch: no registers or shared memory held). Issued before a kernel's PDL wait for data that
    predates the kernel before it, so that it streams in while that kernel finishes. L2 is where global memory is
    coherent: a line prefetched before another kernel writes it is updated by that write, never stale."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_kv_rows(
    table,
    start,
    end,
    K,
    V,
    kv_head,
    stride_kh,
    stride_vh,
    stride_kn,
    stride_vn,
    ROWS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
):
    """Asks L2 for KV head kv_head's K and V rows (ROW_BYTES each) of the table's positions [start, min(end, start +
    ROWS)), before a kernel's PDL wait: the slots and the KV they name predate the kernel before. Positions at or past
    end ask for slot 0's rows, the padding slot's (a harmless read). A [rows, 2] tile of pointers (each token's K row,
    then its V row) gives one prefetch per thread, where a [rows] vector of pointers would repeat in every warp."""
    pos = start + tl.arange(0, ROWS)
    slots = tl.load(table + pos, mask=pos < end, other=0).to(tl.int64)
    kv = tl.arange(0, 2)[None, :]
    kv_rows = tl.where(
        kv == 0,
        K + kv_head * stride_kh + slots[:, None] * stride_kn,
        V + kv_head * stride_vh + slots[:, None] * stride_vn,
    )
    prefetch_to_l2(kv_rows, tl.full([ROWS, 2], ROW_BYTES, tl.int32))


_PDL_DEVICES: dict = {}


def pdl_supported(device) -> bool:
    """Whether kernels on this device can use programmatic dependent launch: a CUDA device of compute capability
    9.0 or later and a Triton that exposes grid dependency control."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        major, _ = torch.cuda.get_device_capability(idx)
        _PDL_DEVICES[idx] = major >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
    return _PDL_DEVICES[idx]


# Which kernels launch with PDL, by kind: "norm" (RMSNorm), "qkv" (Q/K norms + RoPE + KV store), "attention" (decode
# attention's kernels, plain and shared-prefix), "small linear" (the skinny projections and gate/up + SiLU over a
# weight of at most SMALL_LINEAR_BYTES; "linear" over a larger one). Measured on an H100 with bench/pdl_bench.py
# (decode step as a CUDA graph; bench/results/kernels-h100-2026-11-25/): these kinds took Qwen3-0.6B's batch-1 step
# from 1.247 to 1.126 ms, where no smaller set gained (the gain is the launch gaps of a chain of short kernels);
# adding the projections over Qwen3-8B's 33-201 MB weights made its step slower (6.27 -> 6.92 ms), the other kinds
# left it as it was.
SMALL_LINEAR_BYTES = 16 << 20
PDL_KINDS = {"norm", "qkv", "attention", "small linear"}


def linear_kind(weight) -> str:
    return "small linear" if weight.numel() * weight.element_size() <= SMALL_LINEAR_BYTES else "linear"


def uses_pdl(device, kind: str) -> bool:
    """Whether a kernel of this kind launches with PDL: the device supports it, kernels.OPTIONS["pdl"] is on
    (--disable-pdl turns it off) and the kind is in PDL_KINDS."""
    return bool(kernels.OPTIONS["pdl"]) and kind in PDL_KINDS and pdl_supported(device)


def linear_uses_pdl(weight) -> bool:
    """Whether a projection over this weight launches with PDL (its kind by size: linear_kind)."""
    return uses_pdl(weight.device, linear_kind(weight))


def prefetches(device, kind: str) -> bool:
    """Whether a kernel of this kind prefetches what it can before its PDL wait: it launches with PDL (otherwise
    nothing runs before it to hide behind) and kernels.OPTIONS["pdl_prefetch"] is on (RADIXSERVE_KERNEL_OPTIONS=
    pdl_prefetch=0 turns it off)."""
    return bool(kernels.OPTIONS["pdl_prefetch"]) and uses_pdl(device, kind)


def pdl_args(device, kind: str) -> dict:
    """The launch arguments of a kernel built for PDL (a PDL constexpr), launch_pdl too where it uses it."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(device, kind) else {"PDL": False}


_COUNTERS: dict = {}


def zeroed_counters(device, n: int) -> torch.Tensor:
    """n int32 counts at 0, for kernels whose programs count arrivals and put the count back to 0 when the last one
    is done (the skinny projection's split-K): one buffer per device, shared by every such kernel (one stream runs
    them one after another). A bigger request allocates a bigger buffer; the older ones stay
    alive, since CUDA graphs captured with them keep their addresses."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(1 << 16, n), dtype=torch.int32, device=device))
    return buffers[-1]


_SM_COUNT = {}


def sm_count(device):
    if device.type != "cuda":
        return 4  # interpreter: a few programs are enough to exercise the split path
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def power_of_two_at_most(n: int) -> int:
    """Split counts rounded down to a power of two: a handful of values (1, 2, 4, ... 64), so that the scratch sizes
    and the tuned split policy see few distinct shapes (the counts themselves are runtime values of the kernels)."""
    return 1 << (max(1, int(n)).bit_length() - 1)
