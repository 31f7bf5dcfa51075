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


def _ptx_for_sm90(prefetch_tiles):
    """The prefix kernel's PTX at the 16-bit serving config (Qwen3-8B attention shape, PDL on), compiled offline."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = spk._prefix_kernel
    const = dict(
        NUM_KV_HEADS=8,
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_M=64,
        BLOCK_D=128,
        BLOCK_N=64,
        DOT_PRECISION="tf32",
        PDL=True,
        PREFETCH_TILES=prefetch_tiles,
    )
    pointers = {"Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16", "Mid_o": "*bf16", "Mid_lse": "*fp32"}
    signature = {
        name: "constexpr"
        if name in const
        else pointers.get(name, "*i32")
        if name[0].isupper()
        else "fp32"
        if name == "qk_scale"
        else "i32"
        for name in fn.arg_names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    return compiled.asm["ptx"]


@pytest.mark.server  # the offline compile runs ptxas, a subprocess
def test_prefetch_is_compiled_in_only_when_asked_for():
    assert PREFETCH_PTX in _ptx_for_sm90(2)
    assert PREFETCH_PTX not in _ptx_for_sm90(0)


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
