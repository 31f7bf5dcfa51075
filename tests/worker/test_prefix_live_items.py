"""The shared-prefix kernel's programs walk the live groups' work items only (kernels.OPTIONS["prefix_live_items"]):
on a group table padded as a decode CUDA graph pads it, with fewer programs than items so that each program walks
several, the outputs equal those of one program per padded item bit for bit, and the plain decode kernel's within
rounding. Run under TRITON_INTERPRET=1 in a child process (CI) and on the GPU (gpu-marked)."""

import pytest
import torch

import kernels
from bench.shared_prefix_batches import graph_padded, make_grouped_batch, rel_err, run_grouped, run_plain
from kernels import shared_prefix_attention, triton_attention


def live_items_against_padded_grid(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, table: int) -> float:
    """Runs one padded batch with the option on and off; asserts the outputs equal; returns the error against the
    plain decode kernel."""
    g = torch.Generator().manual_seed(5)
    groups = [(37, [2, 3, 5]), (16, [1, 4]), (70, [6])]
    b = make_grouped_batch(groups, [9, 1], hq, hkv, d, dtype, device, g)
    padded = graph_padded(b, 4 * b["max_seq_len"], table)  # padding groups after the 3 live ones
    items = padded["group_prefix_lens"].shape[0] * hkv * padded["slicing"]["num_prefix_splits"]
    programs = shared_prefix_attention.prefix_programs(items, b["q"].device)
    assert programs < items  # each program walks several items
    outs = {}
    for live_items in (True, False):
        previous = kernels.configure(prefix_live_items=live_items)
        try:
            outs[live_items] = torch.full(b["q"].shape, float("nan"), dtype=dtype, device=device)
            run_grouped(shared_prefix_attention, padded, outs[live_items])
        finally:
            kernels.configure(**previous)
    assert torch.equal(outs[True], outs[False])
    plain = torch.empty_like(b["q"])
    run_plain(triton_attention, b, plain)
    return rel_err(outs[True], plain)


def interpreter_check() -> None:
    for hq, hkv, d in [(8, 2, 32), (4, 4, 16)]:
        err = live_items_against_padded_grid("cpu", torch.float32, hq, hkv, d, 7)
        print(f"Hq{hq}/Hkv{hkv} D{d}: live items equal the padded grid, {err:.2e} from plain decode", flush=True)
        assert err < 1e-5


@pytest.mark.server
def test_live_items_give_the_padded_grids_outputs_in_interpreter():
    from interpreter_child import run_interpreted  # tests/helpers (conftest.py); not in the child itself

    stdout = run_interpreted(__file__)
    assert stdout.count("live items equal the padded grid") == 2


@pytest.mark.gpu
def test_gpu_live_items_give_the_padded_grids_outputs():
    # 64 groups a table, as a graph of 128 requests pads it: more items than the programs that run at once.
    assert live_items_against_padded_grid("cuda", torch.float32, 32, 8, 128, 64) < 1e-5
    assert live_items_against_padded_grid("cuda", torch.bfloat16, 32, 8, 128, 64) < 2e-2


if __name__ == "__main__":
    interpreter_check()
