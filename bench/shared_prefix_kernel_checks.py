"""The correctness half of bench/shared_prefix_kernel_bench.py: the grouped path (kernels/shared_prefix_attention.py)
against the plain decode kernel on the same batch, and against the fp32 torch reference where it fits, outputs
poisoned with NaN; the cases run on the GPU, or interpreter-sized on the CPU (--interpret)."""

import torch

from bench.shared_prefix_batches import graph_padded, make_grouped_batch, rel_err, run_grouped, run_plain


TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def check_case(
    rows,
    impl,
    plain,
    reference,
    dtype,
    hq,
    hkv,
    d,
    groups,
    ungrouped,
    case,
    g,
    forced=None,
    graph_groups=None,
    **layout,
):
    """Grouped (impl) vs the plain decode kernel, both writing fp32; vs the fp32 reference when it fits. forced:
    keyword arguments of impl.decode_attention_grouped that override its policy (split counts, programs).
    graph_groups: the grouped call gets the table and bounds a decode CUDA graph of that many groups passes."""
    b = make_grouped_batch(groups, ungrouped, hq, hkv, d, dtype, b_device(), g, **layout)
    out = torch.full(b["q"].shape, float("nan"), dtype=torch.float32, device=b["q"].device)
    run_grouped(impl, graph_padded(b, 4 * b["max_seq_len"], graph_groups) if graph_groups else b, out, **(forced or {}))
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
    case = f"{impl.__name__.split('.')[-1]}: {case}" + "".join(f" {k}={v}" for k, v in (forced or {}).items())
    sizes = "+".join(str(len(m)) for _, m in groups) or "-"
    rows.append((str(dtype)[6:], shape, case, sizes, err, ref_err, tol, ok))
    ref_text = "-" if ref_err is None else f"{ref_err:.2e}"
    print(
        f"{str(dtype)[6:]:<9} {shape:<15} {case:<70} {err:10.2e} {ref_text:>10} {tol:8.0e} {'ok' if ok else 'FAIL'}",
        flush=True,
    )


DEVICE = ["cuda"]


def b_device():
    return DEVICE[0]


def run_checks(rows, paths, plain, reference, small, g, quick=False):
    """paths: {module: forced-policy cases}. small: interpreter-sized (CI). Covers GQA 1/4/7/8, D 64/128, 1-token
    prefixes, ungrouped requests, non-contiguous members, prefixes read through a row outside the batch, padding
    groups, several suffix splits and prefix slices. quick: fewer dtypes and shapes on the GPU."""
    for impl, forced_cases in paths.items():
        if small:
            for dtype in (torch.float32, torch.float16):  # bf16 tl.dot is wrong in the Triton CPU interpreter
                for hq, hkv, d in [(4, 4, 64), (8, 2, 32), (8, 1, 128)]:
                    check_case(
                        rows,
                        impl,
                        plain,
                        reference,
                        dtype,
                        hq,
                        hkv,
                        d,
                        [(37, [1, 5, 20]), (1, [3, 1]), (16, [2, 9])],
                        [1, 41, 6],
                        "mixed groups + ungrouped",
                        g,
                    )
            check_case(
                rows,
                impl,
                plain,
                reference,
                torch.float32,
                4,
                1,
                32,
                [(70, [1, 2, 3, 4, 5])],
                [],
                "one group, prefix via other row, 2 pads",
                g,
                prefix_row="other",
                pad_groups=2,
            )
            check_case(
                rows,
                impl,
                plain,
                reference,
                torch.float32,
                14,
                2,
                32,
                [(40, [3] * 6), (9, [1, 2])],
                [7],
                "GQA 7, a group over two member blocks",
                g,
            )
            check_case(
                rows,
                impl,
                plain,
                reference,
                torch.float32,
                8,
                2,
                32,
                [(300, [2, 5, 1]), (40, [7, 3])],
                [9],
                "padded as a CUDA graph (7 groups)",
                g,
                graph_groups=7,
            )
            for forced in forced_cases:
                for dtype in (torch.float32, torch.float16):
                    check_case(
                        rows,
                        impl,
                        plain,
                        reference,
                        dtype,
                        8,
                        2,
                        64,
                        [(70, [1, 40, 9]), (3, [66])],
                        [100, 1],
                        "ragged",
                        g,
                        forced,
                    )
            continue
        for dtype in (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32):
            for hq, hkv, d in (
                [(32, 8, 128), (16, 8, 128), (14, 2, 64)]
                if quick
                else [(32, 8, 128), (16, 8, 128), (16, 16, 64), (32, 4, 128), (14, 2, 64)]
            ):
                check_case(
                    rows,
                    impl,
                    plain,
                    reference,
                    dtype,
                    hq,
                    hkv,
                    d,
                    [(2048, [256] * 16), (1, [5, 1]), (700, [1, 33, 300])],
                    [1, 2000, 64],
                    "mixed",
                    g,
                )
            check_case(
                rows,
                impl,
                plain,
                reference,
                dtype,
                32,
                8,
                128,
                [(32768, [3, 200]), (4000, [100] * 256)],
                [],
                "32K prefix; group of 256",
                g,
                prefix_row="other",
                pad_groups=5,
            )
            for forced in forced_cases:
                check_case(
                    rows,
                    impl,
                    plain,
                    reference,
                    dtype,
                    32,
                    8,
                    128,
                    [(1024, [128] * 16)] * 8,
                    [],
                    "W1 shape (8 x 16, 1024 + 128)",
                    g,
                    forced,
                )
