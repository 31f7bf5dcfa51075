"""The read-only floor of the shared-prefix kernels' KV reads: a kernel with the same grid and the same gathers, which
reads every K and V row through the same table rows and does nothing with them but a sum.

No attention kernel that reads a prefix or a suffix this way can beat it, so issue 21's kernel-share targets are read
against it: bench/shared_prefix_kernel_bench.py prints its share beside the real kernels' (session 16 measured 78-80% of
the copy bandwidth for the prefix gathers and 89% for the suffix's on an H100; bench/results/
shared-prefix-pipeline-h100.md). Its loop is pipelined by tl.range(num_stages=): the reads run several blocks ahead.

The ceiling above that floor: the same number of bytes read as one contiguous buffer by a plain streaming kernel
(no table, no gathers, no attention), each call from HBM rather than L2 (enough distinct buffers that the last call's
bytes are evicted). A kernel share cannot be expected past it: on an H200 a 33.6 MB read, W1's prefix bytes a layer,
reaches 76% of the copy bandwidth, the 134 MB of gsp's prefix 101% (bench/results/session25-h200.md), since a short
read pays its ramp and its tail on fewer bytes.

    TRITON_INTERPRET=1 python -m bench.kv_read_floor      # CPU: the kernels' sums against torch's (the test runs this)
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.shared_prefix_batches import make_grouped_batch  # noqa: E402

# (BLOCK_N, num_warps, num_stages) tried per measurement; the best is the floor.
FLOOR_CONFIGS = [(64, 4, 3), (64, 4, 4), (32, 4, 4), (32, 2, 4), (16, 2, 3), (16, 1, 3), (64, 8, 3)]
INTERPRET_CONFIG = (16, 4, 1)
# (programs per SM, BLOCK, num_warps, num_stages) of the contiguous read; the best is the ceiling.
CEILING_CONFIGS = [(1, 4096, 4, 3), (2, 2048, 8, 4), (2, 2048, 4, 3), (4, 2048, 8, 4), (4, 4096, 4, 3), (8, 2048, 4, 3)]
# Distinct buffers a timed read cycles through: at least this many bytes in all, several times an H100's or H200's
# 50 MB of L2.
CEILING_CYCLE_BYTES = 400_000_000


@triton.jit
def _read_rows_kernel(
    Table,
    K,
    V,
    Out,
    Starts,
    Ends,
    Rows,
    stride_rt,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    # One program = one item (a prefix slice, or one request's own tokens) x one KV head, as the prefix and suffix
    # kernels' grids have it.
    item = tl.program_id(0) // NUM_KV_HEADS
    head = tl.program_id(0) % NUM_KV_HEADS
    start = tl.load(Starts + item)
    end = tl.load(Ends + item)
    table = Table + tl.load(Rows + item).to(tl.int64) * stride_rt
    offs = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        ok = n0 + offs < end
        slots = tl.load(table + n0 + offs, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + head * stride_kh + slots[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + head * stride_vh + slots[:, None] * stride_vn + dims[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) * v.to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _read_contiguous_kernel(X, Out, n_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    # Program p sums elements [p * n_per_program, (p + 1) * n_per_program), BLOCK at a time, several blocks in flight.
    base = X + tl.program_id(0).to(tl.int64) * n_per_program
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, n_per_program, BLOCK, num_stages=STAGES):
        acc += tl.load(base + i + offs).to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(acc, 0))


def read_contiguous(x, programs: int, config, out=None):
    """Launches the ceiling's kernel over the first programs x n_per_program elements of x (n_per_program: x's share
    per program, rounded down to BLOCK); returns each program's sum."""
    _, block, warps, stages = config
    n_per_program = x.numel() // programs // block * block
    out = torch.empty(programs, dtype=torch.float32, device=x.device) if out is None else out
    _read_contiguous_kernel[(programs,)](x, out, n_per_program, BLOCK=block, STAGES=stages, num_warps=warps)
    return out


def ceiling_seconds(nbytes: int, configs=CEILING_CONFIGS):
    """(best kernel seconds, its config) of a contiguous read of nbytes of bf16 from HBM (GPU): the profiler's time of
    one call, over buffers read in turn in one CUDA graph. Configs whose rounding would leave bytes unread are
    skipped, so each timed read covers at least 98% of nbytes (and is charged for all of them)."""
    from bench.gpu_timing import capture, kernel_times

    n = nbytes // 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(max(2, -(-CEILING_CYCLE_BYTES // nbytes)))]
    best = (float("inf"), None)
    for config in configs:
        programs = config[0] * sms
        if n // programs // config[1] * config[1] * programs < 0.98 * n:
            continue
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        graph = capture(
            lambda programs=programs, config=config, out=out: [read_contiguous(x, programs, config, out) for x in xs]
        )
        seconds = sum(s * c for s, c in kernel_times(graph.replay).values()) / len(xs)
        best = min(best, (seconds, config), key=lambda r: r[0])
        del graph
    xs.clear()
    torch.cuda.empty_cache()
    return best


