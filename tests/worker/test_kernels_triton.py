"""The Triton kernels against the torch references.

In CI (CPU only) they run under TRITON_INTERPRET=1. Triton reads that variable when it is imported,
so the interpreted run happens in a child process (python -m bench.check_kernels_gpu --interpret --small)
and the rest of the suite keeps a normal triton. The `gpu` tests run the compiled kernels for real
and are skipped without CUDA (tests/conftest.py).
"""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_SCRIPT = os.path.join(ROOT, "bench", "check_kernels_gpu.py")


def _child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.mark.server
def test_triton_kernels_match_reference_in_interpreter():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.check_kernels_gpu",
            "--interpret",
            "--small",
            "--seed",
            str(random.randrange(1 << 16)),
        ],
        cwd=ROOT,
        env=_child_env(TRITON_INTERPRET="1", RADIXSERVE_KERNEL_BACKEND="triton"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(result.stdout[-4000:], result.stderr[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL PASS" in result.stdout
    # Every kernel family was exercised, not just imported.
    for name in (
        "extend_attention",
        "decode_attention",
        "store_kv",
        "step_inputs",
        "rmsnorm",
        "rope",
        "silu_and_mul",
        "dispatch",
        "qkv_prep",
        "gate_up_silu",
        "skinny_linear",
        "norm_in_projections",
    ):
        assert f"\n{name} " in "\n" + result.stdout, name


@pytest.mark.server
def test_backend_comes_from_environment():
    # The three children at once: each is mostly the import of torch and triton (~1.3 s), which two cores share.
    code = "import kernels, sys; sys.stdout.write(kernels.get_backend())"
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(RADIXSERVE_KERNEL_BACKEND=name),
        )
        for name in ("reference", "triton", "fast")
    }
    outputs = {name: child.communicate(timeout=120) for name, child in children.items()}
    for name in ("reference", "triton"):
        out, err = outputs[name]
        assert children[name].returncode == 0, err
        assert out == name
    assert children["fast"].returncode != 0 and "unknown kernel backend" in outputs["fast"][1]


# ----------------------------------------------------------------------------------------------
# On a real GPU
# ----------------------------------------------------------------------------------------------


def _check_module():
    spec = importlib.util.spec_from_file_location("check_kernels_gpu", CHECK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_all_ok(checker):
    failed = [row for row in checker.rows if not row[-1]]
    assert checker.rows and not failed, failed


@pytest.mark.gpu
def test_gpu_small_set():
    from kernels import reference, triton_attention, triton_elementwise

    check = _check_module()
    checker = check.Checker(torch, reference, triton_attention, "cuda")
    check.run_small(checker, torch, torch.Generator().manual_seed(1), triton_elementwise)
    _assert_all_ok(checker)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(32, 32, 64), (32, 16, 128), (32, 8, 128), (32, 4, 64)])
def test_gpu_bf16_attention(hq, hkv, d):
    from kernels import reference, triton_attention

    check = _check_module()
    checker = check.Checker(torch, reference, triton_attention, "cuda")
    g = torch.Generator().manual_seed(hq + hkv + d)
    rng = random.Random(d)
    checker.extend(torch.bfloat16, hq, hkv, d, [0, 1000, 5, 129], [777, 1, 64, 1], "mixed", g)
    checker.extend(
        torch.bfloat16,
        hq,
        hkv,
        d,
        [rng.randint(0, 300) for _ in range(40)],
        [rng.randint(1, 100) for _ in range(40)],
        "40 random",
        g,
    )
    checker.extend(torch.bfloat16, hq, hkv, d, [300] * 9, [1] * 9, "short-extend config", g)
    checker.decode(torch.bfloat16, hq, hkv, d, [rng.randint(1, 3000) for _ in range(33)], "33 random", g)
    checker.decode(torch.bfloat16, hq, hkv, d, [5000], "one long", g)
    _assert_all_ok(checker)


@pytest.mark.gpu
def test_gpu_auto_backend_dispatches_to_triton():
    import kernels
    from kernels import reference

    previous = kernels.get_backend()
    kernels.set_backend("auto")
    try:
        x = torch.randn(64, 2 * 300, device="cuda", dtype=torch.bfloat16)
        out = kernels.silu_and_mul(x)
        torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=1e-2, atol=1e-2)
        kernels.set_backend("reference")
        assert torch.equal(kernels.silu_and_mul(x), reference.silu_and_mul(x))
    finally:
        kernels.set_backend(previous)


