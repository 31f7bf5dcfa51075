"""The shared-prefix kernel's L2 prefetch before its PDL wait (shared_prefix_attention.PREFIX_PREFETCH_TILES).

On the CPU (where the interpreter cannot run the prefetch's inline PTX): the kernel compiled offline for an H100 (sm_90)
has bulk L2 prefetches in its PTX with the option on and none with it off. On a GPU: the outputs are the same bit for
bit with the prefetch on and off, eagerly and as a CUDA graph pads the group table.
"""

import pytest
import torch

import kernels.shared_prefix_kernels as spk
from bench import shared_prefix_batches as batches

PREFETCH_PTX = "cp.async.bulk.prefetch.L2.global"


def _prefix_launch(monkeypatch):
    """(kernel, args, kwargs) of the prefix kernel's launch by decode_attention_grouped on a small bf16 batch on the
    CPU: its launches are recorded, not run."""
    from kernels import shared_prefix_attention

    launches = []

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    monkeypatch.setattr(shared_prefix_attention, "recordable", Recorded)
    g = torch.Generator().manual_seed(3)
    b = batches.make_grouped_batch([(300, [4, 9]), (64, [1, 2, 3])], [70], 32, 8, 128, torch.bfloat16, "cpu", g)
    batches.run_grouped(shared_prefix_attention, b, torch.empty_like(b["q"]))
    return next(launch for launch in launches if launch[0] is spk._prefix_kernel)


def _ptx_for_sm90(launch, prefetch_tiles):
    """The PTX of that launch's variant compiled offline for an H100, with PREFETCH_TILES set."""
    from bench.kernel_variant_keys import compiled_for_h100

    kernel, args, kwargs = launch
    return compiled_for_h100(kernel, args, dict(kwargs, PREFETCH_TILES=prefetch_tiles)).asm["ptx"]


@pytest.mark.server  # the offline compile runs ptxas, a subprocess
def test_prefetch_is_compiled_in_only_when_asked_for(monkeypatch):
    launch = _prefix_launch(monkeypatch)
    assert PREFETCH_PTX in _ptx_for_sm90(launch, 2)
    assert PREFETCH_PTX not in _ptx_for_sm90(launch, 0)


@pytest.mark.gpu
def test_gpu_outputs_equal_with_the_prefetch_on_and_off():
    from kernels import shared_prefix_attention, triton_attention

    g = torch.Generator().manual_seed(5)
    layout = [(1024, [128] * 16)] * 8 + [(300, [1, 40, 7]), (1, [3, 2])]
    b = batches.make_grouped_batch(layout, [500, 1], 32, 8, 128, torch.bfloat16, "cuda", g)
    assert triton_attention.prefetches_kv(b["k_cache"], b["v_cache"]), "the prefetch needs PDL on a Hopper GPU"
    old = shared_prefix_attention.PREFIX_PREFETCH_TILES
    outs = {}
    try:
        for tiles in (0, 2, 4):
            shared_prefix_attention.PREFIX_PREFETCH_TILES = tiles
            eager = torch.full(b["q"].shape, float("nan"), dtype=b["q"].dtype, device="cuda")
            batches.run_grouped(shared_prefix_attention, b, eager)
            padded = batches.graph_padded(b, 40960, 64)
            graphed = torch.full_like(eager, float("nan"))
            graph = torch.cuda.CUDAGraph()
            batches.run_grouped(shared_prefix_attention, padded, graphed)  # compiles outside the capture
            with torch.cuda.graph(graph):
                batches.run_grouped(shared_prefix_attention, padded, graphed)
            graphed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            outs[tiles] = (eager, graphed)
    finally:
        shared_prefix_attention.PREFIX_PREFETCH_TILES = old
    expect = torch.empty_like(outs[0][0])
    batches.run_plain(triton_attention, b, expect)
    assert batches.rel_err(outs[0][0], expect) < 2e-2
    for tiles in (2, 4):
        assert torch.equal(outs[tiles][0], outs[0][0]), tiles
        assert torch.equal(outs[tiles][1], outs[0][1]), tiles
