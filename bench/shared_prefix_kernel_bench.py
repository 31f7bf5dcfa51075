"""Shared-prefix (grouped) decode attention against the plain decode kernel: correctness, then speed.

    python bench/shared_prefix_kernel_bench.py --out bench/results/shared-prefix-kernel-h100.md   # GPU
    python bench/shared_prefix_kernel_bench.py --check-only                                       # GPU, no timing
    TRITON_INTERPRET=1 python bench/shared_prefix_kernel_bench.py --interpret                     # CPU (CI)

A batch is G groups (a prefix of P_g tokens shared by the group's members, each member with its
own tokens after it) plus ungrouped requests, in shuffled batch order, with every slot scattered
over the cache and unused table entries pointing at real but wrong slots. Correctness compares
kernels.decode_attention_grouped with the plain decode kernel on the same batch (and, where it
fits, with the fp32 torch reference), outputs poisoned with NaN first. Timing is the median of
triton.testing.do_bench (L2 flushed between runs) and of CUDA-graph replays, after a warm-up.
"""

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
BYTES_PER_ELEMENT = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def make_grouped_batch(groups, ungrouped, hq, hkv, d, dtype, device, generator, prefix_row="member",
                       pad_groups=0):
    """groups: [(prefix_len, [own_len of each member])]; ungrouped: [seq_len]. own_len >= 1 (the new token).

    prefix_row "member": a group's prefix is read through its first member's row; "other": through a
    table row outside the batch that holds the same prefix slots (as a radix-tree node would).
    Returns the keyword arguments of decode_attention_grouped (without o and sm_scale) plus q.
    """
    g = generator
    reqs = [(gi, p, own) for gi, (p, owns) in enumerate(groups) for own in owns] + [(-1, 0, n) for n in ungrouped]
    reqs = [reqs[i] for i in torch.randperm(len(reqs), generator=g).tolist()]
    bsz = len(reqs)
    seq_lens = [p + own for _, p, own in reqs]
    num_slots = sum(p for p, _ in groups) + sum(own for _, _, own in reqs) + 64
    num_rows = bsz + len(groups) + 3
    table = torch.randint(0, num_slots, (num_rows, max(seq_lens) + 7), generator=g, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=g)[:bsz + len(groups)].tolist()
    slots = torch.randperm(num_slots, generator=g).to(torch.int32)
    cursor = 0

    def take(n):
        nonlocal cursor
        cursor += n
        return slots[cursor - n:cursor]

    prefix_slots = [take(p) for p, _ in groups]
    for gi, p in enumerate(prefix_slots):
        table[rows[bsz + gi], :len(p)] = p
    members = [[] for _ in groups]
    for b, (gi, p, own) in enumerate(reqs):
        if gi >= 0:
            table[rows[b], :p] = prefix_slots[gi]
            members[gi].append(b)
        table[rows[b], p:p + own] = take(own)
    prefix_rows = [rows[m[0]] if prefix_row == "member" else rows[bsz + gi] for gi, m in enumerate(members)]
    starts = [0]
    for m in members:
        starts.append(starts[-1] + len(m))
    starts += [starts[-1]] * pad_groups  # empty groups, as a CUDA-graph-padded table has

    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=g)))

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return dict(
        q=randn(bsz, hq, d), k_cache=randn(num_slots, hkv, d), v_cache=randn(num_slots, hkv, d),
        req_to_token=table.to(device), req_pool_indices=ints(rows[:bsz]), seq_lens=ints(seq_lens),
        group_prefix_lens=ints([p for p, _ in groups] + [0] * pad_groups),
        group_prefix_rows=ints(prefix_rows + [0] * pad_groups),
        group_member_start=ints(starts), group_members=ints([b for m in members for b in m]),
        req_group=ints([gi for gi, _, _ in reqs]), req_suffix_start=ints([p for _, p, _ in reqs]),
        max_seq_len=max(seq_lens), max_prefix_len=max([p for p, _ in groups] + [1]),
        max_group_size=max([len(m) for m in members] + [1]))


