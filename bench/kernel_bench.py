"""Speed of the Triton kernels against the machine's own ceilings and against torch.

    python -m bench.kernel_bench --out bench/results/kernels-h100.md          # defaults only
    python -m bench.kernel_bench --sweep --out ...                            # also try other block configs

Each kernel is timed with triton.testing.do_bench (CUDA events, L2 flushed between runs, median).
Bytes are the fewest the kernel must move (each input read once, each output written once; for
attention, the KV bytes of the context); FLOPs count the causal half only. They are printed beside
the measured device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate
(8192^3 on random data), and beside torch SDPA's flash backend on equal-length causal prefill.
"""

import argparse
import time

import torch
import triton
from triton.testing import do_bench

from kernels import reference, triton_attention, triton_elementwise

from bench.paged_batch import make_paged_batch
from bench.run_record import command_line

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


def median_ms(fn):
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def graph_median_ms(fn):
    """Replays of a captured CUDA graph: no host launch gaps, as in the model runner's decode step.

    Short kernels (tens of microseconds, two launches for decode) otherwise measure the host's launch
    latency as much as the GPU.
    """
    from triton.testing import do_bench_cudagraph

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except TypeError:  # older triton: no return_mode
        return do_bench_cudagraph(fn, rep=100)


def copy_bandwidth_tbs():
    # A function of its own so that the 4 GiB of copy buffers are freed on return, before the matmul allocates.
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / copy_ms / 1e9


def measure_ceilings():
    copy_tbs = copy_bandwidth_tbs()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b)
    mm_tflops = 2 * 8192**3 / mm_ms / 1e9
    return copy_tbs, mm_tflops


