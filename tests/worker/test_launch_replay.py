"""One layer's attention launches replayed for another layer's caches (kernels/launch_replay.py).

On the GPU: the extend kernel, the plain decode kernel and the grouped decode path (the split kernels) recorded over one
layer's caches and replayed over another's give that layer's outputs bit for bit, and a Triton launch made around
recordable() makes the recording refuse to replay. Without a GPU: the binding of a launch's arguments (positional,
keyword, defaults; launch options left out) and the caches' substitution, with a stand-in for Triton's compiled binary,
and the interpreter's launches refused (no binary to replay), in a child process under TRITON_INTERPRET=1. The prefill
CUDA graphs replay by default: tests/worker/test_gpu_steps.py's greedy outputs cover the server's path, with it on and
off."""

import pytest
import torch
import triton
import triton.language as tl

import kernels
from bench.shared_prefix_batches import make_grouped_batch, run_grouped, run_plain
from kernels import launch_replay, shared_prefix_attention, triton_attention
from kernels.launch_replay import LaunchRecording, recordable, recording


@triton.jit
def _axpy_kernel(X, K, V, Out, scale, N: tl.constexpr = 4):
    pass  # never launched: its signature is what a recording binds


class _StandInBinary:
    """Triton's compiled binary as a recording uses it (binary[grid](*every argument in signature order)), running
    out = x + scale * k + v with torch."""

    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        def runner(x, k, v, out, scale, n):
            self.launched.append((grid, n))
            out.copy_(x + scale * k + v)

        return runner


def test_replay_binds_every_argument_and_puts_the_layers_caches_in_place():
    x, out = torch.randn(8), torch.empty(8)
    caches = [(torch.randn(8), torch.randn(8)) for _ in range(2)]
    binary = _StandInBinary()
    rec = LaunchRecording(*caches[0])
    rec.add(
        _axpy_kernel, binary, (2,), (x, caches[0][0]), {"V": caches[0][1], "Out": out, "scale": 3.0, "num_warps": 4}
    )
    assert rec.replayable
    rec.replay(*caches[1])
    assert torch.equal(out, x + 3.0 * caches[1][0] + caches[1][1])
    assert binary.launched == [((2, 1, 1), 4)]  # the grid padded to 3-D; N's default bound, num_warps left out
    rec.replay(*caches[0])
    assert torch.equal(out, x + 3.0 * caches[0][0] + caches[0][1])


def test_a_view_of_a_cache_or_no_binary_refuses_replay():
    k, v = torch.randn(8), torch.randn(8)
    view = LaunchRecording(k, v)
    view.add(_axpy_kernel, _StandInBinary(), (1,), (torch.randn(8), k[2:], v, torch.empty(6), 1.0), {})
    assert not view.replayable  # replay could not put the layer's cache under the view
    interpreted = LaunchRecording(k, v)
    interpreted.add(_axpy_kernel, None, (1,), (torch.randn(8), k, v, torch.empty(8), 1.0), {})
    assert not interpreted.replayable


def attention_calls(device: str, dtype: torch.dtype):
    """(layer caches, [(name, run(k_cache, v_cache, o), o's shape)]): what a mixed step's attention launches."""
    hq, hkv, d = (8, 2, 32) if device == "cpu" else (32, 8, 128)
    g = torch.Generator().manual_seed(7)
    b = make_grouped_batch([(70, [2, 5, 9]), (33, [1, 3])], [40, 7], hq, hkv, d, dtype, device, g)
    layers = [(b["k_cache"], b["v_cache"]), (torch.randn_like(b["k_cache"]), torch.randn_like(b["v_cache"]))]
    t = 24
    qe, ke, ve = (torch.randn(t, h, d, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    meta = (b["req_to_token"], i32([int(b["req_pool_indices"][0])]), i32([50]), i32([t]), i32([0]), d**-0.5, t)

    def with_caches(k_cache, v_cache):
        return {**b, "k_cache": k_cache, "v_cache": v_cache}

    def extend(k_cache, v_cache, o):
        triton_attention.extend_attention(qe, ke, ve, o, k_cache, v_cache, *meta)

    def plain(k_cache, v_cache, o):
        run_plain(triton_attention, with_caches(k_cache, v_cache), o)

    def split_kernels(k_cache, v_cache, o):
        run_grouped(shared_prefix_attention, with_caches(k_cache, v_cache), o)

    decode = b["q"].shape
    calls = [
        ("extend", extend, qe.shape),
        ("plain decode", plain, decode),
        ("grouped split kernels", split_kernels, decode),
    ]
    return layers, calls


def replay_against_direct(device: str, dtype: torch.dtype) -> list[str]:
    """Each call recorded over layer 0's caches, then replayed over layer 1's, against a direct call over layer 1's;
    returns the names of the calls whose recording was replayable (each asserted equal)."""
    layers, calls = attention_calls(device, dtype)
    replayed = []
    for name, run, shape in calls:
        recorded = torch.full(shape, float("nan"), dtype=dtype, device=device)
        rec = LaunchRecording(*layers[0])
        with recording(rec):
            run(*layers[0], recorded)
        if not rec.replayable:
            continue
        recorded.fill_(float("nan"))
        rec.replay(*layers[1])  # into `recorded` again: the buffer the first launches were given
        direct = torch.full(shape, float("nan"), dtype=dtype, device=device)
        run(*layers[1], direct)
        assert torch.isfinite(direct).all() and torch.equal(recorded, direct), name
        replayed.append(name)
    return replayed


def interpreter_check() -> None:
    layers, calls = attention_calls("cpu", torch.float32)
    for name, run, shape in calls:
        out = torch.full(shape, float("nan"))
        rec = LaunchRecording(*layers[0])
        with recording(rec):
            run(*layers[0], out)
        assert torch.isfinite(out).all() and not rec.replayable, name
        print(f"{name}: computed, not replayable in the interpreter", flush=True)


@pytest.mark.server
def test_the_interpreters_launches_are_never_replayed():
    from interpreter_child import run_interpreted  # tests/helpers (conftest.py); not in the child itself

    stdout = run_interpreted(__file__)
    assert stdout.count("not replayable in the interpreter") == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_replay_over_another_layers_caches_equals_a_direct_launch(dtype):
    assert replay_against_direct("cuda", dtype) == [
        "extend",
        "plain decode",
        "grouped split kernels",
    ]


@pytest.mark.gpu
def test_gpu_a_launch_around_recordable_refuses_replay():
    layers, calls = attention_calls("cuda", torch.bfloat16)
    k, v = layers[0]
    rec = LaunchRecording(k, v)
    with recording(rec):
        calls[0][1](k, v, torch.empty(calls[0][2], dtype=k.dtype, device="cuda"))
        loc = torch.arange(4, dtype=torch.int32, device="cuda")
        kernels.store_kv(k[:4].clone(), v[:4].clone(), k, v, loc)  # its own launch, not through recordable()
    assert not rec.replayable
    assert launch_replay._active is None and recordable(triton_attention._extend_kernel) is not None


if __name__ == "__main__":
    interpreter_check()