def plain_args(b):
    return (b["req_to_token"], b["req_pool_indices"], b["seq_lens"], b["q"].shape[-1] ** -0.5, b["max_seq_len"])


def run_plain(impl, b, o):
    impl.decode_attention(b["q"], b["k_cache"], b["v_cache"], o, *plain_args(b))


def run_grouped(impl, b, o, **splits):
    impl.decode_attention_grouped(
        b["q"], b["k_cache"], b["v_cache"], o, b["req_to_token"], b["req_pool_indices"], b["seq_lens"],
        b["group_prefix_lens"], b["group_prefix_rows"], b["group_member_start"], b["group_members"], b["req_group"],
        b["req_suffix_start"], b["q"].shape[-1] ** -0.5, b["max_seq_len"], b["max_prefix_len"], b["max_group_size"], **splits)


def rel_err(out, ref):
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left: some output element was never written
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_case(rows, impl, plain, reference, dtype, hq, hkv, d, groups, ungrouped, case, g, splits=None, fuse=None, **layout):
    """Grouped (impl) vs the plain decode kernel, both writing fp32; vs the fp32 reference when it fits.

    splits: (suffix, prefix) split counts forced on the Triton kernels instead of the automatic policy;
    fuse: force the merge fused into the suffix kernel (True) or a merge kernel (False).
    """
    b = make_grouped_batch(groups, ungrouped, hq, hkv, d, dtype, b_device(), g, **layout)
    out = torch.full(b["q"].shape, float("nan"), dtype=torch.float32, device=b["q"].device)
    forced = dict(num_suffix_splits=splits[0], num_prefix_splits=splits[1]) if splits else {}
    if fuse is not None:
        forced["fuse_merge"] = fuse
    run_grouped(impl, b, out, **forced)
    expect = torch.full_like(out, float("nan"))
    run_plain(plain, b, expect)
    err = rel_err(out, expect)
    ref_err = None
    context = sum(int(s) for s in b["seq_lens"].tolist())
    if reference is not None and context * hkv * d <= (1 << 28):  # the reference pads every request to max_len
        ref = torch.full_like(out, float("nan"))
        run_plain(reference, b, ref)
        ref_err = rel_err(out, ref)
    tol = TOLERANCE[dtype]
    ok = err < tol and (ref_err is None or ref_err < tol)
    shape = f"Hq{hq}/Hkv{hkv} D{d}"
    case += f" splits={splits[0]}/{splits[1]}" if splits else ""
    case += "" if fuse is None else (" fused merge" if fuse else " merge kernel")
    sizes = "+".join(str(len(m)) for _, m in groups) or "-"
    rows.append((str(dtype)[6:], shape, case, sizes, err, ref_err, tol, ok))
    ref_text = "-" if ref_err is None else f"{ref_err:.2e}"
    print(f"{str(dtype)[6:]:<9} {shape:<15} {case:<40} {err:10.2e} {ref_text:>10} {tol:8.0e} "
          f"{'ok' if ok else 'FAIL'}", flush=True)


_DEVICE = ["cuda"]


def b_device():
    return _DEVICE[0]