class Report:
    def __init__(self, copy_tbs, mm_tflops):
        self.copy_tbs, self.mm_tflops = copy_tbs, mm_tflops
        self.rows = []

    def add(self, name, config, ms, nbytes=None, flops=None, target=None):
        tbs = nbytes / ms / 1e9 if nbytes else None
        tflops = flops / ms / 1e9 if flops else None
        pct = ""
        if tbs:
            pct = f"{100 * tbs / self.copy_tbs:.0f}% BW"
        elif tflops:
            pct = f"{100 * tflops / self.mm_tflops:.0f}% MM"
        row = (name, config, ms, tbs, tflops, pct, target or "")
        self.rows.append(row)
        print(
            f"{name:<46} {config:<34} {ms * 1e3:9.1f} us  "
            f"{(f'{tbs:.2f} TB/s' if tbs else ''):>11} {(f'{tflops:.0f} TF/s' if tflops else ''):>9} "
            f"{pct:>8}  {target or ''}",
            flush=True,
        )
        return row

    def markdown(self, header):
        lines = [
            header,
            "",
            f"Measured ceilings: copy {self.copy_tbs:.2f} TB/s (read + write), bf16 matmul "
            f"{self.mm_tflops:.0f} TFLOP/s.",
            "",
            "| kernel / shape | config | time (us) | TB/s | TFLOP/s | of ceiling | target |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, config, ms, tbs, tflops, pct, target in self.rows:
            lines.append(
                f"| {name} | {config} | {ms * 1e3:.1f} | {f'{tbs:.2f}' if tbs else ''} | "
                f"{f'{tflops:.0f}' if tflops else ''} | {pct} | {target} |"
            )
        return "\n".join(lines) + "\n"


def decode_case(report, bsz, ctx, sweep, label, target, contiguous=False):
    g = torch.Generator().manual_seed(bsz * 7 + ctx)
    b = make_paged_batch(torch, [ctx - 1] * bsz, [1] * bsz, HQ, HKV, D, DTYPE, "cuda", g, spare_slots=0)
    if contiguous:
        # Slots in order: what a fresh server with no fragmentation hands out.
        n = bsz * ctx
        table = torch.arange(n, dtype=torch.int32, device="cuda").view(bsz, ctx)
        b["req_to_token"][b["req_pool_indices"].long(), :ctx] = table
    kv_bytes = 2 * bsz * ctx * HKV * D * DTYPE.itemsize
    o = torch.full_like(b["q"], float("nan"))
    args = (
        b["q"],
        b["k_cache"],
        b["v_cache"],
        o,
        b["req_to_token"],
        b["req_pool_indices"],
        b["seq_lens"],
        D**-0.5,
        ctx,
    )
    layout = "contiguous slots" if contiguous else "scattered slots"
    name = f"decode {label} {layout}"
    default_splits = triton_attention.decode_num_splits(bsz, HKV, ctx, torch.device("cuda"))
    best = report.add(
        name,
        f"default (splits={default_splits})",
        median_ms(lambda: triton_attention.decode_attention(*args)),
        nbytes=kv_bytes,
    )
    report.add(
        name,
        f"default (splits={default_splits}), CUDA graph",
        graph_median_ms(lambda: triton_attention.decode_attention(*args)),
        nbytes=kv_bytes,
        target=target,
    )
    if not sweep:
        return best
    for block_n, warps, stages in [
        (32, 4, 2),
        (32, 4, 4),
        (64, 4, 3),
        (64, 8, 2),
        (64, 8, 3),
        (128, 8, 2),
        (128, 8, 3),
        (64, 4, 4),
    ]:
        for splits in sorted({default_splits, max(1, default_splits // 2), default_splits * 2}):
            cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = median_ms(lambda: triton_attention.decode_attention(*args, num_kv_splits=splits, config=cfg))
            except Exception as e:  # a config that does not fit shared memory is a result too
                print(f"  {cfg} splits={splits}: {type(e).__name__}")
                continue
            report.add(name, f"N{block_n} w{warps} s{stages} splits={splits}", ms, nbytes=kv_bytes)
    return best


def extend_flops(prefix_lens, extend_lens, hq, d):
    total = 0
    for p, e in zip(prefix_lens, extend_lens):
        total += hq * d * 4 * (e * p + e * (e + 1) // 2)  # QK^T and PV, causal half of the new block
    return total


EXTEND_SWEEP = [
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
    (64, 32, 4, 2),
    (128, 32, 8, 4),
    (128, 32, 8, 3),
    (64, 128, 8, 2),
    (128, 128, 8, 2),
]
SHORT_SWEEP = [(16, 64, 4, 3), (16, 32, 4, 3), (16, 128, 4, 2), (32, 64, 4, 3), (16, 64, 4, 4)]


def extend_case(report, prefix_lens, extend_lens, sweep, label, target, configs=EXTEND_SWEEP):
    g = torch.Generator().manual_seed(sum(prefix_lens) + 3)
    b = make_paged_batch(torch, prefix_lens, extend_lens, HQ, HKV, D, DTYPE, "cuda", g, spare_slots=0)
    o = torch.full_like(b["q"], float("nan"))
    args = (
        b["q"],
        b["k"],
        b["v"],
        o,
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        b["req_pool_indices"],
        b["prefix_lens"],
        b["extend_lens"],
        b["extend_start_loc"],
        D**-0.5,
        b["max_extend_len"],
    )
    flops = extend_flops(prefix_lens, extend_lens, HQ, D)
    default = triton_attention.extend_config(DTYPE, D, torch.device("cuda"), max(extend_lens), HQ // HKV)
    best = report.add(
        f"extend {label}",
        "default " + "/".join(str(v) for v in default.values()),
        median_ms(lambda: triton_attention.extend_attention(*args)),
        flops=flops,
        target=target,
    )
    results = {}
    if sweep:
        for bm, bn, warps, stages in configs:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            try:
                ms = median_ms(lambda: triton_attention.extend_attention(*args, config=cfg))
            except Exception as e:
                print(f"  {cfg}: {type(e).__name__}")
                continue
            results[(bm, bn, warps, stages)] = report.add(
                f"extend {label}", f"M{bm} N{bn} w{warps} s{stages}", ms, flops=flops
            )
    return best, b


def sdpa_flash(report, bsz, seq, target):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(5)
    q = torch.randn(bsz, HQ, seq, D, generator=g).to("cuda", DTYPE)
    # SDPA's flash backend wants equal head counts: expand K/V outside the timed region.
    k = torch.randn(bsz, HKV, seq, D, generator=g).to("cuda", DTYPE).repeat_interleave(HQ // HKV, dim=1)
    v = torch.randn(bsz, HKV, seq, D, generator=g).to("cuda", DTYPE).repeat_interleave(HQ // HKV, dim=1)
    flops = extend_flops([0] * bsz, [seq] * bsz, HQ, D)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    return report.add(f"torch SDPA flash, {bsz} x {seq} causal", "", ms, flops=flops, target=target)


def elementwise(report):
    tokens, hidden, inter = 8192, 4096, 12288
    g = torch.Generator().manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to("cuda", DTYPE)

    x, res, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    compiled = {}
    try:
        compiled["rmsnorm"] = torch.compile(reference.rmsnorm, dynamic=False)
        compiled["silu_and_mul"] = torch.compile(reference.silu_and_mul, dynamic=False)
        compiled["rope"] = torch.compile(reference.rope, dynamic=False)
    except Exception as e:
        print("torch.compile unavailable:", e)
    nbytes = 4 * tokens * hidden * DTYPE.itemsize  # read x, residual; write out, h (+ weight, negligible)
    for impl, fn in [
        ("triton", lambda: triton_elementwise.rmsnorm(x, w, 1e-6, res)),
        ("torch eager", lambda: reference.rmsnorm(x, w, 1e-6, res)),
        ("torch.compile", lambda: compiled["rmsnorm"](x, w, 1e-6, res)),
    ]:
        try:
            report.add(f"rmsnorm + residual [{tokens}, {hidden}]", impl, median_ms(fn), nbytes=nbytes)
        except Exception as e:
            print(f"  rmsnorm {impl}: {type(e).__name__}: {e}")

    gate_up = randn(tokens, 2 * inter)
    nbytes = 3 * tokens * inter * DTYPE.itemsize
    for impl, fn in [
        ("triton", lambda: triton_elementwise.silu_and_mul(gate_up)),
        ("torch eager", lambda: reference.silu_and_mul(gate_up)),
        ("torch.compile", lambda: compiled["silu_and_mul"](gate_up)),
    ]:
        try:
            report.add(f"silu_and_mul [{tokens}, 2x{inter}]", impl, median_ms(fn), nbytes=nbytes)
        except Exception as e:
            print(f"  silu_and_mul {impl}: {type(e).__name__}: {e}")

    qkv = randn(tokens, (HQ + 2 * HKV) * D)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(tokens, HKV, D)
    positions = torch.randint(0, 32768, (tokens,), generator=g).to("cuda")
    cos_sin = torch.randn(32768, D, generator=g).to("cuda")
    nbytes = 2 * tokens * (HQ + HKV) * D * DTYPE.itemsize  # q and k read and written in place
    for impl, fn in [
        ("triton", lambda: triton_elementwise.rope(q, k, positions, cos_sin)),
        ("torch eager", lambda: reference.rope(q, k, positions, cos_sin)),
        ("torch.compile", lambda: compiled["rope"](q, k, positions, cos_sin)),
    ]:
        try:
            report.add(f"rope in place, strided q/k [{tokens}, {HQ}+{HKV}, {D}]", impl, median_ms(fn), nbytes=nbytes)
        except Exception as e:
            print(f"  rope {impl}: {type(e).__name__}: {e}")

    kv = randn(tokens, 2 * HKV, D)
    k_new, v_new = kv[:, :HKV], kv[:, HKV:]
    k_cache, v_cache = randn(4 * tokens, HKV, D), randn(4 * tokens, HKV, D)
    loc = torch.randperm(4 * tokens, generator=g)[:tokens].to("cuda", torch.int32)
    nbytes = 4 * tokens * HKV * D * DTYPE.itemsize
    for impl, fn in [
        ("triton", lambda: triton_attention.store_kv(k_new, v_new, k_cache, v_cache, loc)),
        ("torch index_put", lambda: reference.store_kv(k_new, v_new, k_cache, v_cache, loc)),
    ]:
        report.add(f"store_kv scattered [{tokens}, {HKV}, {D}]", impl, median_ms(fn), nbytes=nbytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time other extend block/warp/stage configs")
    parser.add_argument("--sweep-decode", action="store_true", help="also time other decode configs and split counts")
    parser.add_argument("--out", help="write the table here as markdown")
    parser.add_argument("--skip-elementwise", action="store_true")
    args = parser.parse_args()
    started = time.time()
    copy_tbs, mm_tflops = measure_ceilings()
    report = Report(copy_tbs, mm_tflops)
    print(f"copy {copy_tbs:.2f} TB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s")

    decode_case(report, 64, 4096, args.sweep_decode, "64 x 4096", ">= 75% BW")
    decode_case(report, 64, 4096, False, "64 x 4096", "", contiguous=True)
    decode_case(report, 1, 32768, args.sweep_decode, "1 x 32768", ">= 50% BW")
    decode_case(report, 1, 32768, False, "1 x 32768", "", contiguous=True)
    decode_case(report, 256, 1024, False, "256 x 1024", "")

    extend_case(report, [2048] * 8, [2048] * 8, args.sweep, "8 x 2048 new over 2048 prefix", ">= 40% MM")
    ours = extend_case(report, [0] * 8, [4096] * 8, args.sweep, "8 x 4096 causal, no prefix", ">= 0.8x SDPA")[0]
    theirs = sdpa_flash(report, 8, 4096, "")
    print(f"extend vs SDPA flash on 8 x 4096 causal: {theirs[2] / ours[2]:.2f}x SDPA speed (default config)")
    # Decodes inside the extend kernel (mixed batches) against the decode kernel on the same work.
    extend_case(report, [1000] * 64, [1] * 64, args.sweep, "64 decodes (extend 1 over 1000)", "", SHORT_SWEEP)
    decode_case(report, 64, 1001, False, "64 x 1001 (same work, decode kernel)", "")
    extend_case(report, [0] + [1000] * 63, [2048] + [1] * 63, False, "mixed: 2048 chunk + 63 decodes over 1000", "")
    extend_case(report, [0], [2048], False, "the 2048 chunk alone", "")

    if not args.skip_elementwise:
        elementwise(report)

    header = (
        f"# Kernel speed: {torch.cuda.get_device_name()}\n\n"
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, triton {triton.__version__}, "
        f"`{command_line()}`, {time.time() - started:.0f} s. "
        f"Shapes: {HQ} query / {HKV} KV heads, head_dim {D}, bf16. "
        f"Extend vs SDPA flash (8 x 4096 causal): {theirs[2] / ours[2]:.2f}x."
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.markdown(header))


if __name__ == "__main__":
    main()
