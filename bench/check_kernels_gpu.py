"""Correctness of the Triton kernels against their torch references.

    python -m bench.check_kernels_gpu                       # full set on the GPU (lengths up to 4,100, batch up to 256)
    python -m bench.check_kernels_gpu --out bench/results/kernels-check-h100.md
    python -m bench.check_kernels_gpu --interpret --small   # CPU, TRITON_INTERPRET=1 (what CI runs)
    python -m bench.check_kernels_gpu --only-fused          # GPU: Q/K prep, projections, norms

Every case draws fresh random inputs (never zeros), scatters the KV slots at random over a cache
larger than needed, fills the unused part of req_to_token with plausible-but-wrong slots, and
poisons outputs with NaN before the kernel runs. Error is ||out - ref|| / ||ref|| with the reference
computed in fp32 (fp32 output buffer) from the same inputs. Exit status 1 if any case fails.
"""

import argparse
import os
import sys
import time

from bench.check_projection_kernels import TOLERANCE, ProjectionChecks
from bench.kernel_check_cases import run_fused, run_full, run_small
from bench.paged_batch import make_paged_batch, rel_err
from bench.run_record import command_line


ELEMENTWISE_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}


class Checker(ProjectionChecks):
    def __init__(self, torch, ref, tri, device):
        self.torch, self.ref, self.tri, self.device = torch, ref, tri, device
        self.rows = []

    def record(self, kernel, dtype, shape, case, err, tol):
        ok = err < tol
        self.rows.append((kernel, str(dtype).replace("torch.", ""), shape, case, err, tol, ok))
        print(
            f"{kernel:<17} {self.rows[-1][1]:<9} {shape:<18} {case:<44} {err:10.2e} {tol:8.0e}  "
            f"{'ok' if ok else 'FAIL'}",
            flush=True,
        )

    def extend(self, dtype, hq, hkv, d, prefix_lens, extend_lens, case, g, num_splits=None):
        torch = self.torch
        b = make_paged_batch(torch, prefix_lens, extend_lens, hq, hkv, d, dtype, self.device, g)
        scale = d**-0.5
        args = (
            b["k_cache"],
            b["v_cache"],
            b["req_to_token"],
            b["req_pool_indices"],
            b["prefix_lens"],
            b["extend_lens"],
            b["extend_start_loc"],
            scale,
            b["max_extend_len"],
        )
        ref = torch.full(b["q"].shape, float("nan"), dtype=torch.float32, device=self.device)
        self.ref.extend_attention(b["q"], b["k"], b["v"], ref, *args)
        out = torch.full_like(b["q"], float("nan"))
        config = {"num_splits": num_splits} if num_splits else None
        self.tri.extend_attention(b["q"], b["k"], b["v"], out, *args, config=config)
        self.record(
            "extend_attention",
            dtype,
            f"Hq{hq}/Hkv{hkv} D{d}",
            case,
            rel_err(torch, out, ref),
            TOLERANCE[str(dtype).replace("torch.", "")],
        )

    def decode(self, dtype, hq, hkv, d, seq_lens, case, g, num_kv_splits=None, max_seq_len=None):
        """max_seq_len: the bound the split grid is sized for (a CUDA graph's context length), else the longest."""
        torch = self.torch
        # Decode sees the whole context through the table; the "new" token is just the last position.
        b = make_paged_batch(torch, [s - 1 for s in seq_lens], [1] * len(seq_lens), hq, hkv, d, dtype, self.device, g)
        scale = d**-0.5
        args = (b["req_to_token"], b["req_pool_indices"], b["seq_lens"], scale, max_seq_len or b["max_seq_len"])
        ref = torch.full(b["q"].shape, float("nan"), dtype=torch.float32, device=self.device)
        self.ref.decode_attention(b["q"], b["k_cache"], b["v_cache"], ref, *args)
        out = torch.full_like(b["q"], float("nan"))
        self.tri.decode_attention(b["q"], b["k_cache"], b["v_cache"], out, *args, num_kv_splits=num_kv_splits)
        splits = f" splits={num_kv_splits}" if num_kv_splits else ""
        self.record(
            "decode_attention",
            dtype,
            f"Hq{hq}/Hkv{hkv} D{d}",
            case + splits,
            rel_err(torch, out, ref),
            TOLERANCE[str(dtype).replace("torch.", "")],
        )

    def decode_prepared(self, dtype, hq, hkv, d, rotary_dim, norm, seq_lens, case, g, **split_args):
        """The plain decode kernel handed a step's pending Q/K norms, RoPE and K/V store (kernels.PendingQKV) against
        its twin (kernels/triton_qkv.py's, then decode): the output and both caches. split_args: num_kv_splits, or
        max_seq_len (a CUDA graph's bound)."""
        import kernels

        torch = self.torch
        bsz = len(seq_lens)
        b = make_paged_batch(torch, [s - 1 for s in seq_lens], [1] * bsz, hq, hkv, d, dtype, self.device, g)
        qkv = torch.randn(bsz, (hq + 2 * hkv) * d, generator=g).to(self.device, dtype)
        weights = [torch.randn(d, generator=g).to(self.device, dtype) + 1 for _ in range(2)] if norm else [None] * 2
        cos_sin = torch.randn(4096, rotary_dim, generator=g).to(self.device)
        positions = torch.randint(0, 4096, (bsz,), generator=g).to(self.device)  # rows of cos_sin
        loc = b["req_to_token"][b["req_pool_indices"].long(), b["seq_lens"].long() - 1].contiguous()
        max_seq_len = split_args.pop("max_seq_len", b["max_seq_len"])
        results = []
        for impl in (self.ref, self.tri):
            x, k_cache, v_cache = qkv.clone(), b["k_cache"].clone(), b["v_cache"].clone()
            q = x[:, : hq * d].view(bsz, hq, d)
            k = x[:, hq * d : (hq + hkv) * d].view(bsz, hkv, d)
            v = x[:, (hq + hkv) * d :].view(bsz, hkv, d)
            pending = kernels.PendingQKV(k, v, positions, cos_sin, *weights, 1e-6, loc)
            out = torch.full_like(q, float("nan"))
            args = (b["req_to_token"], b["req_pool_indices"], b["seq_lens"], d**-0.5, max_seq_len)
            extra = split_args if impl is self.tri else {}
            impl.decode_attention(q, k_cache, v_cache, out, *args, pending=pending, **extra)
            results.append((out, k_cache, v_cache))
        (o0, k0, v0), (o1, k1, v1) = results
        err = max(rel_err(torch, o1, o0), rel_err(torch, k1, k0), rel_err(torch, v1, v0))
        label = f"{'q/k norm, ' if norm else ''}rotary_dim {rotary_dim}, {case}"
        self.record("decode_prepared", dtype, f"Hq{hq}/Hkv{hkv} D{d}", label, err, TOLERANCE[str(dtype)[6:]])

    def qkv_prep(self, dtype, tokens, hq, hkv, d, rotary_dim, norm, g):
        """kernels/triton_qkv.py (Q/K norms + RoPE + KV store) against its twin, on strided views of one QKV row."""
        from kernels import triton_qkv

        torch = self.torch
        tol = ELEMENTWISE_TOLERANCE[str(dtype).replace("torch.", "")]

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(self.device, dtype)

        qkv = randn(tokens, (hq + 2 * hkv) * d)
        weights = (randn(d) + 1, randn(d) + 1) if norm else (None, None)
        cos_sin = torch.randn(4096, rotary_dim, generator=g).to(self.device)
        positions = torch.randint(0, 4096, (tokens,), generator=g).to(self.device)
        num_slots = 3 * tokens + 5
        caches = [randn(num_slots, hkv, d) for _ in range(2)]
        loc = torch.randperm(num_slots, generator=g)[:tokens].to(self.device, torch.int32)
        results = []
        for impl in (self.ref, triton_qkv):
            x, kc, vc = qkv.clone(), caches[0].clone(), caches[1].clone()
            views = (
                x[:, : hq * d].view(tokens, hq, d),
                x[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
                x[:, (hq + hkv) * d :].view(tokens, hkv, d),
            )
            impl.qk_norm_rope_store(*views, positions, cos_sin, *weights, 1e-6, kc, vc, loc)
            results.append((x, kc, vc))
        (x0, k0, v0), (x1, k1, v1) = results
        err = max(rel_err(torch, x1, x0), rel_err(torch, k1, k0), 0.0 if torch.equal(v1, v0) else float("inf"))
        self.record(
            "qkv_prep",
            dtype,
            f"T{tokens} {hq}/{hkv}x{d}",
            f"{'q/k norm, ' if norm else ''}rotary_dim {rotary_dim}, strided views",
            err,
            tol,
        )

    def store_kv(self, dtype, n, hkv, d, g, index_dtype):
        torch = self.torch
        num_slots = 3 * n + 5
        caches = [torch.randn(num_slots, hkv, d, generator=g).to(self.device, dtype) for _ in range(2)]
        # k/v as strided views of a wider buffer, as they come out of a fused qkv projection.
        fused = torch.randn(n, 3 * hkv, d, generator=g).to(self.device, dtype)
        k, v = fused[:, hkv : 2 * hkv], fused[:, 2 * hkv :]
        loc = torch.randperm(num_slots, generator=g)[:n].to(self.device, index_dtype)
        expect = [c.clone() for c in caches]
        self.ref.store_kv(k, v, expect[0], expect[1], loc)
        self.tri.store_kv(k, v, caches[0], caches[1], loc)
        same = torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
        self.record(
            "store_kv",
            dtype,
            f"N{n} Hkv{hkv} D{d}",
            f"loc {str(index_dtype)[6:]}, strided k/v",
            0.0 if same else float("inf"),
            1e-30,
        )

    def step_inputs(self, n, ring, g, write_table):
        """kernels.step_input_ids: placeholders and real ids mixed, and (write_table) a decode's new slots written
        into a table whose other entries must stay as they were."""
        torch = self.torch
        from kernels import triton_step_inputs

        future = torch.randint(0, 50_000, (ring,), generator=g).to(self.device)
        real = torch.randint(0, 50_000, (n,), generator=g)
        ring_index = torch.randint(0, ring, (n,), generator=g)
        ids = torch.where(torch.rand(n, generator=g) < 0.5, -(ring_index + 1), real).to(self.device)
        if write_table:
            table = torch.randint(0, 1000, (n + 3, 64), generator=g, dtype=torch.int32).to(self.device)
            rows = torch.randperm(n + 3, generator=g)[:n].to(self.device, torch.int32)
            positions = torch.randint(0, 64, (n,), generator=g).to(self.device)
            slots = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32).to(self.device)
            expect_table = table.clone()
            expect = self.ref.step_input_ids(ids, future, (expect_table, rows, positions, slots))
            got = triton_step_inputs.step_input_ids(ids, future, (table, rows, positions, slots))
            same = torch.equal(got, expect) and torch.equal(table, expect_table)
        else:
            same = torch.equal(triton_step_inputs.step_input_ids(ids, future), self.ref.step_input_ids(ids, future))
        case = "placeholders + table write" if write_table else "placeholders"
        self.record("step_inputs", torch.int64, f"N{n} ring{ring}", case, 0.0 if same else float("inf"), 1e-30)

    def elementwise(self, dtype, tokens, hidden, hq, hkv, d, rotary_dim, inter, g, ew):
        torch = self.torch
        tol = ELEMENTWISE_TOLERANCE[str(dtype).replace("torch.", "")]

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(self.device, dtype)

        x, res, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        self.record(
            "rmsnorm",
            dtype,
            f"T{tokens} H{hidden}",
            "no residual",
            rel_err(torch, ew.rmsnorm(x, w, 1e-6), self.ref.rmsnorm(x, w, 1e-6)),
            tol,
        )
        out, h = ew.rmsnorm(x, w, 1e-5, res)
        ref_out, ref_h = self.ref.rmsnorm(x, w, 1e-5, res)
        self.record(
            "rmsnorm",
            dtype,
            f"T{tokens} H{hidden}",
            "fused residual add (out, h)",
            max(rel_err(torch, out, ref_out), rel_err(torch, h, ref_h)),
            tol,
        )

        # q and k are strided windows of one fused qkv row, as the attention layer slices them.
        qkv = randn(tokens, (hq + 2 * hkv) * d)
        cos_sin = torch.randn(4096, rotary_dim, generator=g).to(self.device)
        positions = torch.randint(0, 4096, (tokens,), generator=g).to(self.device)
        expect = qkv.clone()
        self.ref.rope(
            expect[:, : hq * d].view(tokens, hq, d),
            expect[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
            positions,
            cos_sin,
        )
        ew.rope(
            qkv[:, : hq * d].view(tokens, hq, d),
            qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
            positions,
            cos_sin,
        )
        self.record(
            "rope",
            dtype,
            f"T{tokens} {hq}/{hkv}x{d}",
            f"strided q/k views, rotary_dim {rotary_dim}",
            rel_err(torch, qkv, expect),
            tol,
        )

        x = randn(tokens, 2 * inter)
        self.record(
            "silu_and_mul",
            dtype,
            f"T{tokens} I{inter}",
            "",
            rel_err(torch, ew.silu_and_mul(x), self.ref.silu_and_mul(x)),
            tol,
        )

    def markdown(self, header):
        lines = [header, "", "| kernel | dtype | shape | case | rel err | tol | |", "|---|---|---|---|---|---|---|"]
        for kernel, dtype, shape, case, err, tol, ok in self.rows:
            verdict = "ok" if ok else "FAIL"
            lines.append(f"| {kernel} | {dtype} | {shape} | {case} | {err:.2e} | {tol:.0e} | {verdict} |")
        failed = sum(not r[-1] for r in self.rows)
        lines += ["", f"{len(self.rows) - failed}/{len(self.rows)} cases pass."]
        return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="run the Triton kernels in the CPU interpreter")
    parser.add_argument("--small", action="store_true", help="interpreter-sized shapes")
    parser.add_argument("--only-fused", action="store_true", help="only the layer-fusion kernels, at model sizes")
    parser.add_argument("--out", help="write the result table here as markdown")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.interpret:
        # Must precede the first import of triton anywhere in this process.
        os.environ["TRITON_INTERPRET"] = "1"

    import torch

    import kernels
    from kernels import reference, triton_attention, triton_elementwise

    device = "cpu" if args.interpret else "cuda"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must stay fp32
    g = torch.Generator().manual_seed(args.seed)
    check = Checker(torch, reference, triton_attention, device)
    started = time.time()
    if args.only_fused:
        run_fused(check, torch, g)
    else:
        (run_small if args.small else run_full)(check, torch, g, triton_elementwise)

    # The public entry points must reach the same kernels through the dispatcher.
    kernels.set_backend("triton")
    b = make_paged_batch(torch, [9, 0], [5, 18], 4, 2, 32, torch.float32, device, g)
    via_api = torch.full_like(b["q"], float("nan"))
    direct = torch.full_like(b["q"], float("nan"))
    common = (
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        b["req_pool_indices"],
        b["prefix_lens"],
        b["extend_lens"],
        b["extend_start_loc"],
        0.2,
        b["max_extend_len"],
    )
    kernels.extend_attention(b["q"], b["k"], b["v"], via_api, *common)
    triton_attention.extend_attention(b["q"], b["k"], b["v"], direct, *common)
    check.record(
        "dispatch",
        torch.float32,
        "-",
        "kernels.extend_attention == triton",
        0.0 if torch.equal(via_api, direct) else float("inf"),
        1e-30,
    )

    elapsed = time.time() - started
    name = "CPU (TRITON_INTERPRET=1)" if args.interpret else torch.cuda.get_device_name()
    import triton

    header = (
        f"# Triton kernels vs torch reference: {name}\n\n"
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, triton {triton.__version__}, "
        f"`{command_line()}`, {elapsed:.0f} s"
    )
    failed = [r for r in check.rows if not r[-1]]
    print(f"\n{len(check.rows) - len(failed)}/{len(check.rows)} cases pass in {elapsed:.1f} s (seed {args.seed})")
    if args.out:
        with open(args.out, "w") as f:
            f.write(check.markdown(header))
    if failed:
        print("FAILED:", *[" ".join(map(str, r[:4])) for r in failed], sep="\n  ")
        sys.exit(1)
    print("ALL PASS")


if __name__ == "__main__":
    main()