def run_checks(rows, impl, plain, reference, small, g):
    """small: interpreter-sized (CI). Covers GQA 1/4/8, D 64/128, 1-token prefixes, ungrouped requests,
    non-contiguous members, prefixes read through a row outside the batch, padding groups, several
    suffix and prefix splits."""
    if small:
        dtypes = [torch.float32, torch.float16]  # bf16 tl.dot is wrong in the Triton CPU interpreter
        shapes = [(4, 4, 64), (8, 2, 32), (8, 1, 128)]
        for dtype in dtypes:
            for hq, hkv, d in shapes:
                check_case(rows, impl, plain, reference, dtype, hq, hkv, d,
                           [(37, [1, 5, 20]), (1, [3, 1]), (16, [2, 9])], [1, 41, 6], "mixed groups + ungrouped", g)
        check_case(rows, impl, plain, reference, torch.float32, 4, 1, 32, [(70, [1, 2, 3, 4, 5])], [], "one group, "
                   "prefix via other row, 2 pads", g, prefix_row="other", pad_groups=2)
        for dtype in dtypes:
            check_case(rows, impl, plain, reference, dtype, 8, 2, 64, [(70, [1, 40, 9]), (3, [66])], [100, 1],
                       "ragged", g, splits=(3, 4))
        check_case(rows, impl, plain, reference, torch.float32, 8, 2, 64, [(70, [1, 40, 9]), (3, [66])], [100, 1],
                   "ragged", g, splits=(1, 3), fuse=False)
        check_case(rows, impl, plain, reference, torch.float32, 8, 2, 64, [(70, [1, 40, 9]), (3, [66])], [100, 1],
                   "ragged", g, splits=(1, 3), fuse=True)
        return
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        for hq, hkv, d in [(32, 8, 128), (16, 16, 64), (32, 4, 128), (14, 2, 64)]:
            check_case(rows, impl, plain, reference, dtype, hq, hkv, d,
                       [(2048, [256] * 16), (1, [5, 1]), (700, [1, 33, 300])], [1, 2000, 64], "mixed", g)
        check_case(rows, impl, plain, reference, dtype, 32, 8, 128, [(32768, [3, 200]), (4000, [100] * 256)],
                   [], "32K prefix; group of 256", g, prefix_row="other", pad_groups=5)
        for fuse in (True, False):
            check_case(rows, impl, plain, reference, dtype, 32, 8, 128, [(2048, [256] * 16)] * 8, [],
                       "benchmark shape (8 x 16, 2048 + 256)", g, fuse=fuse)


# --------------------------------------------------------------------------------------------------
# Timing (GPU)
# --------------------------------------------------------------------------------------------------


def timings(fn, graph_only=False):
    from triton.testing import do_bench, do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    events = None if graph_only else do_bench(fn, warmup=50, rep=300, return_mode="median")
    try:
        graph = do_bench_cudagraph(fn, rep=200, return_mode="median")
    except TypeError:  # older triton: no return_mode
        graph = do_bench_cudagraph(fn, rep=200)
    return events, graph


def kv_bytes(b, grouped):
    """The KV bytes a step must read: every request's whole context, or each prefix once plus own tokens."""
    per_token = 2 * b["k_cache"].shape[1] * b["k_cache"].shape[2] * BYTES_PER_ELEMENT[b["k_cache"].dtype]
    if not grouped:
        return int(b["seq_lens"].sum()) * per_token
    own = int((b["seq_lens"] - b["req_suffix_start"]).sum())
    return (own + int(b["group_prefix_lens"].sum())) * per_token