def items(b, which: str, slices: int = 1):
    """(starts, ends, table rows) of the items a kernel reads: each group's prefix cut into `slices` near-equal slices
    ("prefix"), or each request's own tokens ("suffix")."""
    rows = []
    if which == "prefix":
        for length, row in zip(b["group_prefix_lens"].tolist(), b["group_prefix_rows"].tolist()):
            cuts = [length * s // slices for s in range(slices + 1)]
            rows += [(cuts[s], cuts[s + 1], row) for s in range(slices) if cuts[s] < cuts[s + 1]]
    else:
        starts, ends = b["req_suffix_start"].tolist(), b["seq_lens"].tolist()
        rows = list(zip(starts, ends, b["req_pool_indices"].tolist()))
    t = torch.tensor(rows, dtype=torch.int32, device=b["q"].device).reshape(-1, 3)
    return t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].contiguous()


def read_rows(b, item_bounds, config, out=None):
    """Launches the floor kernel over the items; returns each (item, KV head) program's sum of K * V."""
    starts, ends, rows = item_bounds
    block_n, warps, stages = config
    hkv, d = b["k_cache"].shape[1], b["k_cache"].shape[2]
    out = torch.empty(starts.numel() * hkv, dtype=torch.float32, device=starts.device) if out is None else out
    _read_rows_kernel[(starts.numel() * hkv,)](
        b["req_to_token"],
        b["k_cache"],
        b["v_cache"],
        out,
        starts,
        ends,
        rows,
        b["req_to_token"].stride(0),
        b["k_cache"].stride(0),
        b["k_cache"].stride(1),
        b["v_cache"].stride(0),
        b["v_cache"].stride(1),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        BLOCK_N=block_n,
        STAGES=stages,
        num_warps=warps,
    )
    return out


def expected_sums(b, item_bounds):
    """What read_rows returns, in torch."""
    k, v, table = b["k_cache"].float(), b["v_cache"].float(), b["req_to_token"].long()
    sums = []
    for start, end, row in zip(*(t.tolist() for t in item_bounds)):
        slots = table[row, start:end]
        sums.append((k[slots] * v[slots]).sum(dim=(0, 2)))  # [KV heads]
    return torch.stack(sums).flatten()


def floor_seconds(copies, which: str, slices: int, configs=FLOOR_CONFIGS):
    """(best kernel seconds per layer, its config) of the floor over the layer copies in one CUDA graph (GPU)."""
    from bench.gpu_timing import capture, kernel_times

    bounds = [items(c, which, slices) for c in copies]
    outs = [torch.empty(bd[0].numel() * c["k_cache"].shape[1], device="cuda") for c, bd in zip(copies, bounds)]
    best = (float("inf"), None)
    for config in configs:
        graph = capture(lambda: [read_rows(c, bd, config, o) for c, bd, o in zip(copies, bounds, outs)])
        seconds = sum(s * n for s, n in kernel_times(graph.replay).values()) / len(copies)
        best = min(best, (seconds, config), key=lambda r: r[0])
        del graph
    return best


def main():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("needs TRITON_INTERPRET=1 (set before Python starts: triton reads it at import) or a GPU")
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    g = torch.Generator().manual_seed(0)
    b = make_grouped_batch([(70, [9, 20, 3]), (33, [1, 5])], [40, 1], 8, 2, 32, torch.float32, device, g)
    failed = 0
    for which, slices in (("prefix", 1), ("prefix", 3), ("suffix", 1)):
        bounds = items(b, which, slices)
        config = INTERPRET_CONFIG if device == "cpu" else FLOOR_CONFIGS[0]
        got, want = read_rows(b, bounds, config), expected_sums(b, bounds)
        err = ((got - want).norm() / want.norm()).item()
        ok = err < 1e-5
        failed += not ok
        print(f"{which} slices {slices}: {bounds[0].numel()} items, rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    # The ceiling's kernel: each program's sum over its own run of a buffer, against torch's.
    x = torch.randn(3 * 5 * 64 + 7, generator=g).to(device)
    got = read_contiguous(x, 3, (1, 64, 4, 1))
    want = x[: 3 * 5 * 64].reshape(3, -1).sum(1)
    err = ((got - want).norm() / want.norm()).item()
    failed += err >= 1e-5
    print(f"contiguous 3 programs: rel err {err:.1e} {'ok' if err < 1e-5 else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
