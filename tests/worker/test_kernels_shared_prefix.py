"""Shared-prefix (grouped) decode attention equals plain decode attention.

The torch twin runs in-process on random groups; the Triton kernels run under TRITON_INTERPRET=1 in
a child process (triton reads that variable when it is imported), through the same script that
checks and times them on the GPU (bench/shared_prefix_kernel_bench.py --interpret).
"""

import importlib.util
import os
import random

import pytest
import torch

import kernels
from kernels import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SCRIPT = os.path.join(ROOT, "bench", "shared_prefix_kernel_bench.py")


def _bench_module():
    spec = importlib.util.spec_from_file_location("shared_prefix_kernel_bench", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench_module()


def _random_layout(rng):
    """A few groups (sizes 1..6, prefixes from 1 token) and a few ungrouped requests, all lengths random."""
    groups = []
    for _ in range(rng.randint(1, 4)):
        prefix = rng.choice([1, 2, rng.randint(1, 90)])
        groups.append((prefix, [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]))
    ungrouped = [rng.randint(1, 120) for _ in range(rng.randint(0, 4))]
    return groups, ungrouped


def _grouped_vs_plain(groups, ungrouped, hq, hkv, d, seed, **layout):
    g = torch.Generator().manual_seed(seed)
    b = bench.make_grouped_batch(groups, ungrouped, hq, hkv, d, torch.float32, "cpu", g, **layout)
    out = torch.full(b["q"].shape, float("nan"))
    bench.run_grouped(reference, b, out)
    expect = torch.full_like(out, float("nan"))
    bench.run_plain(reference, b, expect)
    return out, expect, b


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 128), (8, 1, 64), (16, 2, 128)])
def test_twin_equals_plain_decode_on_random_groups(hq, hkv, d):
    rng = random.Random(hq * 1000 + hkv * 10 + d)
    for trial in range(4):
        groups, ungrouped = _random_layout(rng)
        layout = dict(prefix_row=rng.choice(["member", "other"]), pad_groups=rng.randint(0, 2))
        out, expect, _ = _grouped_vs_plain(groups, ungrouped, hq, hkv, d, rng.randrange(1 << 30), **layout)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-5, msg=f"{groups} {ungrouped} {layout}")


def test_twin_members_are_not_contiguous_and_prefix_matters():
    # Large group, shuffled into the batch; then a check that the prefix really is read from the
    # group's row: pointing one group at a row with other slots must change its members' outputs.
    groups = [(50, [3] * 12), (1, [4, 9])]
    out, expect, b = _grouped_vs_plain(groups, [7, 1], 8, 2, 64, seed=5)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-5)
    members = b["group_members"][: int(b["group_member_start"][1])].long()
    assert (members.diff() != 1).any(), "the layout should interleave groups and ungrouped requests"
    wrong = dict(b, group_prefix_rows=b["group_prefix_rows"].flip(0))
    moved = torch.empty_like(out)
    bench.run_grouped(reference, wrong, moved)
    assert not torch.allclose(moved[members], expect[members], atol=1e-3)


def test_dispatch_reaches_twin_on_cpu_and_matches():
    groups, ungrouped = [(33, [2, 5, 1])], [10]
    g = torch.Generator().manual_seed(3)
    b = bench.make_grouped_batch(groups, ungrouped, 4, 2, 64, torch.float32, "cpu", g)
    out = torch.full(b["q"].shape, float("nan"))
    previous = kernels.get_backend()
    kernels.set_backend("auto")
    try:
        bench.run_grouped(kernels, b, out)
    finally:
        kernels.set_backend(previous)
    expect = torch.empty_like(out)
    bench.run_plain(reference, b, expect)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-5)


@pytest.mark.server
def test_triton_kernels_match_plain_decode_in_interpreter():
    from interpreter_child import run_interpreted  # tests/helpers (conftest.py)

    stdout = run_interpreted(BENCH_SCRIPT, "--interpret", "--seed", str(random.randrange(1 << 16)))
    assert "ALL PASS" in stdout
    assert "shared_prefix_attention: ragged" in stdout  # the split path's own cases ran, not none
    assert stdout.count(" ok\n") >= 17  # every case ran


@pytest.mark.gpu
def test_gpu_grouped_matches_plain_kernel():
    # The grouped path on a mixed layout, and with the group table padded as a CUDA graph pads it.
    from bench import shared_prefix_kernel_checks as checks
    from bench.shared_prefix_batches import graph_padded
    from kernels import shared_prefix_attention, triton_attention

    checks.DEVICE[0] = "cuda"
    rows = []
    g = torch.Generator().manual_seed(11)
    layout = ([(2048, [256] * 16), (1, [5, 1]), (700, [1, 33, 300])], [1, 2000, 64])
    for dtype in (torch.bfloat16, torch.float32):
        checks.check_case(
            rows, shared_prefix_attention, triton_attention, reference, dtype, 32, 8, 128, *layout, "mixed", g
        )
    b = bench.make_grouped_batch([(1024, [128] * 16)] * 8, [], 32, 8, 128, torch.bfloat16, "cuda", g)
    out = torch.full(b["q"].shape, float("nan"), device="cuda")
    bench.run_grouped(shared_prefix_attention, graph_padded(b, 40960, 64), out)
    expect = torch.empty_like(out)
    bench.run_plain(triton_attention, b, expect)
    err = bench.rel_err(out, expect)
    rows.append(("bfloat16", "W1 padded", "", "", err, None, 2e-2, err < 2e-2))
    assert rows and all(r[-1] for r in rows), rows
