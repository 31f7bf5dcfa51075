"""On a GPU: the steady state of the overlapped loop never synchronizes the device, and greedy outputs are the same
with the overlap and the prefill CUDA graphs on or off, in the scheduler scenarios of
tests/scheduler/test_scheduler_on_a_tiny_model.py."""

import numpy as np
import pytest
import torch

import kernels
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from scheduler_service.in_process_engine import InProcessEngine
from scheduler_service.request import Req

pytestmark = pytest.mark.gpu

SMALL_GRAPHS = dict(cuda_graph_max_bs=64, prefill_cuda_graph_max_tokens=512)  # (captures in a second or two)
SCENARIOS = [
    dict(),
    dict(chunked_prefill_size=7),
    dict(chunked_prefill_size=-1),
    dict(disable_mixed_batch=True, chunked_prefill_size=7),
    dict(disable_radix_cache=True, chunked_prefill_size=7),
    dict(max_total_tokens=160, chunked_prefill_size=16, init_new_token_ratio=0.05, min_new_token_ratio=0.01),
]


def prompts(n, seed=0, vocab=49152):
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, vocab, int(rng.integers(5, 60))).tolist() for _ in range(4)]
    return [
        roots[i % 4][: int(rng.integers(1, len(roots[i % 4]) + 1))] + rng.integers(0, vocab, 20).tolist()
        for i in range(n)
    ]


def greedy_outputs(config: dict, **flags) -> list[list[int]]:
    engine = InProcessEngine(
        str(tiny_model_dir("llama")),
        device="cuda",
        dtype="float32",
        **{"max_total_tokens": 8192, "max_running_requests": 64, **SMALL_GRAPHS, **config, **flags},
    )
    engine.scheduler.check_invariant_every_step = True
    ps = prompts(24)
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=0.0, max_new_tokens=int(rng.integers(8, 24)), ignore_eos=True) for _ in ps]
    outs = []
    for _ in range(2):  # the second pass hits what the first left in the tree
        results = engine.generate(ps, params)
        assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
        outs.append([r.token_ids for r in results])
    return outs


@pytest.mark.parametrize("config", SCENARIOS)
def test_same_greedy_outputs_with_overlap_and_prefill_graphs_on_or_off(config):
    expected = greedy_outputs(config, disable_overlap_schedule=True, disable_prefill_cuda_graph=True)
    assert greedy_outputs(config) == expected
    assert greedy_outputs(config, disable_prefill_cuda_graph=True) == expected
    assert greedy_outputs(config, disable_overlap_schedule=True) == expected
    previous = kernels.configure(attention_launch_replay=False)  # the pieces' attention launched layer by layer
    try:
        assert greedy_outputs(config) == expected
    finally:
        kernels.configure(**previous)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, top_k=40, seed=3),
        dict(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
    ],
)
def test_steady_state_decode_steps_never_synchronize(sampling):
    engine = InProcessEngine(
        str(tiny_model_dir("qwen3")), device="cuda", max_total_tokens=8192, max_running_requests=32, **SMALL_GRAPHS
    )
    s = engine.scheduler
    for i, p in enumerate(prompts(16, seed=2)):
        s.add_request(Req(f"r{i}", p, SamplingParams(max_new_tokens=64, ignore_eos=True, **sampling)))
    for _ in range(8):  # prefill, the first decodes, and a few steady ones
        engine.loop.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            engine.loop.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.loop.run_until_idle()
    s.check_invariant()
