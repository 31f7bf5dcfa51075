"""The extend kernel's key split (kernels/triton_attention.py extend_num_splits): a grid too small for the device (a
lone cache hit) is launched with several programs per row block and merged; a grid that fills the device, or
kernels.OPTIONS["extend_key_splits"] off (--disable-extend-key-split), is launched as before, with no merge. The
launches are recorded, not run; the split kernels' results are checked against the torch reference by the
interpreter tests (bench/kernel_check_cases.py, "keys split")."""

import pytest
import torch

import kernels
from kernels import triton_attention


class Recorder:
    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, grid, args))


@pytest.fixture
def launches(monkeypatch):
    recorded = []
    monkeypatch.setattr(triton_attention, "_extend_kernel", Recorder(recorded, "extend"))
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", Recorder(recorded, "merge"))
    return recorded


def extend(num_requests, new_tokens, hq=16, hkv=8, d=128):
    t = num_requests * new_tokens
    q = torch.zeros(t, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(t, hkv, d, dtype=torch.bfloat16)
    cache = torch.zeros(64, hkv, d, dtype=torch.bfloat16)
    ints = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    triton_attention.extend_attention(
        q, k, k, torch.empty_like(q), cache, cache, torch.zeros(num_requests, 64, dtype=torch.int32),
        ints(*range(num_requests)), ints(*[1024] * num_requests), ints(*[new_tokens] * num_requests),
        ints(*range(0, t, new_tokens)), 1.0, new_tokens,
    )  # fmt: skip


def test_a_lone_hit_splits_its_keys_and_merges(launches):
    extend(1, 5)  # the interpreter's device has 4 "SMs": one row block per KV head, 8 programs, fills it twice
    assert [name for name, _, _ in launches] == ["extend"]
    launches.clear()
    extend(1, 5, hq=4, hkv=1)  # one program: split in 8, then the merge over every (token, head)
    (_, grid, args), (name, merge_grid, _) = launches
    assert grid[1] == 8 and name == "merge" and merge_grid == (5, 4)
    assert args[4].shape[2] == 8  # the partials: one per split


def test_a_grid_that_fills_the_device_or_the_option_off_is_not_split(launches):
    extend(4, 20, hq=4, hkv=1)
    assert [name for name, _, _ in launches] == ["extend"]
    launches.clear()
    previous = kernels.configure(extend_key_splits=False)
    try:
        extend(1, 5, hq=4, hkv=1)
    finally:
        kernels.configure(**previous)
    assert [name for name, _, _ in launches] == ["extend"] and launches[0][1][1] == 1
