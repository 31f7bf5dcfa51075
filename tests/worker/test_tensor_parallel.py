"""Tensor parallelism on the CPU (gloo): TP=2 and TP=4 ranks compute the same logits as one rank. TP=4 with 2 KV
heads exercises KV-head replication; qwen2 exercises sharded QKV biases; llama its tied, vocab-parallel LM head."""

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from radixserve.config import ServerArgs
from radixserve.protocol import ForwardBatch, WorkerRequest, pack_i32
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import tiny_model_dir
from radixserve.runtime.launcher import free_port

pytestmark = pytest.mark.server  # starts processes (tests/conftest.py)


def make_batch() -> ForwardBatch:
    rng = np.random.default_rng(0)
    lengths = [9, 23, 1]
    ids = rng.integers(0, 49152, sum(lengths)).astype(np.int32)
    slots = rng.permutation(np.arange(1, 257))[: sum(lengths)].astype(np.int32)
    return ForwardBatch(
        step=0,
        req_pool_indices=pack_i32([1, 2, 3]),
        prefix_lens=pack_i32([0, 0, 0]),
        extend_lens=pack_i32(lengths),
        input_ids=ids.tobytes(),
        out_cache_loc=slots.tobytes(),
        sample_mask=bytes([1, 1, 1]),
        new_requests=[WorkerRequest(r, SamplingParams(temperature=0)) for r in (1, 2, 3)],
    )


def run_rank(rank, world, port, model_dir, out_path):
    from radixserve.runtime.distributed import destroy_tensor_parallel, init_tensor_parallel
    from radixserve.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "cpu")
    runner = ModelRunner(
        ServerArgs(device="cpu", tp_size=world, max_total_tokens=256, max_running_requests=4), model_dir
    )
    logits = runner.compute_logits(make_batch(), all_positions=True)
    if rank == 0:
        torch.save(logits, out_path)
    destroy_tensor_parallel()


@pytest.mark.parametrize("arch,world", [("llama", 2), ("qwen2", 2), ("qwen3", 4)])
def test_tp_matches_single_rank(tmp_path, arch, world):
    from radixserve.worker.model_runner import ModelRunner

    model_dir = str(tiny_model_dir(arch))
    single = ModelRunner(ServerArgs(device="cpu", max_total_tokens=256, max_running_requests=4), model_dir)
    expected = single.compute_logits(make_batch(), all_positions=True)
    out_path = str(tmp_path / "logits.pt")
    mp.start_processes(
        run_rank, args=(world, free_port(), model_dir, out_path), nprocs=world, join=True, start_method="spawn"
    )
    got = torch.load(out_path)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
