"""A warm engine compiles no new Triton kernel variant in a later run, whatever the later run's batch makeup.

Triton compiles one binary per specialization key (constexprs, ints equal to 1 or divisible by 16, 16-byte
alignment of pointers); a key first met mid-serving is a compile of a second or more (seen in W1 runs on an H100).
bench/kernel_variants.py computes the keys with Triton's own binder; here the small W1-shaped workload runs twice
through InProcessEngine (in child processes, TRITON_INTERPRET=1: triton reads it when imported), the first run
queueing requests in waves and the second all at once, so that the second meets batch sizes, split counts and group
sizes the first did not: it must launch no variant the first did not. (Before the fix, commit ba728a4, it met two in
each mode: split counts as constexprs, and scratch strides whose divisibility by 16 followed the split count.)
"""

import os
import subprocess
import sys

import pytest
import torch

from bench.kernel_variant_keys import specialization_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interpreted(*argv):
    env = dict(os.environ, TRITON_INTERPRET="1", RADIXSERVE_KERNEL_BACKEND="triton")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def children():
    """This module's child processes, started together by its first test that needs one: each keeps one core busy for
    4-6 s while pytest only waits, so that two cores run them side by side. Each test reads its own children."""
    # Mode on runs serving's defaults, mode off turns the fused layer kernels off, so that the audit covers every kernel
    # either way.
    started = {
        "on": _interpreted(*SECOND_RUN, "--modes", "on"),
        "off": _interpreted(*SECOND_RUN, "--modes", "off", "--engine-args", '{"disable_fused_layer_kernels": true}'),
        "extend": _interpreted(*EXTEND_VARIANTS),
        "merge": _interpreted("-c", MERGE_CHECK),
    }
    yield started
    for child in started.values():
        if child.poll() is None:  # its test did not run (deselected) or gave up on it
            child.kill()
            child.wait()


# Split policy scaled to 20-token contexts (8-token slices), so that split counts follow the batch size as they do at
# W1's 1,152 tokens on an H100. --shadow records each launch's key with the same arguments and lets the torch twins
# compute: the keys (and this output) are those of the interpreted kernels, since EOS is ignored and outputs never
# change a batch's makeup, in ~3.5 s instead of ~18.5 s a mode on two cores. The kernels' results are checked by the
# interpreter tests (test_kernels_*.py).
SECOND_RUN = [
    "-m",
    "bench.kernel_variants",
    "--in-process",
    "--shadow",
    "--shape",
    "2",
    "4",
    "16",
    "2",
    "4",
    "--runs",
    "3,0",
    "--min-split-tokens",
    "8",
]


@pytest.mark.server
def test_second_run_in_another_batch_makeup_compiles_nothing_new(children):
    outputs = {mode: children[mode].communicate(timeout=300)[0] for mode in ("on", "off")}
    for mode, out in outputs.items():
        print(out[-6000:])
        assert "0 variant keys first launched after the warm-up run" in out, out[-6000:]
        assert children[mode].returncode == 0, out[-6000:]
        assert "run 2 (all at once): 0 new variant keys" in out
    # Not vacuous: start-up and the warm-up ran every kernel of the decode step (the extend kernel's variants at
    # start-up): in mode on the grouped decode's prefix and suffix kernels and the fused layer kernels, in mode off the
    # plain decode's split and merge kernels and the unfused ones.
    kernels = {
        "on": (
            "_prefix_kernel(",
            "_suffix_split_kernel(",
            "_qk_norm_rope_store_kernel(",
            "_gate_up_silu_kernel(",
            "_silu_and_mul_kernel(",
        ),
        "off": (
            "_decode_split_kernel(",
            "_merge_splits_kernel(",
            "_rope_kernel(",
            "_store_kv_kernel(",
            "_silu_and_mul_kernel(",
        ),
    }
    for mode, out in outputs.items():
        for name in (*kernels[mode], "_extend_kernel(", "_rmsnorm_kernel("):
            assert name in out, (mode, name)


# W1's shape at a quarter (4 system prompts of 512 tokens x 16 questions of 64), with the H100's block-size policy and
# its CUDA graphs modelled (bench/kernel_variant_keys.py): all at once, no eager step of the warm-up selects the extend
# kernel's 16-row blocks, while a run queueing requests 3 at a time does (a few short chunks: few rows per KV head).
# Before ModelRunner compiled every extend variant at start-up, that run met _extend_kernel(... BLOCK_M=16 ...) first:
# the compile of ~1.4 s seen in W1 runs on an H100.
EXTEND_VARIANTS = [
    "-m",
    "bench.kernel_variants",
    "--in-process",
    "--shadow",
    "--h100",
    "--modes",
    "on",
    "--shape",
    "4",
    "16",
    "512",
    "64",
    "8",
    "--runs",
    "0,3",
    "--engine-args",
    '{"chunked_prefill_size": 8192, "shared_prefix_min_tokens": 512, "max_running_requests": 1024,'
    ' "max_total_tokens": 200000}',
]


@pytest.mark.server
def test_extend_variants_of_every_batch_makeup_compile_at_start_up(children):
    child = children["extend"]
    out = child.communicate(timeout=400)[0]
    print(out[-6000:])
    assert "run 2 (waves of 3): 0 new variant keys" in out, out[-6000:]
    assert child.returncode == 0 and "0 variant keys first launched after the warm-up run" in out, out[-6000:]