def bench_case(rows, tri, plain, group_size, num_requests, prefix_len, own_len, g, hq=32, hkv=8, d=128,
               dtype=torch.bfloat16):
    groups = [(prefix_len, [own_len] * group_size)] * (num_requests // group_size)
    b = make_grouped_batch(groups, [], hq, hkv, d, dtype, "cuda", g)
    o = torch.empty_like(b["q"])
    plain_ms = timings(lambda: run_plain(plain, b, o))
    grouped_ms = timings(lambda: run_grouped(tri, b, o))
    row = (num_requests, group_size, prefix_len, own_len, kv_bytes(b, False), kv_bytes(b, True),
           *plain_ms, *grouped_ms)
    rows.append(row)
    print(f"B{num_requests} x{group_size:<4} P{prefix_len:<6} own{own_len:<4} plain {plain_ms[0] * 1e3:8.1f} us "
          f"(graph {plain_ms[1] * 1e3:8.1f})  grouped {grouped_ms[0] * 1e3:8.1f} us (graph {grouped_ms[1] * 1e3:8.1f})"
          f"  speed-up {plain_ms[0] / grouped_ms[0]:5.2f}x / {plain_ms[1] / grouped_ms[1]:5.2f}x", flush=True)
    del b, o
    torch.cuda.empty_cache()


def bench_markdown(rows):
    lines = ["| requests | group size | shared P | own | KV read plain / grouped (MB) | plain us | grouped us | "
             "speed-up | plain us (graph) | grouped us (graph) | speed-up (graph) | plain / grouped GB/s (model) |",
             "|" + "---|" * 12]
    for n, gs, p, own, bp, bg, pe, pg, ge, gg in rows:
        lines.append(f"| {n} | {gs} | {p} | {own} | {bp / 1e6:.0f} / {bg / 1e6:.0f} | {pe * 1e3:.1f} | "
                     f"{ge * 1e3:.1f} | {pe / ge:.2f}x | {pg * 1e3:.1f} | {gg * 1e3:.1f} | **{pg / gg:.2f}x** | "
                     f"{bp / (pg * 1e-3) / 1e9:.0f} / {bg / (gg * 1e-3) / 1e9:.0f} |")
    return lines


def tune(tri, g, lines):
    """Prefix-kernel blocks, prefix split policy and fused/unfused merge on the target shape, timed as graph
    replays (eager timing of this path measures the host's launches). The best is applied to tri."""
    import itertools
    b = make_grouped_batch([(2048, [256] * 16)] * 8, [], 32, 8, 128, torch.bfloat16, "cuda", g)
    o = torch.empty_like(b["q"])
    base = dict(tri.PREFIX_CONFIG["16bit"])
    results = []
    lines += ["", "## Tuning (target shape, CUDA-graph replays, median)", "", "| prefix config | us |", "|---|---|"]
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = dict(base, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        tri.PREFIX_CONFIG["16bit"] = cfg
        try:
            ms = timings(lambda: run_grouped(tri, b, o), graph_only=True)[1]
        except Exception as exc:  # e.g. out of shared memory
            print(f"tune {cfg}: {type(exc).__name__}", flush=True)
            continue
        results.append((ms, cfg))
        lines.append(f"| {cfg} | {ms * 1e3:.1f} |")
        print(f"tune {cfg}: {ms * 1e3:.1f} us", flush=True)
    best_ms, best = min(results, key=lambda r: r[0])
    tri.PREFIX_CONFIG["16bit"] = best
    base_split = tri.PREFIX_SPLITS["min_split_tokens"]
    split_results = []
    for tokens in (128, 256, 512, 1024):
        tri.PREFIX_SPLITS["min_split_tokens"] = tokens
        ms = timings(lambda: run_grouped(tri, b, o), graph_only=True)[1]
        split_results.append((ms, tokens))
        lines.append(f"| best blocks, min_split_tokens {tokens} | {ms * 1e3:.1f} |")
        print(f"tune min_split_tokens {tokens}: {ms * 1e3:.1f} us", flush=True)
    tri.PREFIX_SPLITS["min_split_tokens"] = min(split_results)[1]
    unfused = timings(lambda: run_grouped(tri, b, o, fuse_merge=False), graph_only=True)[1]
    fused = timings(lambda: run_grouped(tri, b, o, fuse_merge=True), graph_only=True)[1]
    lines.append(f"| best, merge kernel / merge fused into the suffix kernel | {unfused * 1e3:.1f} / {fused * 1e3:.1f} |")
    chosen = f"prefix {best}, min_split_tokens {tri.PREFIX_SPLITS['min_split_tokens']} (before: {base}, {base_split})"
    lines += ["", f"Chosen and used below: {chosen}."]
    print(f"tune chose {chosen}; unfused {unfused * 1e3:.1f} us, fused {fused * 1e3:.1f} us", flush=True)


def profile_breakdown(tri, g, lines):
    """GPU time of each kernel of the grouped path on the target shape (torch profiler)."""
    b = make_grouped_batch([(2048, [256] * 16)] * 8, [], 32, 8, 128, torch.bfloat16, "cuda", g)
    o = torch.empty_like(b["q"])
    for fuse in (True, False):
        run_grouped(tri, b, o, fuse_merge=fuse)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run_grouped(tri, b, o, fuse_merge=fuse)
            torch.cuda.synchronize()
        lines += ["", f"Per-kernel GPU time, merge {'fused' if fuse else 'kernel'} (torch profiler, mean of 20):", ""]
        for evt in prof.key_averages():
            us = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
            if us:
                lines.append(f"- {evt.key}: {us:.1f} us")
                print(f"profile fuse={fuse} {evt.key}: {us:.1f} us", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="CPU tensors, TRITON_INTERPRET=1, small shapes")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also sweep the prefix kernel's blocks and splits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write a markdown report here")
    args = parser.parse_args()
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--interpret needs TRITON_INTERPRET=1 in the environment (triton reads it at import)")
    _DEVICE[0] = "cpu" if args.interpret else "cuda"
    from kernels import reference, shared_prefix_attention, triton_attention

    g = torch.Generator().manual_seed(args.seed)
    check_rows, bench_rows, extra_lines = [], [], []
    gpu_bench = not args.interpret and not args.check_only

    def write_report():
        if not args.out:
            return
        # The report names where it is kept in the repository, not the device machine's scratch folder.
        command = [a if a != args.out else f"bench/results/{os.path.basename(a)}" for a in sys.argv[1:]]
        lines = ["# Shared-prefix decode attention vs the plain decode kernel", "",
                 f"`python bench/shared_prefix_kernel_bench.py {' '.join(command)}` on "
                 f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
                 f"seed {args.seed}.", ""]
        if gpu_bench:
            lines += ["## Timing (Qwen3-8B attention shape: 32 q heads, 8 KV heads, head_dim 128, bf16)", "",
                      "Same batch for both paths (groups of `group size` requests, each `shared P` + `own` tokens, "
                      "members shuffled in the batch, slots scattered). `us`: triton do_bench median (eager "
                      "launches, L2 flushed); `(graph)`: median of CUDA-graph replays, as the model runner's decode "
                      "step runs. KV read: the model bytes (plain: every context; grouped: each prefix once + own "
                      "tokens); GB/s: grouped model bytes over its graph time.", ""]
            lines += bench_markdown(bench_rows) + extra_lines
        lines += ["", "## Correctness (relative L2 error, outputs in fp32)", "",
                  "| dtype | shape | case | group sizes | vs plain kernel | vs fp32 reference | tol | |",
                  "|---|---|---|---|---|---|---|---|"]
        for dt, shape, case, sizes, err, ref_err, tol, ok in check_rows:
            ref_text = "-" if ref_err is None else f"{ref_err:.2e}"
            lines.append(f"| {dt} | {shape} | {case} | {sizes} | {err:.2e} | {ref_text} | {tol:.0e} | "
                         f"{'ok' if ok else 'FAIL'} |")
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")

    if gpu_bench and args.tune:  # first, so that the checks and timings below use what it chose
        tune(shared_prefix_attention, g, extra_lines)
    started = time.time()
    print(f"{'dtype':<9} {'shape':<15} {'case':<40} {'vs plain':>10} {'vs ref':>10} {'tol':>8}")
    run_checks(check_rows, shared_prefix_attention, triton_attention, reference, args.interpret, g)
    failed = [r for r in check_rows if not r[-1]]
    print(f"checks: {len(check_rows) - len(failed)}/{len(check_rows)} pass in {time.time() - started:.0f} s")
    write_report()

    if gpu_bench:
        bench_case(bench_rows, shared_prefix_attention, triton_attention, 16, 128, 2048, 256, g)  # the target
        for size in (2, 4, 8, 32, 64, 128):
            bench_case(bench_rows, shared_prefix_attention, triton_attention, size, 128, 2048, 256, g)
        for prefix in (256, 512, 1024, 8192, 32768):
            bench_case(bench_rows, shared_prefix_attention, triton_attention, 16, 128, prefix, 256, g)
        bench_case(bench_rows, shared_prefix_attention, triton_attention, 16, 32, 1024, 128, g)
        try:
            profile_breakdown(shared_prefix_attention, g, extra_lines)
        except Exception as exc:  # the profiler's API moves between torch versions; the timings above stand
            print(f"profile failed: {exc!r}")
        write_report()
    print("ALL PASS" if not failed else f"{len(failed)} FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