@pytest.mark.gpu
def test_gpu_fused_layer_kernels():
    # Full-size shapes of the kernels that cut a decode layer's launches: Q/K norms + RoPE + KV store, gate/up +
    # SiLU-and-mul.
    from kernels import reference, triton_attention

    check = _check_module()
    checker = check.Checker(torch, reference, triton_attention, "cuda")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        checker.qkv_prep(dtype, 77, 32, 8, 128, 128, True, g)
        checker.qkv_prep(dtype, 5, 14, 2, 64, 32, False, g)
        for rows in (1, 16, 33):
            checker.gate_up(dtype, rows, 4096, 12288, g)
    _assert_all_ok(checker)


@pytest.mark.gpu
@pytest.mark.parametrize("config,expected", [("qwen3-8b", 6), ("qwen3-0.6b", 8)])
def test_gpu_decode_layer_launches_at_most_8_kernels(config, expected):
    # One decoder layer of a batch-1 decode step (two layers, random weights, fed layer 0's output) launches at most 8
    # device kernels with the fusions on; more with every fusion off, so that the count measures the fusions. Qwen3-8B:
    # 6 (QKV with the norm, decode split with the Q/K norms + RoPE + K/V store, decode merge, O with the residual add,
    # gate/up with the norm + SiLU, down with the residual add). Qwen3-0.6B: 8, its two norms apart (its projections
    # launch with PDL, where the norms in them measured slower: kernels.fuses_norms).
    import kernels
    from bench import kernels_per_layer as kpl
    from radixserve.layers.linear import set_gemm_split_k

    model, cfg = kpl.build_model(config, num_layers=2)
    ctx, _, _ = kpl.decode_step(model, cfg, 1, 0, 300)
    previous = dict(kernels.OPTIONS)
    try:
        set_gemm_split_k(False)
        fused = kpl.layer_kernels(model, cfg, ctx, 1)
        kernels.configure(**kpl.UNFUSED)
        set_gemm_split_k(True)
        unfused = kpl.layer_kernels(model, cfg, ctx, 1)
    finally:
        kernels.configure(**previous)
        set_gemm_split_k(True)
    print("fused:", fused, "unfused:", unfused, sep="\n")
    assert len(fused) == expected and "_qk_norm_rope_store_kernel" not in fused, fused
    assert ("_rmsnorm_kernel" in fused) == (config == "qwen3-0.6b"), fused
    assert len(unfused) > len(fused)


@pytest.mark.gpu
def test_gpu_decode_prefetch_before_the_wait_changes_nothing():
    # The decode kernel reads its bounds and asks L2 for its first K/V block before its PDL wait; with the prefetch
    # off it reads the same rows after. Same programs, same sums: the outputs are bitwise equal, in a batch whose
    # contexts end mid-block, span many splits and start empty splits (a context shorter than the split count).
    import kernels
    from kernels import triton_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    seq_lens = [1, 37, 700, 4099, 64]
    num_slots = sum(seq_lens) + 16
    q = torch.randn(len(seq_lens), 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    k_cache = torch.randn(num_slots, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_slots, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randint(0, num_slots, (len(seq_lens), max(seq_lens)), device="cuda", generator=g)
    table = table.to(torch.int32)
    args = (
        table,
        torch.arange(len(seq_lens), device="cuda", dtype=torch.int32),
        torch.tensor(seq_lens, device="cuda", dtype=torch.int32),
        128**-0.5,
        max(seq_lens),
    )
    outs = []
    previous = dict(kernels.OPTIONS)
    try:
        for prefetch in (True, False):
            kernels.configure(pdl_prefetch=prefetch)
            assert triton_attention.prefetches_kv(k_cache, v_cache) == (
                prefetch and kernels.OPTIONS["pdl"] and torch.cuda.get_device_capability()[0] >= 9
            )
            o = torch.full_like(q, float("nan"))
            triton_attention.decode_attention(q, k_cache, v_cache, o, *args, num_kv_splits=16)
            outs.append(o)
    finally:
        kernels.configure(**previous)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