def test_start_up_launches_every_extend_variant_the_h100_policy_can_select():
    # The three row-block sizes extend_config picks on an H100 at head_dim 128 (16 rows for short chunks, 64, 128 for
    # chunks of 2,048 tokens or more), each launched once by compile_extend_variants (recorded, not run), and the
    # merge of a small grid's key splits (a 1-token request is one: extend_num_splits).
    from bench.kernel_variant_keys import KernelVariants
    from kernels import triton_attention

    i32 = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    cache = torch.zeros(32, 2, 128)
    with KernelVariants(shadow=True, h100=True) as variants:
        triton_attention.compile_extend_variants(
            4, torch.float32, cache, cache, torch.zeros(2, 64, dtype=torch.int32), i32(0), i32(0), i32(1), i32(0)
        )
    keys = variants.new_in("start")
    extend = [k for k in keys if k.startswith("_extend_kernel(")]
    assert {k.split("BLOCK_M=")[1].split(",")[0] for k in extend} == {"16", "64", "128"}, keys
    assert len([k for k in keys if k.startswith("_merge_splits_kernel(")]) == 1, keys
    assert len(keys) == len(extend) + 1, keys


# The split kernels' merges fold partials 16 splits at a time: 40 plain splits, and 4 suffix + 20 prefix splits,
# take 3 and 2.
MERGE_CHECK = r"""
import torch
from kernels import reference, shared_prefix_attention, triton_attention
torch.manual_seed(0)
hq, hkv, d, slots = 4, 2, 16, 2048
k_cache, v_cache = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
table = torch.randperm(slots).to(torch.int32).view(2, 1024)
table[1, :600] = table[0, :600]  # both requests share a 600-token prefix
rows, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([900, 700], dtype=torch.int32)
q = torch.randn(2, hq, d)
expect = torch.empty_like(q)
reference.decode_attention(q, k_cache, v_cache, expect, table, rows, seq_lens, 0.25, 900)
out = torch.empty_like(q)  # 16-token slices: 40 splits, 38 of them live, over three merge tiles
triton_attention.decode_attention(q, k_cache, v_cache, out, table, rows, seq_lens, 0.25, 900, num_kv_splits=40,
                                  config={"BLOCK_N": 16})
torch.testing.assert_close(out, expect, rtol=0, atol=1e-5)
i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
grouped = torch.empty_like(q)  # 4 suffix splits + 19 live prefix slices of 20: two merge tiles
shared_prefix_attention.decode_attention_grouped(
    q, k_cache, v_cache, grouped, table, rows, seq_lens, i32(600), i32(0), i32(0, 2), i32(0, 1), i32(0, 0),
    i32(600, 600), 0.25, 900, 600, 2, num_suffix_splits=4, num_prefix_splits=20)
torch.testing.assert_close(grouped, expect, rtol=0, atol=1e-5)
print("MERGE OK")
"""


@pytest.mark.server
def test_merge_over_more_splits_than_one_tile_matches_reference(children):
    child = children["merge"]
    out = child.communicate(timeout=300)[0]
    assert child.returncode == 0 and "MERGE OK" in out, out[-4000:]


def test_keys_follow_triton_rules_and_ignore_batch_metadata():
    # The real JIT's rules, computed without a GPU: here the kernels are ordinary (compiled) JITFunctions.
    from kernels import triton_attention_kernels

    kernel = triton_attention_kernels._decode_split_kernel
    buf = torch.zeros(64, dtype=torch.int32)
    q, cache, mid = torch.zeros(4, 4, 16), torch.zeros(32, 2, 16), torch.zeros(4, 4, 16, 16)

    def key(req_rows, q_view=q, stride_rt=256, num_splits=2, min_splits=2):
        args = (
            q_view,
            cache,
            cache,
            buf,
            req_rows,
            buf[8:],
            mid,
            mid,
            q,
            *(q, q, buf, q, q, q, buf),  # no pending Q/K/V: the decode kernel's own Q/K norms, RoPE, store unused
            0.5,
            0.0,
            64,
            16,
            32,
            16,
            32,
            16,
            stride_rt,
            1024,
            256,
            16,
            64,
            16,
            64,
            16,
            *(0, 0, 0, 0, 0),
            num_splits,
            min_splits,
        )
        return specialization_key(
            kernel,
            args,
            dict(
                GROUP=2,
                HEAD_DIM=16,
                BLOCK_H=16,
                BLOCK_D=16,
                BLOCK_N=32,
                MIN_SPLIT_TOKENS=512,
                DOT_PRECISION="ieee",
                PREFETCH=False,
                PREPARE_QKV=False,
                HAS_NORM=False,
                HALF=1,
                PDL=False,
                num_warps=4,
                num_stages=1,
            ),
        )

    base = key(buf[0:])
    # Batch metadata: slices at any offset, and any split count, select the same binary.
    assert key(buf[3:]) == key(buf[5:]) == base
    assert key(buf[0:], num_splits=1) == key(buf[0:], num_splits=7) == key(buf[0:], num_splits=32) == base
    assert key(buf[0:], min_splits=1) == key(buf[0:], min_splits=16) == base
    # Specialised arguments: an int equal to 1, divisible by 16 or neither; a pointer aligned to 16 bytes or not.
    assert len({key(buf[0:], stride_rt=s) for s in (1, 7, 256, 512)}) == 3
    shifted = torch.zeros(q.numel() + 1)[1:].view(q.shape)  # 4 bytes past an aligned address
    assert key(buf[0:], q_view=shifted) != base
    assert "Req_pool_indices:*i32 any-align" in base and "num_splits:i32 free" in base
    assert "stride_rt:i32 %16" in base and "GROUP=2" in base
